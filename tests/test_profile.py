"""Profiled mode: the profile database file, op keys, ``profile_program`` and ``autoplan profile``.

Everything runs in one process on a fake 2-rank mesh (``planning_mesh(Cluster.preset("2xCPU"))``)
with the small MLP of ``tests/zoo.py``; ``AUTOPLAN_CACHE_DIR`` points into ``tmp_path`` so the
real home cache is never touched.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from autoplan.cost_models.cluster import Cluster
from autoplan.cost_models.errors import PlanError, ProfileError
from autoplan.cost_models.profile_db import VERSION, DeviceKey, ProfileDB, default_cache_dir, default_db_path
from autoplan.passes.op_keys import local_shard_shape, op_key, optimizer_key
from autoplan.passes.strategies import Strategy, StrategyTable, build_strategy_table
from autoplan.passes.trace import TracedProgram, trace_training_step
from autoplan.planner.mesh import planning_mesh
from autoplan.runtime.op_timing import _interleaved_times_s, profile_program
from autoplan.tools.cli import main
from tests.zoo import mlp, mlp_batch, mse_loss

CLI_MODELS = Path(__file__).resolve().with_name("cli_models.py")
FAST = {"warmup": 1, "repeats": 2}
"""Few timing rounds: the tests check bookkeeping, not precision."""


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own profile cache under ``tmp_path``."""
    path = tmp_path / "cache"
    monkeypatch.setenv("AUTOPLAN_CACHE_DIR", str(path))
    return path


@pytest.fixture(scope="module")
def traced() -> TracedProgram:
    x, y = mlp_batch()
    return trace_training_step(mlp(), (x,), loss_fn=mse_loss, example_targets=(y,))


@pytest.fixture()
def planned(traced: TracedProgram) -> Iterator[tuple[StrategyTable, object]]:
    """The MLP's strategy table on a fake 2-rank CPU mesh, and that mesh."""
    with planning_mesh(Cluster.preset("2xCPU")) as mesh:
        yield build_strategy_table(traced, mesh), mesh


def _node(traced: TracedProgram, name: str) -> torch.fx.Node:
    return next(n for n in traced.graph_module.graph.nodes if n.name == name)


def _strategy(table: StrategyTable, node: str, text: str) -> Strategy:
    return next(s for s in table.nodes[node].strategies if str(s) == text)


def _other_device() -> DeviceKey:
    return DeviceKey(kind="cpu", name="Some Other CPU 9000", torch_version="0.0.1", cuda_version=None, num_threads=64)


# --- the database file ------------------------------------------------------------------------


def test_cache_dir_follows_autoplan_cache_dir(cache_dir: Path) -> None:
    key = DeviceKey.current("cpu")
    assert default_cache_dir() == cache_dir
    assert default_db_path(key) == cache_dir / "profiles" / f"cpu-v{VERSION}-{key.digest()}.json"


def test_db_round_trip_keeps_entries_and_resaves_byte_identical(tmp_path: Path) -> None:
    db = ProfileDB.open_for_current_device("cpu")
    assert len(db) == 0 and not db.path.exists()
    db.record("aten.mm.default(f32[8,16], f32[16,32])", 1.25e-5)
    db.record("optim.adam(f32[32,16])", 3e-6)
    db.record("aten.gelu.default(f32[8,32])", 0.1 + 0.2)  # a float whose repr is long
    path = db.save()
    first = path.read_bytes()

    loaded = ProfileDB.load(path, expect=DeviceKey.current("cpu"))
    assert {k: loaded.lookup(k) for k in loaded} == {k: db.lookup(k) for k in db}
    assert loaded.lookup("aten.relu.default(f32[1])") is None
    loaded.save()
    assert path.read_bytes() == first
    data = json.loads(first)
    assert data["format"] == "autoplan-profile-db" and data["version"] == VERSION == 4
    assert data["device"]["num_threads"] == torch.get_num_threads()


def test_loading_a_db_measured_on_another_device_names_the_file_and_the_fix(tmp_path: Path) -> None:
    path = tmp_path / "other.json"
    ProfileDB(path, _other_device(), {"aten.mm.default(f32[2,2], f32[2,2])": 1e-6}).save()
    with pytest.raises(ProfileError) as exc:
        ProfileDB.load(path, expect=DeviceKey.current("cpu"))
    message = str(exc.value)
    assert str(path) in message and "Some Other CPU 9000" in message
    assert "re-run `autoplan profile`" in message and "\n" not in message
    assert len(ProfileDB.load(path)) == 1  # without an expectation it loads


