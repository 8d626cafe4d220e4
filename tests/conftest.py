"""Shared test setup: the `slow` marker policy and paths to the repository and its fixtures.

Tests marked `slow` are skipped unless CI is set to a true value ("true" or "1") or a marker
expression was passed explicitly (`pytest -m slow`, `pytest -m "slow or not slow"`).
"""
from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
# Before any test module loads torch: OpenMP threads sleep at a barrier instead of spinning, as
# the tool's own processes do (nnscaler_cst/verify/launch.py OMP_WAIT), since two test workers
# and their ranks share the cores.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# The tests' fixed cpu-gloo spec (tests/rules/devices/cpu-gloo.toml) shadows the built-in one, which
# benchmarks/calibrate_cpu.py measures per machine; a test that sets the variable itself replaces it.
os.environ["NNSCALER_RULES_PATH"] = os.pathsep.join(
    p for p in (str(REPO_ROOT / "tests" / "rules"), os.environ.get("NNSCALER_RULES_PATH", "")) if p)

# The start of a rank script run on an output folder (argv[1]) under gloo: the output's package
# imported, its process groups set up, this rank's model built in training mode as `model`.
RANK_SET_UP = """\
import importlib, json, os, sys
import torch
folder = sys.argv[1]
sys.path.insert(0, os.path.dirname(folder))
package = importlib.import_module(os.path.basename(folder))
comm = importlib.import_module(package.__name__ + "._comm")
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
comm.setup(rank, world, tp=package.TP_SIZE, dp=package.DP_SIZE, pp=package.PP_SIZE, backend="gloo")
module = package.rank_module(rank)
torch.manual_seed(0)
model = package.build(rank).train()
"""


def _ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1")


def pytest_collection_modifyitems(config, items):
    if _ci() or config.option.markexpr:
        return
    skip_slow = pytest.mark.skip(reason="slow: set CI=true or pass -m slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip_slow)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def fixtures_dir(repo_root) -> Path:
    return repo_root / "fixtures"


def processes_mentioning(text: str) -> list[int]:
    """Pids of live processes whose command line contains `text` (leftover-rank checks)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if text in (proc / "cmdline").read_bytes().decode(errors="replace"):
                    pids.append(int(proc.name))
            except OSError:
                pass
    return pids


def import_output(folder: Path):
    """Import an output folder as the package it is meant to be (its folder name), fresh.

    Tests in one worker process reuse folder names ("gpt_plain"); a package of that name left
    in sys.modules by another test would be returned instead, with another model in it."""
    name = folder.name
    for module in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[module]
    importlib.invalidate_caches()
    sys.path.insert(0, str(folder.parent))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(folder.parent))


def mlp_rewritten_for_tp2(root: Path) -> Path:
    """fixtures/mlp.py copied into `root` and rewritten for TP=2 into root/out; returns root."""
    import shutil
    import subprocess
    shutil.copy(REPO_ROOT / "fixtures" / "mlp.py", root / "mlp.py")
    result = subprocess.run([sys.executable, "-m", "nnscaler_cst.cli", "mlp.py", "--tp", "2", "-o", "out"],
                            cwd=root, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return root
