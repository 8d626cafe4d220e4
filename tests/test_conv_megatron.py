"""Convolutional blocks split as Megatron splits an MLP (issue 26, item 5): a conv by its output
channels, the per-channel BatchNorm and activation on those channels, the next conv by its input
channels, one all-reduce. BatchNorm's running statistics are buffers its constructor builds from
num_features with its weight: they are built split where the weight is, sliced and joined by the
output's state-dict helpers, and a BatchNorm without a weight keeps its channels whole. And the
probe of a recurrent layer: nn.LSTM's and nn.GRU's results at half the batch differ from the whole batch's by
float32 rounding alone, which the probe asks again in float64."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

CONV_BLOCKS = '''
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, c, hidden):
        super().__init__()
        self.conv1 = nn.Conv2d(c, hidden, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(hidden)
        self.conv2 = nn.Conv2d(hidden, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x):
        return x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x)))))


class Net(nn.Module):
    def __init__(self, c=8, hidden=16):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.blocks = nn.ModuleList([Block(c, hidden) for _ in range(2)])
        self.norm = nn.BatchNorm2d(c, affine=False)     # no weight: its statistics stay whole
        self.head = nn.Linear(c, 4)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean((2, 3)))


def build():
    torch.manual_seed(0)
    return Net()


def example_inputs():
    return (torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(1)),)


def loss(output):
    return output.pow(2).mean()
'''

RECURRENT = '''
import torch
from torch import nn


class RecurrentLM(nn.Module):
    def __init__(self, vocab=128, dim=64):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.rnn = nn.CELL(dim, dim, num_layers=2, batch_first=True)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        out, _ = self.rnn(self.embed(tokens))
        return self.head(out)


def build():
    return RecurrentLM()


def example_inputs():
    return (torch.randint(0, 128, (4, 16)),)


def loss(output):
    return output.float().pow(2).mean()
'''


def cli(*args, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200", "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "nnscaler_cst.cli", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


def written(tmp_path: Path, text: str) -> Path:
    (tmp_path / "model.py").write_text(textwrap.dedent(text).lstrip("\n"))
    return tmp_path


@pytest.mark.slow     # over 5 s: keeps the quick subset under 3 minutes
def test_a_conv_block_splits_output_channels_then_input_channels_with_its_batchnorms(tmp_path):
    root = written(tmp_path, CONV_BLOCKS)
    result = cli("model.py", "--tp", "2", "-o", "out", cwd=root)
    assert result.returncode == 0, result.stderr
    params = json.loads((root / "out" / "plan.json").read_text())["params"]
    for b in (0, 1):
        assert params[f"blocks.{b}.conv1.weight"]["tp"] == "S(0)"
        assert params[f"blocks.{b}.bn1.weight"]["tp"] == params[f"blocks.{b}.bn1.bias"]["tp"] == "S(0)"
        assert params[f"blocks.{b}.conv2.weight"]["tp"] == "S(1)"
    code = (root / "out" / "model.py").read_text()
    assert "self.bn1 = nn.BatchNorm2d(hidden // 2)" in code
    init = (root / "out" / "__init__.py").read_text()
    # the running statistics are sliced and joined with the weight; the weightless norm's are whole
    assert "'blocks.0.bn1.running_mean': (0, 1)," in init and "'blocks.1.bn1.running_var': (0, 1)," in init
    assert "'norm.running_mean'" not in init


@pytest.mark.parametrize("cell", ["LSTM", "GRU"])
@pytest.mark.slow     # over 5 s: keeps the quick subset under 3 minutes
def test_the_probe_finds_the_batch_dim_of_a_batch_first_recurrent_layer(tmp_path, cell):
    from nnscaler_cst.analysis import analyze
    analysis = analyze(written(tmp_path, RECURRENT.replace("CELL", cell)) / "model.py")
    graph = analysis.graph
    node = next(n for n in graph.nodes if n.callee == f"torch.nn.{cell}")
    dims = graph.dims[node.index]
    batch = dims.inputs["arg0"].dims[0]
    assert batch and dims.outputs[0].dims[0] == batch        # tokens (b, s, d) -> (b, s, d)


@pytest.mark.slow
def test_a_conv_block_split_with_its_batchnorm_statistics_verifies(tmp_path):
    """Running statistics are compared with the parameters: each rank updates its channels' share."""
    root = written(tmp_path, CONV_BLOCKS)
    result = cli("verify", "model.py", "--tp", "2", "--dp", "2", "-o", "out", "--json", cwd=root)
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads(result.stdout)["passed"]