def test_a_thread_count_mismatch_suggests_omp_num_threads(tmp_path: Path) -> None:
    here = DeviceKey.current("cpu")
    path = tmp_path / "threads.json"
    ProfileDB(path, DeviceKey(**{**here.to_dict(), "num_threads": here.num_threads + 7})).save()
    with pytest.raises(ProfileError, match=f"OMP_NUM_THREADS={here.num_threads + 7}"):
        ProfileDB.load(path, expect=here)


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        ("{not json", "not valid JSON"),
        ('["a list"]', "not an autoplan profile database"),
        ('{"format": "autoplan-profile-db", "version": 99, "device": {}, "time_s": {}}', "schema version 99"),
    ],
)
def test_a_corrupted_db_raises_naming_the_file_and_is_left_untouched(content: str, fragment: str) -> None:
    path = default_db_path(DeviceKey.current("cpu"))
    path.parent.mkdir(parents=True)
    path.write_text(content)
    with pytest.raises(ProfileError, match=fragment) as exc:
        ProfileDB.open_for_current_device("cpu")
    assert str(path) in str(exc.value)
    assert path.read_text() == content


def test_a_db_with_an_invalid_time_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "bad_time.json"
    db = ProfileDB(path, DeviceKey.current("cpu"), {"k": 1.0})
    data = db.to_dict()
    data["time_s"]["k"] = "fast"
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match="invalid time 'fast'"):
        ProfileDB.load(path)


def test_profile_error_is_a_plan_error() -> None:
    assert issubclass(ProfileError, PlanError)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_db_without_a_gpu_is_a_one_line_profile_error() -> None:
    with pytest.raises(ProfileError, match="--device cuda needs a CUDA GPU"):
        ProfileDB.open_for_current_device("cuda")


# --- keys -------------------------------------------------------------------------------------


def test_op_key_differs_between_replicated_and_sharded_mm(traced: TracedProgram, planned: tuple) -> None:
    table, _ = planned
    mm = _node(traced, "mm")  # grad_input = grad_out (8, 8) @ W (8, 32)
    replicated = op_key(mm, _strategy(table, "mm", "R<-(R,R)"), (2,))
    sharded = op_key(mm, _strategy(table, "mm", "S(0)<-(S(0),R)"), (2,))
    assert replicated == "aten.mm.default(f32[8,8], f32[8,32])"
    assert sharded == "aten.mm.default(f32[4,8], f32[8,32])"


def test_op_key_is_equal_for_strategies_with_equal_local_shapes(traced: TracedProgram, planned: tuple) -> None:
    table, _ = planned
    mm = _node(traced, "mm")
    # a Partial input keeps its full size: the same kernel as the replicated one
    assert op_key(mm, _strategy(table, "mm", "P<-(P,R)"), (2,)) == op_key(mm, _strategy(table, "mm", "R<-(R,R)"), (2,))
    # on a 2x2 mesh, S(0) on either axis leaves the same (4, 8) shard
    r = (Replicate(), Replicate())
    on_axis0 = Strategy(output_specs=(None,), input_specs=((Shard(0), Replicate()), r))
    on_axis1 = Strategy(output_specs=(None,), input_specs=((Replicate(), Shard(0)), r))
    assert op_key(mm, on_axis0, (2, 2)) == op_key(mm, on_axis1, (2, 2)) == "aten.mm.default(f32[4,8], f32[8,32])"


def test_op_key_marks_transposed_inputs_and_skips_untimed_nodes(traced: TracedProgram, planned: tuple) -> None:
    table, _ = planned
    addmm = _node(traced, "addmm")  # bias, x (8, 16), t(W) (16, 32) non-contiguous
    assert op_key(addmm, table.nodes["addmm"].strategies[0], (2,)) == (
        "aten.addmm.default(f32[32], f32[8,16], f32[16,32]@10)"
    )
    placeholder = _node(traced, "input_0")
    output = next(n for n in traced.graph_module.graph.nodes if n.op == "output")
    getitem = next(n for n in traced.graph_module.graph.nodes if n.name.startswith("getitem"))
    anything = Strategy(output_specs=(None,), input_specs=())
    assert op_key(placeholder, anything, (2,)) is None
    assert op_key(output, anything, (2,)) is None
    assert op_key(getitem, anything, (2,)) is None


