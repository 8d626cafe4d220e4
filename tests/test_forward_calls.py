"""A block called as `block.forward(x)` from the model's own code (SqueezeBERT's encoder loops
`layer.forward(hidden_states, ...)`): nn.Module's call, and its hooks, are bypassed, but it is
a call of the block from that line all the same, so the loop over the blocks is cut into
pipeline stages as any other.

Was: "the blocks of layers are not called as modules from the model's own code", at the first
line inside the first block that reads its weights.
"""
from __future__ import annotations

import textwrap

from nnscaler_cst.analysis import analyze
from nnscaler_cst.rewrite import PlanRequest, rewrite

FORWARD_LOOP = textwrap.dedent('''
    import torch
    import torch.nn as nn


    class Block(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.fc1 = nn.Linear(d, 2 * d)
            self.fc2 = nn.Linear(2 * d, d)

        def forward(self, x):
            return {"out": x + self.fc2(torch.relu(self.fc1(x)))}


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(8, 8)
            self.layers = nn.ModuleList(Block(8) for _ in range(4))

        def forward(self, x):
            h = self.embed(x)
            for layer in self.layers:
                h = layer.forward(h)["out"]
            return h.pow(2).mean()


    def build():
        return Net()


    def example_inputs():
        return (torch.randn(4, 8),)
''')


def test_blocks_called_through_their_forward_are_cut_into_pipeline_stages(tmp_path):
    path = tmp_path / "forward_loop.py"
    path.write_text(FORWARD_LOOP)
    analysis = analyze(path)
    line = FORWARD_LOOP.splitlines().index('            h = layer.forward(h)["out"]') + 1
    calls = analysis.graph.trace.module_calls
    assert [(p, calls[p][0].line) for p in calls if p.count(".") == 1 and p.startswith("layers.")] == [
        (f"layers.{k}", line) for k in range(4)]
    files = rewrite(analysis, PlanRequest(pp=2, micro_batches=2)).files    # its dry run runs both stages
    assert "STAGE_BLOCKS = {1: (2, 4)}" in files["model_stage1.py"]
    assert '            h = layer.forward(h)["out"]\n' in files["model_stage1.py"]
