"""Optimizer-state offload to host memory (``ParallelConfig.offload_optimizer``): the knob, its
price, the search's use of it and the program that runs it.

Priced (autoplan.cost_models.memory.offload_host_bytes_per_element, autoplan.cost_models.step.offload_time_s),
for ``n`` trained elements of the rank's shard, ``g``/``w`` bytes per element of gradients/weights::

    device optimizer part   O = 0            (without: n * optimizer bytes, 8 for fp32 Adam)
    optimizer_s             n g / L + n s / H + n w / L,   s = 28 for Adam (+ (g + 4) + (4 + w) if w < 4)
    H100                    L = 64 GB/s * 0.8 = 51.2 GB/s,   H = 2 * 307.2 / 8 * 0.8 = 61.44 GB/s

Executed: 2 gloo ranks, GPT-2 tiny, a ZeRO-3 data-parallel plan with the state offloaded trains
three SGD-with-momentum steps like the single-device model (Adam there would divide the
key bias's gradient, zero up to rounding, by its own size: noise on either side); the host state
is no view of a parameter and a checkpoint of it loads back. Adam offloaded equals Adam on the
device bit for bit on one process.
"""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch

import autoplan
from autoplan.cost_models.cluster import Cluster
from autoplan.cost_models.config import ParallelConfig
from autoplan.cost_models.errors import ConfigError
from autoplan.cost_models.hardware import DEVICE_CATALOG
from autoplan.cost_models.memory import DRIVER_VISIBLE_FRACTION, GB, GiB, non_pytorch_bytes
from autoplan.cost_models.step import SegmentCost, SegmentCosts, evaluate
from autoplan.planner.search import SearchSpace, search
from autoplan.runtime.optimizers import OffloadedOptimizer, make_torch_optimizer
from tests import zoo
from tests.harness import assert_trains_like_reference, run_ranks, train_both

H100 = DEVICE_CATALOG["H100"]
L_BPS = 64e9 * 0.8  # PCIe Gen5 x16 per direction, achievable
H_BPS = 2 * 307.2e9 / 8 * 0.8  # DGX H100 DRAM per GPU, achievable
ADAM_STEP_BYTES = 4 * 2 + 4 + 8 * 2  # param r/w, grad r, two states r/w (fp32)


def _seg(params: int) -> SegmentCost:
    return SegmentCost(
        fwd_s=1e-3, bwd_s=2e-3, bwd_weight_s=1e-3, fwd_comm_s=0.0, bwd_comm_s=0.0, selective_recompute_s=1e-4,
        full_recompute_s=1e-3, grad_sync_s=0.0, optimizer_s=1e-4, param_numel=params, trainable_numel=params,
        param_itemsize=4, saved_bytes=1e6, selective_kept_bytes=5e5, full_kept_bytes=1e5, input_bytes=1e5, flops=1e9,
    )  # fmt: skip


def _costs(params: int = 1_000_000, num_blocks: int = 2) -> SegmentCosts:
    segs = tuple(_seg(params) for _ in range(num_blocks + 2))
    return SegmentCosts(segments=segs, cut_bytes=tuple(1e5 for _ in segs[:-1]), optimizer="adam")


def _cluster(device=H100, devices: int = 1) -> Cluster:  # noqa: ANN001
    return Cluster(num_nodes=1, devices_per_node=devices, device=device)


# --- the knob and the catalog ---------------------------------------------------------------------


def test_offload_is_written_only_when_set():
    off, on = ParallelConfig(dp=2), ParallelConfig(dp=2, offload_optimizer=True)
    assert "offload_optimizer" not in off.to_dict() and "offload" not in str(off)
    assert on.to_dict()["offload_optimizer"] is True and str(on).endswith("zero=0 offload=optimizer")
    assert ParallelConfig.from_dict(on.to_dict()) == on and ParallelConfig.from_dict(off.to_dict()) == off
    with pytest.raises(ConfigError, match="offload_optimizer must be True or False"):
        ParallelConfig(offload_optimizer=1)  # type: ignore[arg-type]


def test_catalog_host_links_are_pcie_x16_and_cpu_has_none():
    assert DEVICE_CATALOG["A100-80GB"].host_link_GBps == pytest.approx(32 * 0.8)
    for name in ("H100", "H200", "B200"):
        assert DEVICE_CATALOG[name].host_link_GBps == pytest.approx(64 * 0.8)
    assert H100.host_mem_bw_GBps == pytest.approx(H_BPS / 1e9)
    cpu = DEVICE_CATALOG["CPU"]
    assert cpu.host_link_GBps is None and cpu.host_mem_bw_GBps is None
    assert "host_link_GBps" not in cpu.to_dict() and H100.to_dict()["host_link_GBps"] == pytest.approx(51.2)