@pytest.mark.parametrize(
    "spec", [(Shard(0), Shard(0)), (Shard(1), Shard(0)), (Partial(), Shard(1)), (Replicate(), Replicate())]
)
def test_local_shard_shape_matches_dtensor_on_rank_0(spec: tuple) -> None:
    with planning_mesh(Cluster.preset("4xCPU", mesh_shape=(2, 2))) as mesh:
        for shape in [(7, 5), (8, 3), (5, 9)]:
            expected, _ = compute_local_shape_and_global_offset(shape, mesh, spec)
            assert local_shard_shape(shape, spec, (2, 2)) == tuple(expected), (shape, spec)


def test_optimizer_key_names_optimizer_dtype_and_local_shape() -> None:
    assert optimizer_key("adam", (16, 32), torch.float32) == "optim.adam(f32[16,32])"
    assert optimizer_key("sgd", torch.Size([4]), torch.bfloat16) == "optim.sgd(bf16[4])"


# --- profiling --------------------------------------------------------------------------------


def test_profile_program_measures_every_key_once_then_everything_is_cached(
    traced: TracedProgram, planned: tuple, capsys: pytest.CaptureFixture[str]
) -> None:
    table, mesh = planned
    db = ProfileDB.open_for_current_device("cpu")
    first = profile_program(traced, table, mesh, db, optimizer="adam", **FAST)
    assert first.num_failed == 0, [str(e) for e in first.entries if e.source == "failed"]
    assert first.num_measured == first.num_keys == len(db) == len({e.key for e in first.entries})
    assert any(e.kind == "optimizer" for e in first.entries) and any(e.kind == "op" for e in first.entries)
    assert capsys.readouterr().err == ""  # no progress bar when stderr is not a terminal

    second = profile_program(traced, table, mesh, db, optimizer="adam", **FAST)
    assert (second.num_measured, second.num_cached, second.num_failed) == (0, first.num_keys, 0)
    assert [e.time_s for e in second.entries] == [e.time_s for e in first.entries]


def test_a_profiled_mm_time_is_positive_and_finite(traced: TracedProgram, planned: tuple) -> None:
    table, mesh = planned
    db = ProfileDB.open_for_current_device("cpu")
    report = profile_program(traced, table, mesh, db, optimizer="sgd", **FAST)
    key = op_key(_node(traced, "mm"), _strategy(table, "mm", "S(0)<-(S(0),R)"), (2,))
    time_s = db.lookup(key)
    assert time_s is not None and 0 < time_s < 1 and math.isfinite(time_s)
    assert any(e.key.startswith("optim.sgd(") for e in report.entries)


