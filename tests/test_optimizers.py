"""``make_torch_optimizer`` builds torch's multi-tensor (``foreach``) optimizers, also over DTensor
parameters (where torch's own default is the per-parameter loop), and their updates are
bit-for-bit those of the per-parameter loop."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from autoplan.cost_models.memory import OPTIMIZERS
from autoplan.runtime.optimizers import make_torch_optimizer


@pytest.fixture
def mesh():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()


def _params(mesh) -> list[torch.nn.Parameter]:
    """Two DTensor parameters, one sharded and one replicated (the placements of a plan)."""
    gen = torch.Generator().manual_seed(0)
    weight = distribute_tensor(torch.randn(8, 6, generator=gen), mesh, [Shard(0)])
    bias = distribute_tensor(torch.randn(6, generator=gen), mesh, [Replicate()])
    return [torch.nn.Parameter(weight), torch.nn.Parameter(bias)]


def _train(name: str, params: list[torch.nn.Parameter], steps: int = 3, **kwargs) -> list[torch.Tensor]:
    opt = make_torch_optimizer(name, params, lr=0.1, **kwargs)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.distributed.tensor.DTensor.from_local(
                torch.randn(p.to_local().shape, generator=gen), p.device_mesh, p.placements, run_check=False
            )
        opt.step()
    return [p.detach().to_local().clone() for p in params]


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_optimizers_are_built_with_foreach_unless_the_caller_says_otherwise(name: str) -> None:
    params = [torch.nn.Parameter(torch.ones(2))]
    assert make_torch_optimizer(name, params, lr=0.1).defaults["foreach"] is True
    assert make_torch_optimizer(name, params, lr=0.1, foreach=False).defaults["foreach"] is False


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_foreach_update_of_dtensor_parameters_is_bitwise_the_single_tensor_update(mesh, name: str) -> None:
    foreach = _train(name, _params(mesh))
    single = _train(name, _params(mesh), foreach=False)
    for a, b in zip(foreach, single, strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(foreach[0], _params(mesh)[0].to_local())  # the parameters did move
