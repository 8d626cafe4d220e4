"""Spec: a whole tensor broadcast into a split tensor's local size (DeepSeek's MLA:
`k_pe.expand(-1, -1, k_nope.size(2), -1)` with k_nope split by heads) is read in part on each
rank, so its gradient is a partial sum, all-reduced backward (a `copy`) before the expand.
Without it the shared projection's weights got each rank's heads' gradient only (torchtitan
deepseek_v3 at DP x TP 2 x 2: wrong `wkv_a` gradients, in float64 too).
Verified by hand: `nnscaler-rewrite verify model.py --tp 2` passes on this model (it failed
before, `wpe.weight` gradients off by 0.9 of the largest).
"""
from __future__ import annotations

import textwrap

from nnscaler_cst.analysis import analyze
from nnscaler_cst.rewrite import PlanRequest, rewrite

SHARED_PART = """
import torch
import torch.nn as nn


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wkv = nn.Linear(16, 32)
        self.wpe = nn.Linear(16, 4)
        self.wo = nn.Linear(48, 16)

    def forward(self, x):
        b, t, _ = x.shape
        kv = self.wkv(x).view(b, t, -1, 8)
        pe = self.wpe(x).unsqueeze(2)
        k = torch.cat([kv, pe.expand(-1, -1, kv.size(2), -1)], dim=-1)
        return self.wo(k.reshape(b, t, -1))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Attention() for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


def build():
    return Net()


def example_inputs():
    return (torch.randn(2, 3, 16),)


def loss(output):
    return output.pow(2).mean()
"""


def test_a_whole_tensor_broadcast_to_a_split_size_takes_its_gradient_reduced(tmp_path):
    (tmp_path / "model.py").write_text(textwrap.dedent(SHARED_PART).lstrip("\n"))
    code = rewrite(analyze(tmp_path / "model.py"), PlanRequest(plan="megatron", tp=2)).files["model.py"]
    assert "pe = tp_copy(tp_gather(self.wpe(tp_copy(x, TP)), TP, dim=2).unsqueeze(2), TP)" in code, code
    assert "k = torch.cat([kv, pe.expand(-1, -1, kv.size(2), -1)], dim=-1)" in code, code
