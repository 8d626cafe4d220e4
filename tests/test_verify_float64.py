"""verify's second opinion in float64 (verify/equivalence.py, run_verify): where float32 differs
past its tolerances, both runs go again in float64 under tolerances 1000x tighter. An
ill-conditioned model (RegNet's grouped convolutions through BatchNorm over two values per
channel) amplifies float32 rounding past any fixed tolerance; float64 tells that apart from a
rewrite that computes something else (tests/test_equivalence.py's broken copies, which fail both).

Here both dtypes run fixtures/mlp.py at TP=2 under tolerances of 1e-10 (1e-13 in float64):
float32's rounding fails them, float64's passes.
"""
from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import mlp_rewritten_for_tp2
from nnscaler_cst.verify import equivalence, forkserver

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
UNREACHABLE = {"param_atol": 1e-10, "loss_atol": 1e-10, "rtol": 1e-10, "grad_rtol": 1e-10}
TIGHT = {name: value * equivalence.FLOAT64_TIGHTENING for name, value in UNREACHABLE.items()}


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """mlp.py rewritten for TP=2 into out/, once."""
    return mlp_rewritten_for_tp2(tmp_path_factory.mktemp("float64"))


def _run(project: Path, workdir: str, forks) -> equivalence._Run:
    package = _package(project)
    return equivalence._Run(project / "mlp.py", project / "out", package, workdir, ["--steps", "2", "--lr", "1e-3",
                                                                                    "--seed", "0"], 120, forks)


def _package(project: Path):
    sys.path.insert(0, str(project))
    try:
        return importlib.import_module("out")
    finally:
        sys.path.remove(str(project))


def test_the_float64_run_matches_to_float64_rounding(project, tmp_path):
    with forkserver.started() as forks:
        run = _run(project, str(tmp_path), forks)
        narrow, _ = run.compare(UNREACHABLE)
        wide, ref = run.compare(TIGHT, float64=True)
    assert not narrow.passed_as_run, "float32 met 1e-10: it no longer tells the dtypes apart"
    assert wide is not None and wide.passed_as_run, wide.to_json()
    assert all(v.dtype == torch.float64 for v in ref["grads"].values())
    assert wide.max_abs_error < 1e-12 < narrow.max_abs_error, (wide.max_abs_error, narrow.max_abs_error)


def test_a_model_that_names_float32_gets_no_float64_run(project, tmp_path):
    entry = project / "mlp.py"
    entry.write_text(entry.read_text().replace("    return MLP()", "    return MLP().float()"))
    try:
        with forkserver.started() as forks:
            assert _run(project, str(tmp_path), forks).compare(TIGHT, float64=True) == (None, {})
    finally:
        shutil.copy(REPO / "fixtures" / "mlp.py", entry)


NAMES_FLOAT32 = '''
import torch


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        grid = torch.arange(8).float()          # as RAFT's coordinate grid: float32 whatever the weights
        return self.fc(grid * x.float()).pow(2).mean()


def build():
    return Model()


def example_inputs():
    return (torch.randn(4, 8),)
'''


def test_a_model_that_names_float32_has_its_rounding_measured_by_another_order(tmp_path):
    """Without a float64 run there was no yardstick for the reference's own rounding, and an
    ill-conditioned float32 model was called wrong: torchvision's RAFT at TP=2 (its feature
    encoder's weight gradients 1.4% off, as far as one thread against two moves them in one process).
    The reference now measures its rounding by the same step in another order."""
    (tmp_path / "entry.py").write_text(NAMES_FLOAT32)
    done = subprocess.run([sys.executable, str(equivalence.WORKER), "reference", str(tmp_path / "entry.py"),
                           str(tmp_path), "--steps", "1"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    ref = torch.load(tmp_path / "reference.pt")
    assert ref["exact_grads"] is None                      # it does not run in float64
    assert set(ref["reordered_grads"]) == set(ref["grads"]) == {"fc.weight", "fc.bias"}