def test_timed_calls_cycle_through_input_copies_beyond_the_cache(
    traced: TracedProgram, planned: tuple, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A step reads an op's inputs from memory (they were written long before); a loop over one
    # set of inputs reads them from the cache. The mm's two f32 inputs are 8*8*4 + 8*32*4 =
    # 1280 bytes on a rank: with a 4 KiB footprint, ceil(4096 / 1280) = 4 copies, used in turn.
    from autoplan.runtime import op_timing as prof

    table, mesh = planned
    mm, strategy = _node(traced, "mm"), _strategy(table, "mm", "R<-(R,R)")
    monkeypatch.setattr(prof, "COLD_FOOTPRINT_BYTES", 4096)
    call = prof._op_call(mm, strategy, "op", mesh, torch.Generator().manual_seed(0))
    with torch.no_grad():
        outs = [_only(call()) for _ in range(5)]
    assert all(not torch.equal(outs[0], o) for o in outs[1:4])  # other random inputs
    assert torch.equal(outs[0], outs[4])  # the first copy again
    monkeypatch.setattr(prof, "COLD_FOOTPRINT_BYTES", 1024)  # inputs alone exceed it: one copy
    call = prof._op_call(mm, strategy, "op", mesh, torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(_only(call()), _only(call()))


def _only(outs: object) -> torch.Tensor:
    """The one output of a lowered op's graph (a list of local tensors)."""
    assert isinstance(outs, list) and len(outs) == 1 and type(outs[0]) is torch.Tensor, outs
    return outs[0]


def _lowered(traced: TracedProgram, mesh: object, node: str, strategy: Strategy, kind: str = "op") -> tuple:
    from autoplan.runtime import op_timing as prof

    n = _node(traced, node)
    tmpl = prof.op_template(n)
    forward, inputs = prof._lower_op(n, strategy, kind, mesh, torch.Generator().manual_seed(0), tmpl)
    ops = [x.target for x in forward.__self__.graph.nodes if x.op == "call_function"]
    return forward, inputs, ops


def test_a_key_times_the_local_op_the_lowered_program_runs(traced: TracedProgram, planned: tuple) -> None:
    # The mm's DTensor call is traced as the program is lowered (autoplan.runtime.lowering): what
    # is timed is the one local aten.mm on rank 0's shards, not DTensor's dispatch, and not the
    # view DTensor.from_local adds to each input.
    table, mesh = planned
    forward, inputs, ops = _lowered(traced, mesh, "mm", _strategy(table, "mm", "S(0)<-(S(0),R)"))
    assert ops == [torch.ops.aten.mm.default]
    assert [type(x) for x in inputs] == [torch.Tensor, torch.Tensor]
    assert [tuple(x.shape) for x in inputs] == [(4, 8), (8, 32)]  # x (8, 8) split over 2 ranks, w.t() whole
    with torch.no_grad():
        assert torch.equal(_only(forward(*inputs)), inputs[0] @ inputs[1])


def test_a_fallback_key_times_the_op_and_the_output_wrap_replicated_call_runs(
    traced: TracedProgram, planned: tuple
) -> None:
    table, mesh = planned
    forward, inputs, ops = _lowered(traced, mesh, "mm", _strategy(table, "mm", "R<-(R,R)"), "fallback")
    assert ops == [torch.ops.aten.mm.default]  # (the output wrap's identity view: dropped, as in the program)
    with torch.no_grad():
        assert torch.equal(_only(forward(*inputs)), inputs[0] @ inputs[1])


def test_a_collective_in_a_one_op_trace_is_not_timed_as_compute(traced: TracedProgram, planned: tuple) -> None:
    # mm on (S(0), S(0)) is not a strategy DTensor has: it redistributes one input inside the
    # call. The collective and its wait leave the timed graph; its result is a new input.
    _, mesh = planned
    s0 = (Shard(0),)
    forward, inputs, ops = _lowered(traced, mesh, "mm", Strategy(output_specs=(s0,), input_specs=(s0, s0)))
    assert ops and all(op.namespace == "aten" for op in ops), ops
    assert [tuple(x.shape) for x in inputs] == [(4, 8), (4, 32), (8, 32)]  # the shards, the gathered w.t()
    assert all(type(x) is torch.Tensor for x in inputs)
    with torch.no_grad():
        assert torch.equal(_only(forward(*inputs)), inputs[0] @ inputs[2])


def test_profile_program_rejects_a_mesh_of_another_device_type(traced: TracedProgram, planned: tuple) -> None:
    table, mesh = planned
    db = ProfileDB.open_for_current_device("cpu")
    with pytest.raises(ProfileError, match="device_type='cuda'"):
        profile_program(traced, table, mesh, db, device="cuda")


# --- CLI --------------------------------------------------------------------------------------


def test_cli_profile_writes_the_db_and_a_second_run_measures_nothing(
    cache_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [
        "profile",
        f"{CLI_MODELS}:mlp",
        "--cluster",
        "2xCPU",
        "--repeats",
        "2",
        "--warmup",
        "1",
        "--concurrent",
        "1",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    (path,) = (cache_dir / "profiles").glob("cpu-*.json")
    assert f"profile database: {path}" in out and "profiled_us" in out
    last = out.strip().splitlines()[-1]
    num_keys = len(ProfileDB.load(path))
    assert last.startswith(f"profile: keys={num_keys} matmul_analytic_err_median=") and last.endswith("%")

    assert main([*args, "--quiet"]) == 0
    assert capsys.readouterr().out.strip() == last  # quiet: the final line only, same keys


def test_cli_profile_with_a_corrupted_db_exits_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{oops")
    rc = main(["profile", f"{CLI_MODELS}:mlp", "--cluster", "2xCPU", "--profile-db", str(bad)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("autoplan: error: ") and str(bad) in err[0]
    assert bad.read_text() == "{oops"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cli_profile_on_cuda_without_a_gpu_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["profile", f"{CLI_MODELS}:mlp", "--cluster", "2xCPU", "--device", "cuda"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--device cuda needs a CUDA GPU" in err[0]


def test_cpu_keys_are_timed_interleaved_in_turn(monkeypatch) -> None:  # noqa: ANN001
    """On CPU each round calls every key once, in turn (as a program runs different ops one
    after the other), each call timed alone; a key's time is its median round. The clock is a
    fake one each call advances by a scripted duration (a busy wait on the real clock failed
    under load: a 3 ms wait measured 12 ms), with one slow round per key that the median drops."""
    import autoplan.runtime.op_timing as op_timing

    now = [0.0]
    monkeypatch.setattr(op_timing, "time", SimpleNamespace(perf_counter=lambda: now[0]))  # this module's clock only
    calls: list[str] = []
    # per key: warm-up round, then 5 timed rounds; the 3rd timed round is slow for every key
    durations = {"a": [5e-3, 1e-3, 1e-3, 9e-3, 1e-3, 1e-3], "b": [5e-3, 3e-3, 3e-3, 20e-3, 3e-3, 3e-3], "c": [0.0] * 6}

    def timed(name: str) -> Callable[[], None]:
        def fn() -> None:
            now[0] += durations[name][sum(1 for c in calls if c == name)]
            calls.append(name)

        return fn

    times = _interleaved_times_s([timed("a"), timed("b"), timed("c")], warmup=1, repeats=5)
    assert calls == ["a", "b", "c"] * 6  # one warm-up round, then 5 timed ones, never twice in a row
    assert times == [pytest.approx(1e-3), pytest.approx(3e-3), 0.0]


def test_interleaved_chunks_bound_keys_and_input_bytes(traced: TracedProgram, planned, monkeypatch) -> None:  # noqa: ANN001
    """Keys are timed interleaved in consecutive chunks of at most INTERLEAVE_KEYS keys and
    INTERLEAVE_BYTES bytes of inputs alive at once (a larger key alone)."""
    import autoplan.runtime.op_timing as profile_pass

    table, _ = planned
    work = profile_pass._distinct_keys(traced, table, "adam")
    sizes = {w.key: profile_pass._key_bytes(w, table) for w in work}
    assert len(work) > 8 and min(sizes.values()) > 0
    budget = sorted(sizes.values())[len(sizes) // 2]  # the median key's inputs
    monkeypatch.setattr(profile_pass, "INTERLEAVE_BYTES", budget)
    monkeypatch.setattr(profile_pass, "INTERLEAVE_KEYS", 4)
    chunks = profile_pass._interleave_chunks(work, table)
    assert [w for c in chunks for w in c] == work
    for chunk in chunks:
        assert 1 <= len(chunk) <= 4
        assert len(chunk) == 1 or sum(sizes[w.key] for w in chunk) <= budget
    assert any(len(c) > 1 for c in chunks) and any(sizes[c[0].key] > budget for c in chunks if len(c) == 1)


def test_a_key_that_raises_while_timed_fails_alone() -> None:
    """A call that runs once and raises in a later round fails its key only (left to the
    analytic model); the other keys are still timed, and it is not called again."""
    calls = {"ok": 0, "flaky": 0}

    def ok() -> None:
        calls["ok"] += 1

    def flaky() -> None:
        calls["flaky"] += 1
        if calls["flaky"] == 3:
            raise RuntimeError("out of memory")

    times = _interleaved_times_s([ok, flaky], warmup=1, repeats=5)
    assert times[0] is not None and times[0] >= 0 and times[1] is None
    assert calls == {"ok": 6, "flaky": 3}


def test_cpu_rank_profiles_are_keyed_and_read_at_the_ranks_thread_count(monkeypatch, tmp_path) -> None:
    """Planning for CPU ranks reads the profile taken with the ranks' intra-op threads
    (OMP_NUM_THREADS, else 1 as under torchrun), not this process's (torch's default: a thread
    per core, which oversubscribes a machine shared by several timing processes)."""
    from autoplan.cost_models.profile_db import cpu_rank_threads
    from autoplan.planner.ilp import open_profile

    monkeypatch.setenv("AUTOPLAN_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert cpu_rank_threads() == 1
    for bad in ("0", "two", "-3", ""):
        monkeypatch.setenv("OMP_NUM_THREADS", bad)
        assert cpu_rank_threads() == 1, bad
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu_rank_threads() == 3
    key = DeviceKey.cpu_ranks()
    assert key.num_threads == 3 and key.name == DeviceKey.current("cpu").name
    cluster = Cluster.preset("2xCPU")
    assert open_profile(cluster, "auto") is None  # nothing profiled at 3 threads yet
    ProfileDB(default_db_path(key), key, {"k": 1e-6}).save()
    found = open_profile(cluster, "auto")
    assert found is not None and found.device == key and found.lookup("k") == 1e-6
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert open_profile(cluster, "auto") is None  # a 3-thread profile is not read for 1-thread ranks