# --- the price ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("precision", "g", "extra"), [("fp32", 4, 0), ("bf16", 2, (2 + 4) + (4 + 2))])
def test_offload_moves_the_optimizer_state_off_the_device_and_prices_the_copies(precision, g, extra):  # noqa: ANN001
    costs, n = _costs(), 4 * 1_000_000  # 4 segments of 1M trained elements, one stage
    off = evaluate(ParallelConfig(), costs, _cluster(), precision=precision)
    on = evaluate(ParallelConfig(offload_optimizer=True), costs, _cluster(), precision=precision)
    optimizer_bytes = 8 if precision == "fp32" else 12  # Adam states (+ the fp32 master)
    assert off.stages[0].memory_parts["optimizer"] == n * optimizer_bytes
    assert on.stages[0].memory_parts["optimizer"] == 0
    assert on.peak_memory_bytes < off.peak_memory_bytes - n * optimizer_bytes  # the step's temporaries too
    host_s = n * g / L_BPS + n * (ADAM_STEP_BYTES + extra) / H_BPS + n * g / L_BPS
    assert on.optimizer_s == pytest.approx(host_s, rel=1e-12)
    assert "offload=optimizer" in on.summary() and "on the host" in on.summary() and "offload" not in off.summary()
    # exposed after the backward, in place of the device's step
    assert on.step_time_s - off.step_time_s == pytest.approx(host_s - off.optimizer_s, rel=1e-9)


def test_offload_with_zero3_moves_the_ranks_shard():
    costs, n = _costs(), 4 * 1_000_000
    cluster = _cluster(devices=2)
    on = evaluate(ParallelConfig(dp=2, zero_stage=3, offload_optimizer=True), costs, cluster)
    assert on.optimizer_s == pytest.approx((n / 2) * (8 / L_BPS + ADAM_STEP_BYTES / H_BPS), rel=1e-12)


def test_on_cpu_ranks_the_host_is_the_device_memory():
    """No host link: the host state (states, fp32 master, fp32 gradient: 16 B per Adam element)
    stays in the rank's memory, and the copies run at its memory bandwidth (20 GB/s)."""
    costs, n = _costs(), 4 * 1_000_000
    cpu = DEVICE_CATALOG["CPU"]
    on = evaluate(ParallelConfig(offload_optimizer=True), costs, _cluster(cpu))
    assert on.stages[0].memory_parts["optimizer"] == n * 16
    assert on.optimizer_s == pytest.approx(n * 8 / 10e9 + n * ADAM_STEP_BYTES / 20e9, rel=1e-12)


# --- the search -----------------------------------------------------------------------------------


def _capacity_for(usable_bytes: float) -> int:
    """Marketed capacity whose usable bytes (memory.usable_memory_bytes, CUDA) are ``usable_bytes``
    on one device (no process group: the CUDA context only outside PyTorch)."""
    return int((usable_bytes + non_pytorch_bytes("cuda")) / (GiB / GB * DRIVER_VISIBLE_FRACTION))


SPACE = SearchSpace(microbatch_sizes=(1,), recompute=("none",), hetero_stages=False)


def test_search_offloads_only_when_nothing_fits_without_it():
    costs = _costs(params=200_000_000)  # 800M elements: 3.2 GB weights, 6.4 GB of Adam state
    off = evaluate(ParallelConfig(), costs, _cluster())
    on = evaluate(ParallelConfig(offload_optimizer=True), costs, _cluster())
    small = dataclasses.replace(H100, mem_capacity_bytes=_capacity_for((off.peak_memory_bytes + on.peak_memory_bytes) / 2))
    best, every = search(lambda tp, b: costs, _cluster(small), num_blocks=2, global_batch_size=1, space=SPACE)
    assert best.config == ParallelConfig(offload_optimizer=True) and best.feasible
    assert best.step_time_s == pytest.approx(on.step_time_s)
    # roomy device: the same configuration is chosen without offload, and offload is not priced
    best, every = search(lambda tp, b: costs, _cluster(), num_blocks=2, global_batch_size=1, space=SPACE)
    assert best.config == ParallelConfig() and not any(e.config.offload_optimizer for e in every)


def test_search_never_offloads_where_the_device_is_its_own_host():
    costs = _costs(params=200_000_000)
    cpu = dataclasses.replace(DEVICE_CATALOG["CPU"], mem_capacity_bytes=2**30)
    with pytest.raises(autoplan.InfeasiblePlanError):
        search(lambda tp, b: costs, _cluster(cpu), num_blocks=2, global_batch_size=1, space=SPACE)


