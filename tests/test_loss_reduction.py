"""How the loss combines its samples (a mean or a sum) decides how data-parallel ranks and
micro-batches combine their shares. The kind the tool reads from the trace is held against
the loss itself: computed on the whole batch and on its two halves, a mean equals the halves'
average and a sum their total. Slow: a sum loss trains like the single-device run under
data parallelism, ZeRO and micro-batches.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from nnscaler_cst.analysis import analyze
from nnscaler_cst.plan.batch import loss_reduction

MODEL = '''
import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return x + F.gelu(self.fc(x))


class Net(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(2))
        self.head = nn.Linear(d, 8)

    def forward(self, x, y):
        for block in self.blocks:
            x = block(x)
        out = self.head(x)
        return {loss}


def build():
    torch.manual_seed(0)
    return Net()


def example_inputs():
    return (torch.randn(8, 16), torch.randn(8, 8))
'''

LOSSES = [
    "F.mse_loss(out, y)",
    "F.mse_loss(out, y, reduction='sum')",
    "(out - y).pow(2).sum()",
    "0.5 * (out - y).pow(2).sum()",
    "(out - y).pow(2).sum() / x.shape[0]",
    "(out - y).pow(2).mean() + 0.1 * out.abs().mean()",
    "F.cross_entropy(out, y.argmax(-1), reduction='sum')",
    "F.cross_entropy(out, y.argmax(-1), reduction='sum') / (y[:, 0] > -9).sum()",
    "nn.functional.l1_loss(out, y, reduction='sum') + (out - y).pow(2).sum()",
]


def write_model(folder, loss):
    path = folder / "net.py"
    path.write_text(MODEL.format(loss=loss))
    return path


def kind_by_halves(path) -> str:
    """The loss on the whole batch against its value on each half, in plain PyTorch."""
    spec = importlib.util.spec_from_file_location("net_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.build()
    torch.manual_seed(0)
    x, y = module.example_inputs()
    whole = model(x, y)
    halves = [model(x[s], y[s]) for s in (slice(0, 4), slice(4, 8))]
    if torch.allclose(whole, sum(halves), rtol=1e-5):
        return "sum"
    assert torch.allclose(whole, sum(halves) / 2, rtol=1e-5), "neither a sum nor a mean of its samples"
    return "mean"


@pytest.mark.parametrize("loss", LOSSES)
def test_the_kind_read_from_the_trace_is_the_losss_own(loss, tmp_path):
    path = write_model(tmp_path, loss)
    assert loss_reduction(analyze(path).graph) == kind_by_halves(path)


def test_the_step_adds_up_the_shares_of_a_sum_and_averages_those_of_a_mean(tmp_path):
    from nnscaler_cst.rewrite import PlanRequest, rewrite
    for loss, average in (("F.mse_loss(out, y)", True), ("(out - y).pow(2).sum()", False)):
        train = rewrite(analyze(write_model(tmp_path, loss)), PlanRequest(dp=2)).files["__init__.py"]
        assert f"\nAVERAGE_SHARES = {average}\n" in train
        assert "_comm.overlap_grads(model, _comm.DP, average=AVERAGE_SHARES," in train


def verify(folder, *args) -> dict:
    env = {**os.environ, "COLUMNS": "200", "PYTHONWARNINGS": "ignore"}
    result = subprocess.run([sys.executable, "-m", "nnscaler_cst.cli", "verify", "net.py", *args, "-o", "out",
                             "--json"], cwd=folder, env=env, capture_output=True, text=True, timeout=600)
    start = result.stdout.find("{")
    assert start >= 0, f"no JSON report; exit {result.returncode}\n{result.stdout}\n{result.stderr[-3000:]}"
    return json.loads(result.stdout[start:])


@pytest.mark.slow
@pytest.mark.parametrize("args", ["--dp 2", "--dp 2 --zero 2", "--pp 2 --micro-batches 2"])
def test_a_sum_loss_trains_like_the_single_device_run(args, tmp_path):
    write_model(tmp_path, "(out - y).pow(2).sum()")
    outcome = verify(tmp_path, *args.split())
    assert outcome["passed"] is True, outcome
