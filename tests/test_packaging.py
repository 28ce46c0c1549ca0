"""The wheel installs one import name, ``autoplan``: ``passes/`` and ``cost_models/`` go in as
``autoplan.passes`` and ``autoplan.cost_models`` (``pyproject.toml``'s package-dir mapping), so no
generic top-level name such as ``passes`` collides with a user's own packages.

The wheel is built once per module with ``python -m pip wheel --no-deps --no-build-isolation``
from a copy of the checkout (without ``.git``, ``build/``, ``*.egg-info`` and caches: a stale
``build/lib`` left by an earlier build would otherwise end up in the wheel, and two test runs at
once would share it). Then: the wheel's top-level names are only ``autoplan`` (and its
``.dist-info``); it holds every ``passes/*.py`` and ``cost_models/*.py`` as real files (not symbolic
links) with the checkout's bytes; and, with the unpacked wheel first on ``sys.path`` and the
working directory outside the checkout, ``import passes`` and ``import cost_models`` fail while
``import autoplan.passes.trace, autoplan.cost_models.cluster`` work (from the unpacked wheel, not
from the editable install of the development environment).
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BUILD_TIMEOUT_S = 300
COPY_IGNORED = shutil.ignore_patterns(
    ".git", "build", "dist", "__pycache__", "*.egg-info", ".mypy_cache", ".ruff_cache", ".pytest_cache", ".hypothesis"
)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel built from a clean copy of the checkout (symbolic links kept as links)."""
    tmp = tmp_path_factory.mktemp("wheel")
    source, out = tmp / "src", tmp / "out"
    shutil.copytree(ROOT, source, symlinks=True, ignore=COPY_IGNORED)
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), "."]
    proc = subprocess.run(cmd, cwd=source, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}"
    wheels = list(out.glob("autoplan-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


@pytest.fixture(scope="module")
def unpacked(wheel: Path) -> Path:
    target = wheel.parent.parent / "unpacked"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(target)
    return target


def test_the_wheel_installs_only_the_autoplan_import_name(wheel):
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        dist_info = next(n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info"))
        top_level = zf.read(f"{dist_info}/top_level.txt").decode().split()
    tops = {name.split("/")[0] for name in names} - {dist_info}

    assert tops == {"autoplan"}, f"top-level entries besides autoplan: {sorted(tops - {'autoplan'})}"
    assert top_level == ["autoplan"]


@pytest.mark.parametrize("folder", ["passes", "cost_models"])
def test_the_wheel_holds_the_folder_as_real_files_under_autoplan(wheel, folder):
    expected = sorted(p.name for p in (ROOT / folder).glob("*.py"))
    assert "__init__.py" in expected and len(expected) > 5
    with zipfile.ZipFile(wheel) as zf:
        infos = {info.filename: info for info in zf.infolist()}
        prefix = f"autoplan/{folder}/"
        held = sorted(name[len(prefix) :] for name in infos if name.startswith(prefix) and name.endswith(".py"))
        assert held == expected
        for name in expected:
            info = infos[prefix + name]
            mode = info.external_attr >> 16
            assert not stat.S_ISLNK(mode), f"{info.filename} is a symbolic link in the wheel"
            assert zf.read(info) == (ROOT / folder / name).read_bytes(), f"{info.filename} differs from {folder}/{name}"


_PROBE = """
import importlib, sys
for name in ("passes", "cost_models"):
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError:
        print(f"{name}: not found")
    else:
        print(f"{name}: imported from {module.__file__}")
import autoplan.passes.trace, autoplan.cost_models.cluster
for module in (autoplan, autoplan.passes.trace, autoplan.cost_models.cluster):
    print(module.__name__, module.__file__)
"""


def test_only_the_autoplan_names_import_from_the_installed_wheel(unpacked, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(unpacked)}
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()

    assert lines[:2] == ["passes: not found", "cost_models: not found"]
    files = dict(line.split(" ", 1) for line in lines[2:])
    assert set(files) == {"autoplan", "autoplan.passes.trace", "autoplan.cost_models.cluster"}
    for name, file in files.items():
        assert Path(file).is_relative_to(unpacked), f"{name} came from {file}, not from the unpacked wheel"
    assert files["autoplan.passes.trace"] == str(unpacked / "autoplan" / "passes" / "trace.py")
    assert not (unpacked / "autoplan" / "passes").is_symlink()


_OWN_CODE_PROBE = """
import autoplan.api, autoplan.planner.joint, autoplan.passes.trace as trace, autoplan.cost_models.cluster
for module in (autoplan.api, autoplan.planner.joint, trace, autoplan.cost_models.cluster):
    print(module.__name__, str(__import__("pathlib").Path(module.__file__).resolve()).startswith(trace._OUR_DIRS))
"""


def test_an_installed_wheel_tells_its_own_frames_from_the_users(unpacked, tmp_path):
    """A failing trace names the user's innermost frame, skipping autoplan's own
    (``passes.trace._OUR_DIRS``): installed, autoplan's folders are autoplan/, autoplan/passes and
    autoplan/cost_models, not three folders side by side as in the checkout."""
    env = {**os.environ, "PYTHONPATH": str(unpacked)}
    proc = subprocess.run(
        [sys.executable, "-c", _OWN_CODE_PROBE], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [
        "autoplan.api", "True", "autoplan.planner.joint", "True",
        "autoplan.passes.trace", "True", "autoplan.cost_models.cluster", "True",
    ]  # fmt: skip
