"""Lightning's ``ModelParallelStrategy`` with autoplan's ``parallelize_fn``
(``autoplan.integrations.lightning``, issue #43 item 3): the README's Fabric and Trainer examples
train on 2 gloo ranks equal to one device, and the mesh-to-cluster rules and errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh

from autoplan.cost_models.errors import ConfigError
from autoplan.integrations.lightning import mesh_cluster, parallel_model
from tests.harness import free_port

ROOT = Path(__file__).resolve().parent.parent


def _mesh(shape: tuple[int, ...], names: tuple[str, ...], device: str = "cpu") -> DeviceMesh:
    """A mesh of that shape with no process group behind it (only its shape is read)."""
    ranks = torch.arange(int(torch.tensor(shape).prod())).reshape(shape)
    return DeviceMesh(device, ranks, mesh_dim_names=names, _init_backend=False, _rank=0)


def test_the_cluster_has_the_meshs_axes_of_more_than_one_rank() -> None:
    lightning_default = mesh_cluster(_mesh((1, 2), ("data_parallel", "tensor_parallel")))
    assert lightning_default.world_size == 2 and lightning_default.device.name == "CPU"
    assert lightning_default.mesh_shape == (2,) and lightning_default.mesh_axis_names == ("tensor_parallel",)
    both = mesh_cluster(_mesh((2, 2), ("data_parallel", "tensor_parallel")), "1x4xH100")
    assert both.device.name == "H100" and both.mesh_shape == (2, 2)
    assert both.mesh_axis_names == ("data_parallel", "tensor_parallel")


def test_a_gpu_mesh_needs_the_cluster_and_the_sizes_must_agree() -> None:
    with pytest.raises(ConfigError, match=r"pass cluster= naming the devices"):
        mesh_cluster(_mesh((1, 8), ("data_parallel", "tensor_parallel"), device="cuda"))
    with pytest.raises(ConfigError, match=r"has 8 devices but the strategy's mesh has 4 ranks"):
        mesh_cluster(_mesh((2, 2), ("data_parallel", "tensor_parallel")), "1x8xH100")


def test_parallel_model_unwraps_fabrics_module_only() -> None:
    inner, original = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)

    class Wrapper(torch.nn.Module):  # the two attributes of lightning.fabric.wrappers._FabricModule
        def __init__(self) -> None:
            super().__init__()
            self._forward_module, self._original_module = inner, original

    assert parallel_model(Wrapper()) is inner
    assert parallel_model(inner) is inner


@pytest.mark.parametrize("example", ["lightning_fabric.py", "lightning_trainer.py"])
def test_lightning_trains_the_planned_model_like_one_device(example: str, tmp_path: Path) -> None:
    """``torchrun --nproc-per-node 2 examples/<example> --optimizer sgd``: the strategy's mesh
    (1 x 2), autoplan's plan on its tensor-parallel axis (Fabric: ``setup_module`` calls
    ``parallelize_fn``; Trainer: the module's ``configure_model`` does), Lightning's loop; 3 SGD
    steps of a 2-layer Llama: every loss and every parameter equal to the single-device run."""
    pytest.importorskip("lightning", reason="the dev extra installs lightning; this environment has none")
    stdout = example_trains_like_one_device(example, tmp_path, "--optimizer", "sgd")
    assert "single-device" in stdout


def example_trains_like_one_device(example: str, tmp_path: Path, *args: str) -> str:
    """Run ``torchrun --nproc-per-node 2 examples/<example> ARGS --steps 3 --out F`` and check what
    the example wrote: 3 losses equal to the single-device run's, every parameter within 1e-6.
    Returns its stdout."""
    out = tmp_path / "result.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_CPP_LOG_LEVEL="ERROR", LOGLEVEL="ERROR",
               TRANSFORMERS_VERBOSITY="error")  # fmt: skip
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--nnodes", "1",
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        str(ROOT / "examples" / example), *args, "--steps", "3", "--out", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert len(result["losses"]) == 3
    assert result["losses"] == pytest.approx(result["ref_losses"], rel=1e-5, abs=1e-6)
    assert result["max_param_diff"] <= 1e-6
    return proc.stdout
