"""torchtitan's ``parallelize_fn(model, parallel_dims, job_config)`` form
(``autoplan.integrations.torchtitan``, issue #43 item 3): a torchtitan-shaped Llama planned on the
world mesh of ``ParallelDims`` trains on 2 gloo ranks equal to one device; the mesh rules."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh

from autoplan.cost_models.errors import ConfigError
from autoplan.integrations.torchtitan import world_mesh
from tests.test_integrations_lightning import example_trains_like_one_device

ROOT = Path(__file__).resolve().parent.parent


def _mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    ranks = torch.arange(int(torch.tensor(shape).prod())).reshape(shape)
    return DeviceMesh("cpu", ranks, mesh_dim_names=names, _init_backend=False, _rank=0)


@dataclass
class _Dims:
    pp: int = 1


def test_the_mesh_comes_from_world_mesh_build_mesh_or_is_given() -> None:
    mesh = _mesh((2, 2), ("dp_shard", "tp"))

    class Current(_Dims):
        world_mesh = mesh

    class Before2025(_Dims):  # build_mesh(device_type)
        def build_mesh(self, device_type: str) -> DeviceMesh:
            assert device_type == "cpu"
            return mesh

    assert world_mesh(Current()) is mesh and world_mesh(Before2025()) is mesh and world_mesh(mesh) is mesh


def test_pipeline_dims_and_other_objects_are_refused_naming_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"pp=2: autoplan plans pipeline stages itself.*global_batch_size="):
        world_mesh(_Dims(pp=2))
    with pytest.raises(ConfigError, match=r"_Dims is not torchtitan's ParallelDims .* pass the trainer's parallel_dims"):
        world_mesh(_Dims())


def test_a_torchtitan_shaped_llama_trains_like_one_device_on_the_tensor_parallel_mesh(tmp_path: Path) -> None:
    """``torchrun --nproc-per-node 2 examples/torchtitan_llama.py --tp 2``: ParallelDims(tp=2)'s
    world mesh, the plan on it, the user's loop; 3 SGD steps: every loss and parameter as on one device."""
    stdout = example_trains_like_one_device("torchtitan_llama.py", tmp_path, "--tp", "2")
    assert "mesh {'tp': 2}" in stdout
