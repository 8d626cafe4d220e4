"""Pipeline stages whose code after the block loop reads a block's module (issue 26: diffusers'
DiT runs `self.transformer_blocks[0].norm1.emb(...)` after its loop for the output's conditioning).

That code runs on the last stage. The loop is then cut by its iterations: every stage keeps the
whole list, numbered as the model's, and the last stage holds what it reads of block 0 (tied with
the first stage: gradients summed), the rest of block 0 hollow. A read of another stage's block
that the stages cannot hold so is refused before anything is written.
"""
from __future__ import annotations

import textwrap

import pytest

from nnscaler_cst.errors import UserError

DIT_LIKE = textwrap.dedent('''
    import torch
    import torch.nn as nn


    class Embed(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.fc = nn.Linear(d, 2 * d)

        def forward(self, t):
            return self.fc(torch.sin(t))


    class AdaNorm(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.emb = Embed(d)
            self.norm = nn.LayerNorm(d, elementwise_affine=False)

        def forward(self, x, t):
            scale, shift = self.emb(t).chunk(2, dim=-1)
            return self.norm(x) * (1 + scale) + shift


    class Block(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.norm1 = AdaNorm(d)
            self.ff = nn.Linear(d, d)

        def forward(self, x, t):
            return x + self.ff(self.norm1(x, t))


    class Net(nn.Module):
        def __init__(self, d=8, n=4):
            super().__init__()
            self.inp = nn.Linear(d, d)
            self.blocks = nn.ModuleList([Block(d) for _ in range(n)])
            self.out = nn.Linear(d, d)

        def conditioning(self, t):
            return self.blocks[0].norm1.emb(t)

        def forward(self, x, t):
            x = self.inp(x)
            for block in self.blocks:
                x = block(x, t)
            scale, shift = self.blocks[0].norm1.emb(t).chunk(2, dim=-1)
            return self.out(x * (1 + scale) + shift).pow(2).mean()


    def build():
        torch.manual_seed(0)
        return Net()


    def example_inputs():
        return (torch.randn(4, 8), torch.randn(4, 8))
''')

AFTER_LOOP = "        scale, shift = self.blocks[0].norm1.emb(t).chunk(2, dim=-1)\n"


def plan_of(tmp_path, text: str, stages: int = 2):
    from nnscaler_cst.analysis import analyze
    from nnscaler_cst.plan.pipeline import plan_stages
    path = tmp_path / "dit_like.py"
    path.write_text(text)
    return plan_stages(analyze(path).graph, stages)


def test_a_block_module_read_after_the_loop_is_held_by_the_reading_stage_and_tied(tmp_path):
    plan = plan_of(tmp_path, DIT_LIKE)
    assert plan.trunk.container == "blocks" and plan.trunk.iterations
    assert plan.block_ranges == [(0, 2), (2, 4)]
    # the last stage keeps block 0's conditioning; the rest of block 0, all of block 1, the input layer hollow
    assert sorted(plan.drop[1]) == ["blocks.0.ff", "blocks.1", "inp"]
    assert ["blocks.0.norm1.emb.fc.bias"] in plan.tied and ["blocks.0.norm1.emb.fc.weight"] in plan.tied
    assert plan.tied_ranks == []            # the first and the last stage: the default group


def test_the_call_after_the_loop_runs_on_the_last_stage(tmp_path):
    from nnscaler_cst.analysis import analyze
    from nnscaler_cst.plan.pipeline import plan_stages
    path = tmp_path / "dit_like.py"
    path.write_text(DIT_LIKE)
    graph = analyze(path).graph
    plan = plan_stages(graph, 2)
    emb = [n.index for n in graph.nodes if n.callee_path == "blocks.0.norm1.emb.fc"]
    assert len(emb) == 2        # inside block 0, then after the loop
    assert [plan.node_stage[i] for i in emb] == [0, 1]


def test_a_block_module_read_through_a_helper_after_the_loop_is_refused_where_it_reads(tmp_path):
    """The code after the loop reaches block 0 through a method of the model: the loop is cut
    apart (each stage holds its own blocks, numbered from 0), and the last stage's read would
    take its own first block's weights: refused, at the read."""
    text = DIT_LIKE.replace(AFTER_LOOP, AFTER_LOOP.replace("self.blocks[0].norm1.emb(t)", "self.conditioning(t)"))
    assert text != DIT_LIKE
    with pytest.raises(UserError) as refused:
        plan_of(tmp_path, text)
    assert "pipeline stage 1 reads blocks.0.norm1.emb.fc.bias, which stage 0 holds" \
        in refused.value.message
    assert refused.value.location.line == text.splitlines().index("        return self.fc(torch.sin(t))") + 1


@pytest.mark.slow
def test_a_block_module_read_after_the_loop_trains_like_one_device(tmp_path):
    import subprocess
    import sys
    path = tmp_path / "dit_like.py"
    path.write_text(DIT_LIKE)
    result = subprocess.run([sys.executable, "-m", "nnscaler_cst", "verify", str(path), "--pp", "2",
                             "--micro-batches", "2", "-o", str(tmp_path / "out")],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PASS" in result.stdout
