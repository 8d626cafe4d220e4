"""Spec: a helper of a library whose package name begins with "torch" (torch_einops_utils,
torchtitan's token dispatcher) is the library's code, not torch's own. The model line calling it
is one node of that helper, reading every tensor argument, as any library helper is: read as
torch's code, the line's ops were recorded as one torch op with only the first op's operands, so
a split tensor passed as the second argument reached the helper unconverted (torchtitan's MoE
combine under TP=2: "Expected index [192, 256] to be no larger than ... src [192, 128]").
"""
from __future__ import annotations

import textwrap

import pytest

from nnscaler_cst.analysis import analyze

pytest.importorskip("torch_einops_utils")

MASKED = """
import torch
import torch.nn as nn
from torch_einops_utils import masked_sum


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x, mask):
        h = self.proj(x)
        return masked_sum(mask.float(), h > 0, dim=1).mean() + h.mean()


def build():
    return Net()


def example_inputs():
    return (torch.randn(4, 6, 8), torch.ones(4, 6, 8, dtype=torch.bool))
"""


def test_a_helper_of_a_torch_named_library_is_one_node_reading_every_tensor(tmp_path):
    (tmp_path / "model.py").write_text(textwrap.dedent(MASKED).lstrip("\n"))
    trace = analyze(tmp_path / "model.py").trace
    made = {n.callee: n.outputs[0] for n in trace.nodes if n.callee in ("Tensor.float", "Tensor.gt")}
    readers = [n for n in trace.nodes if made["Tensor.gt"] in n.inputs]
    assert len(readers) == 1, [(n.callee, n.callee_kind, n.span) for n in readers]
    call = readers[0]
    assert call.callee.startswith("torch_einops_utils.") and call.callee_kind == "function", call.callee
    assert call.span.line == 13 and call.inputs == [made["Tensor.float"], made["Tensor.gt"]], call.operands
