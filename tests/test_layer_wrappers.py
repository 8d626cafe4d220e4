"""Layers that torch builds in two steps: a parametrized weight and a lazy layer.

- `parametrizations.weight_norm(nn.Conv1d(...))` replaces the conv's weight by parameters of
  its own (`parametrizations.weight.original0/1`), made from the conv the inner call built: the
  conv's constructor is not divided under tensor parallelism (it would be cut twice: once by
  the divided sizes, once after build()), both are built whole and cut after build() together.
  A spectrally normed conv beside it (its power iteration's buffers) stays as the plan has it.
  Its forward writes those buffers: once per micro-batch under a pipeline (warned, as one device
  accumulating gradients does), and once a forward under recompute (put back around backward's
  second forward).
- `nn.LazyLinear` is sized by its first call. A build() that returns it uninitialised is refused
  at build() (exit 2, nothing written). One whose build() calls the model runs that call in each
  rank's build(), before the layers built whole are cut: they are kept whole, with a warning.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

NORMED = '''
import torch
import torch.nn as nn
from torch.nn.utils import parametrizations


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1 = parametrizations.weight_norm(nn.Conv1d(c, 2 * c, 3, padding=1))
        self.conv2 = parametrizations.spectral_norm(nn.Conv1d(2 * c, c, 3, padding=1))

    def forward(self, x):
        return x + self.conv2(torch.tanh(self.conv1(x)))


class Model(nn.Module):
    def __init__(self, c=8):
        super().__init__()
        self.inp = nn.Conv1d(4, c, 1)
        self.blocks = nn.ModuleList(Block(c) for _ in range(2))
        self.out = nn.Conv1d(c, 1, 1)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x).pow(2).mean()


def build():
    torch.manual_seed(0)
    return Model()


def example_inputs():
    return (torch.randn(4, 4, 16, generator=torch.Generator().manual_seed(1)),)
'''

LAZY = '''
import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc1 = nn.LazyLinear(4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


class Model(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.inp = nn.LazyLinear(d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(2))
        self.out = nn.Linear(d, 1)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x).pow(2).mean()


def build():
    torch.manual_seed(0)
    model = Model()
    model(torch.zeros(2, 8))        # the lazy layers take their sizes
    return model


def example_inputs():
    return (torch.randn(8, 8, generator=torch.Generator().manual_seed(1)),)
'''


def cli(*args, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nnscaler_cst.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.slow
def test_a_weight_normed_conv_splits_and_trains_like_one_device(tmp_path):
    (tmp_path / "model.py").write_text(NORMED)
    result = cli("verify", "model.py", "--tp", "2", "-o", "out", cwd=tmp_path)
    assert result.returncode == 0 and "PASSED" in result.stdout, result.stdout + result.stderr
    code = (tmp_path / "out" / "model.py").read_text()
    assert "weight_norm(nn.Conv1d(c, 2 * c, 3, padding=1))" in code       # built whole, cut after build()


def test_a_lazy_layer_left_uninitialised_is_refused_at_build(tmp_path):
    (tmp_path / "model.py").write_text(LAZY.replace("    model(torch.zeros(2, 8))        # the lazy layers take their sizes\n", ""))
    result = cli("model.py", "--dp", "2", "-o", "out", cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "model.py:30:1: error: build() returned a model whose lazy layers are not initialised" in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_lazy_layers_a_build_calls_stay_whole_under_tensor_parallelism(tmp_path):
    (tmp_path / "model.py").write_text(LAZY)
    result = cli("model.py", "--tp", "2", "-o", "out", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "stays whole on every tensor-parallel rank" in result.stderr
    assert "build() runs the model, before the layers it builds whole" in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("plan", [("--pp", "2", "--micro-batches", "2"), ("--tp", "2", "--recompute")],
                         ids=["pp2-m2", "tp2-recompute"])
def test_a_spectral_norms_power_iteration_runs_once_a_forward_under_micro_batches_and_recompute(tmp_path, plan):
    """Its forward writes its `_u` and `_v` buffers. Under micro-batches they are written once per
    micro-batch (warned; verify's reference accumulates alike); under recompute, backward's second
    forward starts from the buffers the first one started from and leaves them as it left them."""
    (tmp_path / "model.py").write_text(NORMED)
    result = cli("verify", "model.py", *plan, "-o", "out", cwd=tmp_path)
    assert result.returncode == 0 and "PASSED" in result.stdout, result.stdout + result.stderr
    if "--recompute" in plan:
        assert "context_fn=buffers_kept_through_recompute(block, ('conv2.parametrizations.weight.0._u', " \
               "'conv2.parametrizations.weight.0._v'))" in (tmp_path / "out" / "model.py").read_text()
    else:
        assert "model.py:14:20: warning: this call writes the buffers blocks.0.conv2.parametrizations.weight.0._u, " \
               "blocks.0.conv2.parametrizations.weight.0._v in the forward, once for each of the 2 micro-batches" \
               in result.stderr, result.stderr
