"""A batch handed in as one structure: `forward(self, batch)` with a dict of tensors (a training
loop's usual batch), or nested dicts, lists and tuples. The trace names each tensor inside
(`arg0['tokens']`), so the batch size, data parallelism and micro-batches see them; the output's
batch_share and micro_batches slice every tensor in the structure and keep its shape. Before, the
batch of such a model was taken as 1 and --dp refused."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from nnscaler_cst.analysis import analyze

DICT_BATCH = textwrap.dedent('''
    import torch
    from torch import nn
    import torch.nn.functional as F


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(32, 16)
            self.layers = nn.ModuleList([nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 32), nn.GELU(),
                                                       nn.Linear(32, 16)) for _ in range(4)])
            self.head = nn.Linear(16, 32)

        def forward(self, batch):
            x = self.emb(batch["tokens"])
            for layer in self.layers:
                x = x + layer(x) * batch["keep"][0].unsqueeze(-1)
            return F.cross_entropy(self.head(x).flatten(0, 1), batch["labels"].flatten())


    def build():
        torch.manual_seed(0)
        return Net()


    def example_inputs():
        torch.manual_seed(1)
        keep = torch.ones(4, 8)
        keep[:, -2:] = 0
        return ({"tokens": torch.randint(0, 32, (4, 8)), "keep": [keep], "labels": torch.randint(0, 32, (4, 8))},)
''')


@pytest.fixture
def model(tmp_path):
    (tmp_path / "net.py").write_text(DICT_BATCH)
    return tmp_path / "net.py"


def test_the_tensors_inside_a_batch_structure_are_the_models_inputs(model):
    trace = analyze(model).trace
    assert trace.batch_size == 4
    assert {trace.tensors[t].input_name for t in trace.inputs.values()} >= {"arg0['tokens']", "arg0['labels']",
                                                                            "arg0['keep'][0]"}


@pytest.mark.slow
@pytest.mark.parametrize("options", [["--dp", "2", "--micro-batches", "2"], ["--pp", "2", "--micro-batches", "2"]])
def test_a_dict_batch_trains_like_one_device_under_data_parallel_and_pipelines(model, options):
    result = subprocess.run([sys.executable, "-m", "nnscaler_cst.cli", "verify", "net.py", *options, "-o", "out",
                             "--json"], cwd=model.parent, capture_output=True, text=True, timeout=600)
    start = result.stdout.find("{")
    outcome = json.loads(result.stdout[start:]) if start >= 0 else None
    assert result.returncode == 0 and outcome and outcome["passed"] is True, result.stdout + result.stderr
