"""Sharded data loading (autoplan.runtime.data): every rank materialises exactly the rows of each
step's global batch that ``local_shard`` would keep of it for the planned placement.

Single process: each of 4 ranks is played on a fake process group (no communication); its mesh
gives the coordinate, ``local_shard`` of the global batch gives the expected rows, and the
loader's :class:`BatchLayout` is built from the specs and that coordinate alone. A sample's
value is its dataset index, so a loaded tensor names the samples it holds.
"""

from __future__ import annotations

import copy
import itertools
import json
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils.data import Dataset, IterableDataset

import autoplan
from autoplan.cost_models.errors import PlanError
from autoplan.passes.layers import find_layers
from autoplan.passes.placement import parse_spec
from autoplan.passes.trace import trace_training_step
from autoplan.runtime.data import BatchLayout, LocalBatch, ShardedLoader
from autoplan.runtime.lowering import local_shard
from tests import test_pipeline_equivalence as pipe
from tests import zoo
from tests.harness import RankPool, assert_trains_like_reference, cpu_cluster, reference_optimizer, train_both

WORLD = 4
SEQ = 4


class IndexedTokens(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Sample ``i``: input ``(SEQ,)`` and target ``(SEQ,)`` holding ``100 * i + position``."""

    def __init__(self, num_samples: int) -> None:
        self.num_samples = num_samples

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        row = 100 * i + torch.arange(SEQ)
        return row, row + 1


class IndexedStream(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, num_samples: int) -> None:
        self.data = IndexedTokens(num_samples)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return (self.data[i] for i in range(len(self.data)))


def _on_rank(rank: int, mesh_shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=WORLD)
    return init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)


def _layout(mesh: DeviceMesh, spec: Sequence[str], *, batch: int) -> BatchLayout:
    coordinate = mesh.get_coordinate()
    assert coordinate is not None
    return BatchLayout(
        global_batch_size=batch,
        mesh_shape=tuple(mesh.shape),
        coordinate=tuple(coordinate),
        specs=(parse_spec(spec), parse_spec(spec)),
        num_inputs=1,
        sample_shapes=((SEQ,), (SEQ,)),
    )


def _global_batch(
    dataset: IndexedTokens, order: torch.Tensor, step: int, batch: int
) -> tuple[torch.Tensor, torch.Tensor]:
    samples = [dataset[int(i)] for i in order[step * batch : (step + 1) * batch]]
    return torch.stack([x for x, _ in samples]), torch.stack([y for _, y in samples])


@pytest.mark.parametrize(
    ("mesh_shape", "spec", "batch"),
    [
        ((4,), ("S(0)",), 8),  # dp=4
        ((4,), ("S(0)",), 10),  # dp=4, uneven: DTensor keeps 3, 3, 3, 1 rows
        ((2, 2), ("S(0)", "R"), 8),  # dp=2 x tp=2: tensor-parallel peers load the same rows
        ((2, 2), ("S(0)", "S(1)"), 8),  # dp=2 x sequence-parallel: rows, then the sequence cut
        ((2, 2), ("S(0)", "S(0)"), 8),  # batch split over both axes
    ],
)
@pytest.mark.parametrize("shuffle", [False, True])
def test_each_rank_loads_the_rows_local_shard_keeps(
    mesh_shape: tuple[int, ...], spec: tuple[str, ...], batch: int, shuffle: bool
) -> None:
    dataset = IndexedTokens(3 * batch + 1)  # three steps; the partial last batch is dropped
    loaded_rows: list[set[int]] = []
    for rank in range(WORLD):
        mesh = _on_rank(rank, mesh_shape, tuple(f"a{i}" for i in range(len(mesh_shape))))
        try:
            loader = ShardedLoader(dataset, _layout(mesh, spec, batch=batch), shuffle=shuffle, seed=7)
            assert len(loader) == 3
            order = loader.order()
            steps = list(loader)
            for step, got in enumerate(steps):
                x, y = _global_batch(dataset, order, step, batch)
                (gx,), (gy,) = loader.global_batch(step)  # what one device trains on (autoplan run --compare)
                assert torch.equal(gx, x) and torch.equal(gy, y)
                assert torch.equal(got.inputs[0], local_shard(x, mesh, parse_spec(spec)))
                assert torch.equal(got.targets[0], local_shard(y, mesh, parse_spec(spec)))
                assert list(got.sample_indices[0]) == [int(v) // 100 for v in got.inputs[0][:, 0]]
                assert got.nbytes == got.inputs[0].nbytes + got.targets[0].nbytes
            loaded_rows.append({i for b in steps for i in b.sample_indices[0]})
        finally:
            dist.destroy_process_group()
    # the order is the same on every rank: together the ranks load each step's samples, no other
    assert set().union(*loaded_rows) == set(order[: 3 * batch].tolist())
    if shuffle:
        assert order.tolist() != sorted(order.tolist())


def _microbatch_shards(stage_mesh: DeviceMesh, microbatches: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """A global batch -> this rank's ``S(0)`` shard of each of its micro-batches, concatenated."""

    def shards(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([local_shard(mb, stage_mesh, parse_spec(["S(0)"])) for mb in t.tensor_split(microbatches)])

    return shards


@pytest.mark.parametrize("pp", [2, 4])
def test_pipeline_first_stage_loads_the_inputs_and_last_stage_the_targets_of_its_share_of_every_microbatch(
    pp: int,
) -> None:
    """pp x dp = 4 ranks, 2 micro-batches: the schedule cuts the batch into micro-batches; stage 0
    keeps its shard of each micro-batch's inputs (StageModule.run_forward), the last stage of its
    targets (the schedule's target=); the loader yields those concatenations, and the ranks of
    the stages between load nothing."""
    batch, microbatches = 8, 2
    dataset = IndexedTokens(2 * batch)
    for rank in range(WORLD):
        mesh = _on_rank(rank, (pp, WORLD // pp), ("pp", "dp"))
        try:
            stage_mesh = mesh["dp"]
            stage = mesh.get_local_rank("pp")
            coordinate = mesh.get_coordinate()
            assert coordinate is not None
            layout = BatchLayout(
                global_batch_size=batch,
                num_microbatches=microbatches,
                mesh_shape=tuple(stage_mesh.shape),
                coordinate=tuple(coordinate[1:]),
                specs=(parse_spec(["S(0)"]), parse_spec(["S(0)"])),
                num_inputs=1,
                sample_shapes=((SEQ,), (SEQ,)),
                reads_inputs=stage == 0,
                reads_targets=stage == pp - 1,
            )
            for step, got in enumerate(ShardedLoader(dataset, layout)):
                x, y = _global_batch(dataset, torch.arange(len(dataset)), step, batch)
                shards = _microbatch_shards(stage_mesh, microbatches)
                if stage == 0:
                    (inputs,) = got.inputs
                    assert got.targets == () and got.sample_indices[1] == ()
                    assert torch.equal(inputs, shards(x)) and got.nbytes == inputs.nbytes
                    # what the schedule hands stage 0 is each micro-batch's shard
                    assert [c.shape[0] for c in inputs.tensor_split(microbatches)] == [4 // (WORLD // pp)] * 2
                elif stage == pp - 1:
                    (targets,) = got.targets
                    assert got.inputs == () and got.sample_indices[0] == ()
                    assert torch.equal(targets, shards(y)) and got.nbytes == targets.nbytes
                else:
                    assert got.inputs == () and got.targets == () and got.nbytes == 0
        finally:
            dist.destroy_process_group()


def test_iterable_dataset_keeps_the_same_rows_as_the_map_style_one() -> None:
    layout = BatchLayout(
        global_batch_size=4, mesh_shape=(2, 2), coordinate=(1, 0), specs=(parse_spec(["S(0)", "R"]),) * 2,
        num_inputs=1, sample_shapes=((SEQ,), (SEQ,)),
    )  # fmt: skip
    mapped = list(ShardedLoader(IndexedTokens(9), layout))
    streamed = list(ShardedLoader(IndexedStream(9), layout))
    assert len(streamed) == len(mapped) == 2
    for a, b in zip(mapped, streamed, strict=True):
        assert torch.equal(a.inputs[0], b.inputs[0]) and a.sample_indices == b.sample_indices
    assert mapped[1].sample_indices[0] == (6, 7)


def _dp2_layout(**overrides: object) -> BatchLayout:
    kwargs: dict[str, object] = dict(
        global_batch_size=4, mesh_shape=(2,), coordinate=(0,), specs=(parse_spec(["S(0)"]),) * 2,
        num_inputs=1, sample_shapes=((SEQ,), (SEQ,)),
    )  # fmt: skip
    return BatchLayout(**(kwargs | overrides))  # type: ignore[arg-type]


def test_bad_data_raises_plan_errors_that_name_the_fix() -> None:
    with pytest.raises(PlanError, match="one step needs a global batch of 4: add samples"):
        ShardedLoader(IndexedTokens(3), _dp2_layout())
    with pytest.raises(PlanError, match="one step needs a global batch of 4"):
        list(ShardedLoader(IndexedStream(3), _dp2_layout()))
    with pytest.raises(PlanError, match="does not split into 3 micro-batches"):
        _dp2_layout(num_microbatches=3)
    with pytest.raises(PlanError, match="keeps no sample"):
        ShardedLoader(IndexedTokens(8), _dp2_layout(global_batch_size=1, coordinate=(1,)))
    with pytest.raises(PlanError, match="1 fields; the program reads 1 input.* and 1 target.*collate_fn"):
        next(iter(ShardedLoader(IndexedTokens(8), _dp2_layout(), collate_fn=lambda s: torch.stack([x for x, _ in s]))))
    with pytest.raises(PlanError, match=r"input 0 samples have shape \[4\]; the plan was made for \[5\]"):
        next(iter(ShardedLoader(IndexedTokens(8), _dp2_layout(sample_shapes=((5,), (SEQ,))))))
    with pytest.raises(PlanError, match="shuffle the IterableDataset"):
        ShardedLoader(IndexedStream(8), _dp2_layout(), shuffle=True)
    with pytest.raises(PlanError, match="handles one R or S"):
        _dp2_layout(specs=(parse_spec(["P"]),) * 2)


def test_local_batch_prints_its_shapes() -> None:
    batch = next(iter(ShardedLoader(IndexedTokens(4), _dp2_layout())))
    assert isinstance(batch, LocalBatch)
    assert str(batch) == "LocalBatch(step 0, [2, 4], [2, 4] of 4)"


# --- training through the loader equals the single-device model (2 gloo ranks) --------------------

LM_SEQ = 16
LM_BATCH = 8


class TokenWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """``num_samples`` seeded windows of ``LM_SEQ + 1`` tokens: ``(input_ids, next tokens)``."""

    def __init__(self, num_samples: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, zoo.VOCAB, (num_samples, LM_SEQ + 1), generator=g)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tokens[i, :-1], self.tokens[i, 1:]


class MLPSamples(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, num_samples: int) -> None:
        self.x, self.y = zoo.mlp_batch(num_samples, seed=5)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def _global_batches(loader: ShardedLoader) -> Callable[[int], tuple[tuple[torch.Tensor], tuple[torch.Tensor]]]:
    """Step ``k``'s whole batch in the loader's order: what the single-device reference trains on."""
    order = loader.order()
    batch = loader.layout.global_batch_size

    def batches(step: int) -> tuple[tuple[torch.Tensor], tuple[torch.Tensor]]:
        samples = [loader.dataset[int(i)] for i in order[step * batch : (step + 1) * batch]]
        return (torch.stack([x for x, _ in samples]),), (torch.stack([y for _, y in samples]),)

    return batches


def _mlp_data_parallel(rank: int, world_size: int) -> dict[str, Any]:  # noqa: ARG001
    """MLP, dp=2 (Adam), 3 shuffled steps of 64 samples through the loader."""
    model = zoo.mlp()
    reference = copy.deepcopy(model)
    dataset = MLPSamples(3 * 64 + 5)
    x, y = dataset.x[:64], dataset.y[:64]
    pins = {"input_0": "S(0)", "target_0": "S(0)", "*.weight": "R", "*.bias": "R"}
    pm = autoplan.parallelize(
        model, cpu_cluster("2xCPU", compute_slowdown=1e5), example_inputs=(x,), loss_fn=zoo.mse_loss,
        example_targets=(y,), pins=pins, optimizer="adam",
    )  # fmt: skip
    loader = pm.data_loader(dataset, shuffle=True, seed=11)
    steps = list(loader)
    # the checked DTensor program reads the same local batch as the lowered one
    checked = pm.forward_backward(steps[0], check=True).item()
    assert checked == pm.forward_backward(steps[0]).item()
    pm.make_optimizer().zero_grad()
    result = train_both(
        pm, reference, batches=_global_batches(loader), local_batches=steps.__getitem__, loss_fn=zoo.mse_loss,
        opt=pm.make_optimizer(lr=1e-2), ref_opt=reference_optimizer("adam", list(reference.parameters()), 1e-2),
        check=False,
    )  # fmt: skip
    return result | {"loaded_bytes": steps[0].nbytes, "global_bytes": x.nbytes + y.nbytes}


def _gpt2_pipeline(rank: int, world_size: int, pp: int, plan_json: str) -> dict[str, Any]:  # noqa: ARG001
    """GPT-2 (4 layers, SGD with momentum), ``pp`` stages x ``2 // pp`` data-parallel ranks,
    4 micro-batches of the global batch of 8, 3 steps through the loader."""
    from autoplan.planner.plan import Plan
    from autoplan.runtime.pipeline import build_pipeline

    model = zoo.gpt2_tiny(num_layers=pipe.NUM_LAYERS)
    reference = copy.deepcopy(model)
    dataset = TokenWindows(3 * LM_BATCH + 3)
    mb = LM_BATCH // pipe.NUM_MICROBATCHES
    ids, labels = dataset.tokens[:mb, :-1].contiguous(), dataset.tokens[:mb, 1:].contiguous()
    traced = trace_training_step(model, (ids,), loss_fn=zoo.lm_loss, example_targets=(labels,))
    layering = find_layers(traced)
    mesh = init_device_mesh("cpu", (pp, 2 // pp), mesh_dim_names=("pp", "x"))
    plan = Plan.from_dict(json.loads(plan_json))
    pm = build_pipeline(
        model, traced, plan.assignment(), layering, stage_starts=pipe._stage_starts(layering.num_segments, pp),
        mesh=mesh, axis_names=("x",), schedule="1f1b", num_microbatches=pipe.NUM_MICROBATCHES,
        fallback_nodes=frozenset(plan.fallback_ops), device=torch.device("cpu"), optimizer="sgd_momentum",
    )  # fmt: skip
    loader = pm.data_loader(dataset, shuffle=True, seed=3)
    steps = list(loader)
    result = train_both(
        pm, reference, batches=_global_batches(loader), local_batches=steps.__getitem__, loss_fn=zoo.lm_loss,
        opt=pm.make_optimizer(lr=0.1), ref_opt=torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9),
        check=False,
    )  # fmt: skip
    return result | {
        "loaded_bytes": steps[0].nbytes,
        "loaded_fields": (len(steps[0].inputs), len(steps[0].targets)),
        "global_bytes": 2 * LM_BATCH * LM_SEQ * 8,
    }


@pytest.mark.slow
def test_training_through_the_loader_equals_single_device_on_the_same_global_batches() -> None:
    """dp=2 ``ParallelModel`` (each rank loads half of each batch); a pp=1 x dp=2 pipeline (each
    rank loads its row of each of the 4 micro-batches, inputs and targets); a pp=2 pipeline
    (stage 0 loads every row's inputs, stage 1 every row's targets). Losses and parameters equal
    the single-device run on the same batches."""
    with RankPool(2, timeout_s=600) as pool:
        results = pool.run(_mlp_data_parallel)
        assert_trains_like_reference(results)
        assert [r["loaded_bytes"] for r in results] == [results[0]["global_bytes"] // 2] * 2
        for pp in (1, 2):
            case = pipe.PipeCase(model="gpt2", layout="dp", schedule="1f1b", pp=pp, stage_size=2 // pp)
            results = pool.run(_gpt2_pipeline, pp, pipe._plan_json(case))
            assert_trains_like_reference(results, rel_tol=1e-5, atol=1e-6)
            full = results[0]["global_bytes"]
            assert [r["loaded_bytes"] for r in results] == [full // 2] * 2  # half the rows, or every row's half
            assert [r["loaded_fields"] for r in results] == ([(1, 1)] * 2 if pp == 1 else [(1, 0), (0, 1)])


def test_steps_out_of_range_or_of_a_stream_name_the_fix() -> None:
    with pytest.raises(PlanError, match=r"step 2 is not one of this epoch's 2 steps: use 0..1"):
        ShardedLoader(IndexedTokens(9), _dp2_layout()).batch(2)
    with pytest.raises(PlanError, match="iterate the loader"):
        ShardedLoader(IndexedStream(9), _dp2_layout()).batch(0)


def test_a_workload_dataset_is_indexed_or_a_stream_shuffled_only_if_indexed_and_excludes_batches() -> None:
    wl = zoo.cli_mlp()
    kw: dict[str, Any] = {"model": wl.model, "example_inputs": wl.example_inputs}
    assert autoplan.Workload(**kw, dataset=IndexedStream(8)).dataset is not None
    with pytest.raises(PlanError, match="a map-style dataset by index; IndexedStream is an IterableDataset"):
        autoplan.Workload(**kw, dataset=IndexedStream(8), shuffle=True)
    with pytest.raises(PlanError, match=r"Workload\(shuffle=True\) reorders Workload.dataset, which is not set"):
        autoplan.Workload(**kw, shuffle=True)
    with pytest.raises(PlanError, match="give a torch Dataset with __getitem__ and __len__"):
        autoplan.Workload(**kw, dataset=object())  # type: ignore[arg-type]
    with pytest.raises(PlanError, match="both batches= and dataset="):
        autoplan.Workload(**kw, dataset=IndexedTokens(8), batches=lambda step: (wl.example_inputs, wl.example_targets))


# --- autoplan run's steps (autoplan/tools/training_data.py) ----------------------------------------


class _LoaderOf:
    """Stands in for the parallel model whose ``data_loader`` the run uses: a ShardedLoader of ``layout``."""

    def __init__(self, layout: BatchLayout) -> None:
        self.layout = layout

    def data_loader(self, dataset: Any, *, shuffle: bool, seed: int) -> ShardedLoader:
        return ShardedLoader(dataset, self.layout, shuffle=shuffle, seed=seed)


class RecordedStream(IndexedStream):
    """``IndexedStream`` recording the passes it is told (``set_epoch``)."""

    def __init__(self, num_samples: int) -> None:
        super().__init__(num_samples)
        self.epochs: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)


def _run_steps(dataset: Any, *, shuffle: bool = False, start: int = 0, compare: bool = True) -> list[Any]:
    """The first 6 steps ``autoplan run`` trains on (rank 0 of dp=2, global batch 4)."""
    from autoplan.tools.training_data import TrainingData

    wl = zoo.cli_mlp()
    wl = autoplan.Workload(model=wl.model, example_inputs=wl.example_inputs, dataset=dataset)
    data = TrainingData(wl, _LoaderOf(_dp2_layout()), shuffle=shuffle, data_seed=5, compare=compare)  # type: ignore[arg-type]
    return list(itertools.islice(data.steps(start), 6))


def test_run_reshuffles_an_indexed_dataset_every_pass_and_feeds_the_reference_the_same_rows() -> None:
    dataset = IndexedTokens(9)  # 2 steps of 4 per pass; the ninth sample is dropped every pass
    steps = _run_steps(dataset, shuffle=True)
    assert [k for k, _, _ in steps] == list(range(6))
    orders = [torch.randperm(9, generator=torch.Generator().manual_seed(5 + p)) for p in range(3)]
    assert len({tuple(o.tolist()) for o in orders}) == 3  # a new order each pass
    for k, local, (inputs, targets) in steps:
        rows = orders[k // 2][(k % 2) * 4 : (k % 2 + 1) * 4]
        x, y = _global_batch(dataset, rows, 0, 4)
        assert torch.equal(inputs[0], x) and torch.equal(targets[0], y)  # --compare's global batch
        assert torch.equal(local.inputs[0], x[:2]) and local.sample_indices[0] == tuple(rows[:2].tolist())
    # resumed at step 3 without --compare: nothing before it is loaded
    assert [(k, local is not None, batch) for k, local, batch in _run_steps(dataset, shuffle=True, start=3, compare=False)][:2] == [(3, True, None), (4, True, None)]  # fmt: skip


def test_run_reads_a_stream_again_each_pass_telling_it_the_pass() -> None:
    stream = RecordedStream(9)
    steps = _run_steps(stream)
    assert stream.epochs == [0, 1, 2]
    for k, local, (inputs, _) in steps:
        x, _ = _global_batch(IndexedTokens(9), torch.arange(9), k % 2, 4)
        assert torch.equal(inputs[0], x) and torch.equal(local.inputs[0], x[:2])
    # resumed at step 3: the stream is read through steps 0-2, which train nothing
    assert [(k, local is None) for k, local, _ in _run_steps(RecordedStream(9), start=3, compare=False)][:4] == [
        (0, True), (1, True), (2, True), (3, False),
    ]  # fmt: skip


def test_a_stream_empty_on_its_second_pass_names_the_fix() -> None:
    class OneShot(IndexedStream):
        def __init__(self) -> None:
            super().__init__(4)
            self.it = super().__iter__()

        def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
            return self.it  # the same exhausted iterator the second time

    with pytest.raises(PlanError, match="yielded 0 samples in pass 2.*make its __iter__ start the stream again"):
        _run_steps(OneShot(), compare=False)


def test_run_data_options_name_the_fix() -> None:
    from autoplan.tools.training_data import data_options

    wl = zoo.cli_mlp()
    indexed = autoplan.Workload(model=wl.model, example_inputs=wl.example_inputs, dataset=IndexedTokens(8))
    stream = autoplan.Workload(model=wl.model, example_inputs=wl.example_inputs, dataset=IndexedStream(8))
    assert data_options(indexed, shuffle=True, data_seed=None, seed=4) == (True, 4)
    assert data_options(indexed, shuffle=None, data_seed=None, seed=4) == (False, 4)
    with pytest.raises(PlanError, match="the workload has none .*: give the Workload a dataset= or drop --shuffle"):
        data_options(wl, shuffle=True, data_seed=None, seed=0)
    with pytest.raises(PlanError, match="IndexedStream, an IterableDataset: shuffle its stream itself"):
        data_options(stream, shuffle=True, data_seed=None, seed=0)
    with pytest.raises(PlanError, match="the data is not shuffled: add --shuffle"):
        data_options(indexed, shuffle=None, data_seed=3, seed=0)
