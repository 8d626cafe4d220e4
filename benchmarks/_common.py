"""Helpers the benchmark scripts share: loading files and the generated package, a free port,
and the revision the figures were measured at."""
from __future__ import annotations

import importlib
import importlib.util
import socket
import subprocess
import sys
from pathlib import Path

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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
