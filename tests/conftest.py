"""Shared test setup: the `slow` marker policy and paths to the repository and its fixtures.

Tests marked `slow` are skipped unless CI is set to a true value ("true" or "1") or a marker
expression was passed explicitly (`pytest -m slow`, `pytest -m "slow or not slow"`).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


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
