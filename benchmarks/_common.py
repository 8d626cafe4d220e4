"""Helpers the benchmark scripts share: loading files and the generated package, starting
rank processes, and the revision the figures were measured at."""
from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from nnscaler_cst.verify.launch import LaunchError, run_world

ROOT = Path(__file__).resolve().parents[1]


def load_file(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def load_package(out_dir: Path):
    """The generated package, imported the way nnscaler_cst/verify/worker.py does."""
    out_dir = Path(out_dir).resolve()
    sys.path.insert(0, str(out_dir.parent))
    package = importlib.import_module(out_dir.name)
    train = importlib.import_module(f"{package.__name__}.train")
    comm = importlib.import_module(f"{package.__name__}._comm")
    return package, train, comm


def join_ranks(out_dir: Path):
    """In a rank process: one intra-op thread, the generated package loaded, its mesh set up
    over gloo. Returns (rank, world, package, train, comm)."""
    import torch
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    package, train, comm = load_package(out_dir)
    comm.setup(rank, world, tp=package.TP_SIZE, dp=package.DP_SIZE, pp=package.PP_SIZE, backend="gloo")
    return rank, world, package, train, comm


def revision() -> str:
    """HEAD, with '+dirty' when nnscaler_cst/, fixtures/ or rules/ differ from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "nnscaler_cst", "fixtures", "rules"],
                               cwd=ROOT, capture_output=True, text=True).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def launch_ranks(command: list[str], world: int, timeout: float, label: str = "") -> None:
    """Run `command` on `world` processes (RANK/WORLD_SIZE/MASTER_* set, one intra-op thread
    each); exit with the failing rank's output on error or timeout."""
    try:
        run_world(command, world, timeout)
    except LaunchError as err:
        raise SystemExit(f"bench: {label}{err}") from None
