"""Spec: a custom torch.autograd.Function applied in a model's forward (`Gate.apply(a, b)`, as
transformers' PhiMoE applies its PhimoeMultiplier) is one opaque op of the line that applies it.

- The trace records one node for the apply, whose operands are every tensor argument: its
  backward may read a tensor no traced op reads (saved by ctx.save_for_backward), so that tensor
  still has a consumer, which keeps it whole under TP, as any op without a split rule does.
- The apply's results need a gradient although its forward ran with grad off: a split tensor
  they multiply is gathered first, or the gradient sent back to them would be a partial sum.
- In a block repeated over a ModuleList (trace/replicate.py copies the first block's records),
  each block's apply is such a node.
Verified by hand: `nnscaler-rewrite verify model.py --tp 2` passes on this model.
"""
from __future__ import annotations

import textwrap

from nnscaler_cst.analysis import analyze
from nnscaler_cst.rewrite import PlanRequest, rewrite

GATED = """
import torch
import torch.nn as nn


class Gate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scores, gate):
        ctx.save_for_backward(scores)       # read only by backward
        return gate * 2.0

    @staticmethod
    def backward(ctx, grad):
        (scores,) = ctx.saved_tensors
        return grad.sum(-1, keepdim=True).expand(grad.shape[0], 16) * scores, grad * 2.0


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Linear(8, 16)
        self.out = nn.Linear(8, 8)

    def forward(self, x):
        scores = self.router(x)
        w = Gate.apply(scores, torch.sigmoid(x.sum(-1, keepdim=True)))
        return x + (self.out(x) * w).pow(2)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.mean()


def build():
    return Net()


def example_inputs():
    return (torch.randn(4, 8),)
"""


def _analysis(tmp_path):
    (tmp_path / "model.py").write_text(textwrap.dedent(GATED).lstrip("\n"))
    return analyze(tmp_path / "model.py")


def test_a_custom_function_apply_is_one_node_reading_every_tensor_argument(tmp_path):
    trace = _analysis(tmp_path).trace
    applies = [n for n in trace.nodes if n.callee.endswith("Gate.apply")]
    assert len(applies) == 2, [(n.callee, n.callee_kind) for n in trace.nodes]
    routers = [n for n in trace.nodes if n.callee_path and n.callee_path.endswith("router")]
    for apply, router in zip(applies, routers):
        assert apply.callee_kind == "function" and apply.span.line == 25
        scores = router.produced[-1]
        assert [op.name for op in apply.operands] == ["arg0", "arg1"]
        assert apply.operands[0].tid == scores          # the tensor only backward reads
        assert all(trace.tensors[t].requires_grad for t in apply.produced[-1:])


def test_a_tensor_only_a_custom_functions_backward_reads_is_kept_whole_under_tp(tmp_path):
    out = rewrite(_analysis(tmp_path), PlanRequest(plan="megatron", tp=2))
    code = out.files["model.py"]
    assert "scores = tp_gather(self.router(tp_copy(x, TP)), TP, dim=1)" in code, code
    assert "(tp_gather(self.out(tp_copy(x, TP)), TP, dim=1) * w)" in code, code