# --- the program ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["adam", "sgd_momentum"])
def test_offloaded_optimizer_steps_like_the_device_one_and_keeps_its_torch_surface(name):  # noqa: ANN001
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    ref = copy.deepcopy(model)
    opt = OffloadedOptimizer(name, list(model.parameters()), lr=0.01)
    ref_opt = make_torch_optimizer(name, list(ref.parameters()), lr=0.01)
    for _ in range(3):
        x = torch.randn(5, 4)
        for m, o in ((model, opt), (ref, ref_opt)):
            m(x).pow(2).sum().backward()
            o.step()
            o.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters(), strict=True))
    sd, ref_sd = opt.state_dict(), ref_opt.state_dict()
    assert sd["param_groups"] == ref_sd["param_groups"] and sd["state"].keys() == ref_sd["state"].keys()
    assert all(torch.equal(v, ref_sd["state"][i][k]) for i, st in sd["state"].items() for k, v in st.items())
    again = OffloadedOptimizer(name, list(model.parameters()), lr=0.5)
    again.load_state_dict(sd)
    assert again.param_groups[0]["lr"] == 0.01 and len(again.state) == 4
    scheduler = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)  # a torch scheduler drives it
    opt.step()
    scheduler.step()
    opt.step()
    assert opt.param_groups[0]["lr"] == 0.005 and opt._host.param_groups[0]["lr"] == 0.005  # noqa: SLF001


GLOBAL_BATCH, NUM_LAYERS, LR = 4, 2, 0.1
CONFIG = ParallelConfig(dp=2, microbatch_size=2, num_microbatches=1, zero_stage=3, offload_optimizer=True)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return zoo.token_batch(batch=GLOBAL_BATCH, seq=8, seed=step + 1)


def _train_offloaded(rank: int, world_size: int, plan_json: str, ckpt_dir: str) -> dict[str, object]:
    from autoplan.runtime import checkpoint

    plan = autoplan.Plan.from_dict(json.loads(plan_json))
    model = zoo.gpt2_tiny(num_layers=NUM_LAYERS)
    reference = copy.deepcopy(model)
    ids, labels = _batch(0)
    pm = autoplan.parallelize(
        model, plan.cluster, example_inputs=(ids,), loss_fn=zoo.lm_loss, example_targets=(labels,), plan=plan
    )
    opt = pm.make_optimizer(lr=LR)
    assert isinstance(opt, OffloadedOptimizer)
    out = train_both(
        pm, reference, batches=lambda s: tuple((t,) for t in _batch(s)), loss_fn=zoo.lm_loss, opt=opt,
        ref_opt=torch.optim.SGD(reference.parameters(), lr=LR, momentum=0.9), check=False,
    )  # fmt: skip
    # the host copies are their own storage: no state or master tensor is a view of a parameter
    device_ptrs = {p.to_local().untyped_storage().data_ptr() for p in pm.parameters()}
    host = [opt.master(p) for p in pm.parameters()] + [
        v for p in pm.parameters() for v in opt.host_state(p).values() if v.dim() > 0
    ]
    out["distinct"] = len(host) == 2 * len(device_ptrs) and not {
        t.untyped_storage().data_ptr() for t in host
    } & device_ptrs
    # a checkpoint of the offloaded state loads back into a fresh model and optimizer
    checkpoint.save(ckpt_dir, 3, pm, opt, plan=plan)
    fresh = autoplan.parallelize(
        zoo.gpt2_tiny(seed=7, num_layers=NUM_LAYERS), plan.cluster, example_inputs=(ids,), loss_fn=zoo.lm_loss,
        example_targets=(labels,), plan=plan,
    )  # fmt: skip
    fresh_opt = fresh.make_optimizer(lr=LR)
    found = checkpoint.find_latest(ckpt_dir)
    assert found is not None and checkpoint.load(found, fresh, fresh_opt) == 3
    out["restored"] = all(
        torch.equal(a.to_local(), b.to_local()) for a, b in zip(pm.parameters(), fresh.parameters(), strict=True)
    ) and all(
        torch.equal(opt.host_state(a)[k], fresh_opt.host_state(b)[k])
        for a, b in zip(pm.parameters(), fresh.parameters(), strict=True)
        for k in opt.host_state(a)
    )
    return out


def test_offloaded_zero3_plan_trains_like_single_device_and_checkpoints(tmp_path):  # noqa: ANN001
    ids, labels = _batch(0)
    plan = autoplan.plan(
        zoo.gpt2_tiny(num_layers=NUM_LAYERS), "1x2xCPU", example_inputs=(ids,), loss_fn=zoo.lm_loss,
        example_targets=(labels,), optimizer="sgd_momentum", global_batch_size=GLOBAL_BATCH, config=CONFIG,
    )  # fmt: skip
    assert plan.config == CONFIG and "offload=optimizer" in plan.summary()
    results = run_ranks(_train_offloaded, 2, json.dumps(plan.to_dict()), str(tmp_path), timeout_s=600)
    assert_trains_like_reference(results, rel_tol=1e-5, atol=1e-6)
    assert all(r["distinct"] and r["restored"] for r in results), [(r["distinct"], r["restored"]) for r in results]
