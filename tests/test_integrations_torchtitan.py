"""torchtitan's ``parallelize_fn(model, parallel_dims, job_config)`` form
(``autoplan.integrations.torchtitan``, issue #43 item 3): a torchtitan-shaped Llama planned on the
world mesh of ``ParallelDims`` trains on 2 gloo ranks equal to one device; the mesh rules."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh

from autoplan.cost_models.errors import ConfigError
from autoplan.integrations.torchtitan import world_mesh
from tests.harness import free_port

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
    out = tmp_path / "result.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_CPP_LOG_LEVEL="ERROR", LOGLEVEL="ERROR")
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--nnodes", "1",
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        str(ROOT / "examples" / "torchtitan_llama.py"), "--tp", "2", "--steps", "3", "--out", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert len(result["losses"]) == 3
    assert result["losses"] == pytest.approx(result["ref_losses"], rel=1e-5, abs=1e-6)
    assert result["max_param_diff"] <= 1e-6
    assert "mesh {'tp': 2}" in proc.stdout
