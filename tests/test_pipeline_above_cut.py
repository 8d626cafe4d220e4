"""Pipeline cuts whose block loop is not in the model's top forward (issue 26: diffusers' UNets).

Code above the function holding the block loop runs on every stage up to that function's call.
A module it reaches through a ModuleList (`for layer in self.down: ...`) is called there, so
every stage must hold it (a shadow), never drop it; and a cut whose code above does more of the
model's work than the blocks divide (a UNet's down path, its skip connections read after the
block loop returns) is refused before anything is written, where that code begins.
"""
from __future__ import annotations

import textwrap

import pytest

from nnscaler_cst.errors import UserError

UNET_LIKE = textwrap.dedent('''
    import torch
    import torch.nn as nn


    class Block(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.fc = nn.Linear(d, d)

        def forward(self, x):
            return x + self.fc(x)


    class Widen(nn.Module):
        def __init__(self, d, wide):
            super().__init__()
            self.fc = nn.Linear(d, wide)

        def forward(self, x):
            return torch.relu(self.fc(x))


    class Narrow(nn.Module):
        def __init__(self, wide, d):
            super().__init__()
            self.fc = nn.Linear(wide, d)

        def forward(self, x):
            return self.fc(x)


    class Middle(nn.Module):
        def __init__(self, d, n):
            super().__init__()
            self.blocks = nn.ModuleList([Block(d) for _ in range(n)])

        def forward(self, x):
            x = x * 2
            for block in self.blocks:
                x = block(x)
            return x


    class Net(nn.Module):
        def __init__(self, d=8, wide=WIDE):
            super().__init__()
            self.down = nn.ModuleList([Widen(d, wide), Narrow(wide, d)])
            self.mid = Middle(d, 2)
            self.up = nn.Linear(2 * d, d)

        def forward(self, x):
            skips = []
            for layer in self.down:
                x = layer(x)
                skips.append(x)
            x = self.mid(x)
            return self.up(torch.cat([x, skips[-1]], dim=-1)).pow(2).mean()


    def build():
        return Net()


    def example_inputs():
        return (torch.randn(4, 8),)
''')


def analyze_with(tmp_path, wide: int):
    from nnscaler_cst.analysis import analyze
    path = tmp_path / "unet_like.py"
    path.write_text(UNET_LIKE.replace("WIDE", str(wide)))
    return analyze(path).graph


def test_modules_code_above_the_cut_calls_through_a_module_list_are_held_by_every_stage(tmp_path):
    from nnscaler_cst.plan.pipeline import plan_stages
    plan = plan_stages(analyze_with(tmp_path, 2), 2)      # the down path: less work than the blocks
    assert plan.block_ranges == [(0, 1), (1, 2)]
    assert {"down.0.fc", "down.1.fc"} <= set(plan.shadow[1])
    assert not {"down.0.fc", "down.1.fc"} & set(plan.drop[1])


def test_blocks_under_more_work_than_they_divide_give_way_to_a_cut_between_the_statements_above(tmp_path):
    """A UNet's up blocks run after its down path: cut between the top forward's statements
    instead, the down path on the first stage, its skips handed on."""
    from nnscaler_cst.plan.pipeline import plan_stages
    plan = plan_stages(analyze_with(tmp_path, 64), 2)     # the down path: more work than the blocks
    assert plan.trunk.container == "Net.forward" and plan.trunk.statements is not None
    assert plan.block_ranges == [(0, 1), (1, 3)]          # the down loop | mid, then the up path
    assert plan.trunk.statements.crossing[plan.trunk.statements.starts[1]] == ["skips", "x"]


def test_a_cut_leaving_more_work_to_every_stage_than_it_divides_is_refused_where_that_work_starts(tmp_path):
    """No cut between statements divides the work either (the down path runs 94% of it)."""
    from nnscaler_cst.plan.pipeline import plan_stages
    with pytest.raises(UserError) as refused:
        plan_stages(analyze_with(tmp_path, 256), 2)
    assert "every stage would also run the code above it (down" in refused.value.message
    first_op = UNET_LIKE.splitlines().index("        return torch.relu(self.fc(x))") + 1   # the down path's
    assert refused.value.location.line == first_op


@pytest.mark.slow
def test_a_cut_between_statements_above_the_blocks_trains_like_one_device(tmp_path):
    import subprocess
    import sys
    path = tmp_path / "unet_like.py"
    path.write_text(UNET_LIKE.replace("WIDE", "64"))
    result = subprocess.run([sys.executable, "-m", "nnscaler_cst", "verify", str(path), "--pp", "2",
                             "--micro-batches", "2", "-o", str(tmp_path / "out")],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "if pp_stage() == 0:" in (tmp_path / "out" / "model_stage0.py").read_text()


NAMED_LOOP = textwrap.dedent('''
    import torch
    import torch.nn as nn


    class Block(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.fc = nn.Linear(d, d)

        def forward(self, x):
            return x + self.fc(x)


    class LayerGetter(nn.ModuleDict):
        """torchvision's IntermediateLayerGetter: runs its layers, keeps the outputs it names."""

        def __init__(self, layers, keep):
            super().__init__(layers)
            self.keep = keep

        def forward(self, x):
            out = {}
            for name, module in self.items():
                x = module(x)
                if name in self.keep:
                    out[self.keep[name]] = x
            return out


    class Net(nn.Module):
        def __init__(self, d=8):
            super().__init__()
            self.body = LayerGetter({str(i): Block(d) for i in range(4)}, {"1": "low", "3": "high"})

        def forward(self, x):
            out = self.body(x)
            return (out["low"] + out["high"]).pow(2).mean()


    def build():
        return Net()


    def example_inputs():
        return (torch.randn(4, 8),)
''')


def test_a_block_loop_over_the_blocks_names_is_cut_by_its_iterations(tmp_path):
    """Each stage keeps the whole ModuleDict (the other stages' blocks hollow) and runs its
    iterations, so the names the loop picks its outputs by are the whole model's."""
    from nnscaler_cst.analysis import analyze
    from nnscaler_cst.plan.pipeline import plan_stages
    path = tmp_path / "named.py"
    path.write_text(NAMED_LOOP)
    plan = plan_stages(analyze(path).graph, 2)
    assert plan.trunk.iterations and plan.trunk.container == "body"
    assert plan.block_ranges == [(0, 2), (2, 4)] and plan.drop[1] == ["body.0", "body.1"]


def test_a_block_loop_over_names_skipping_a_block_is_refused_at_the_loop(tmp_path):
    from nnscaler_cst.analysis import analyze
    from nnscaler_cst.plan.pipeline import plan_stages
    path = tmp_path / "skipping.py"
    skipping = NAMED_LOOP.replace("            x = module(x)\n", "            if name != \"2\":\n"
                                  "                x = module(x)\n")
    assert skipping != NAMED_LOOP
    path.write_text(skipping)
    with pytest.raises(UserError) as refused:
        plan_stages(analyze(path).graph, 2)
    assert "iterates over their names (`self.items()`)" in refused.value.message
    assert refused.value.location.line == NAMED_LOOP.splitlines().index("        for name, module in self.items():") + 1


def test_a_block_loop_leaving_the_names_unread_is_cut(tmp_path):
    from nnscaler_cst.analysis import analyze
    from nnscaler_cst.plan.pipeline import plan_stages
    path = tmp_path / "unread.py"
    unread = NAMED_LOOP.replace("            if name in self.keep:\n                out[self.keep[name]] = x\n",
                                "            out[len(out)] = x\n")
    path.write_text(unread.replace('out["low"] + out["high"]', "out[1] + out[3]"))
    assert plan_stages(analyze(path).graph, 2).block_ranges == [(0, 2), (2, 4)]


def test_code_after_the_block_loop_reading_the_block_list_cuts_the_loop_by_its_iterations(tmp_path):
    """DiT's output conditioning reads `self.transformer_blocks[0].norm1.emb` after the loop, on the
    last stage: every stage keeps the whole list, numbered as the model's, and the last stage holds
    block 0's layer too, tied with the first (tests/test_block_read_after_loop.py trains one)."""
    from nnscaler_cst.analysis import analyze
    from nnscaler_cst.plan.pipeline import plan_stages
    path = tmp_path / "epilogue.py"
    loop = "        for block in self.blocks:\n            x = block(x)\n        return x\n"
    assert loop in UNET_LIKE
    whole = UNET_LIKE.replace("WIDE", "2").replace(loop, loop.replace(
        "return x\n", "return x + self.blocks[0].fc.bias\n"))
    path.write_text(whole.replace(UNET_LIKE[UNET_LIKE.index("        skips = []"):UNET_LIKE.index("\n\n\ndef build")],
                                  "        return self.mid(x).pow(2).mean()"))
    plan = plan_stages(analyze(path).graph, 2)
    assert plan.trunk.container == "mid.blocks" and plan.trunk.iterations
    assert "mid.blocks.0" not in plan.drop[1] and "mid.blocks.1" in plan.drop[0]
    assert sorted(plan.tied) == [["mid.blocks.0.fc.bias"], ["mid.blocks.0.fc.weight"]]


def test_code_after_an_nn_sequential_call_of_the_blocks_reading_them_is_refused_there(tmp_path):
    """The blocks called as one nn.Sequential (`x = self.blocks(x)`) are cut by slicing it: each stage
    holds only its blocks, numbered from its first, and the code after the call would read another
    (refused at the read: the stages of an nn.Sequential are found without the check of the code
    after a loop)."""
    from nnscaler_cst.analysis import analyze
    from nnscaler_cst.plan.pipeline import plan_stages
    path = tmp_path / "epilogue.py"
    loop = "        for block in self.blocks:\n            x = block(x)\n        return x\n"
    sequential = UNET_LIKE.replace("WIDE", "2").replace(
        "nn.ModuleList([Block(d) for _ in range(n)])", "nn.Sequential(*[Block(d) for _ in range(n)])").replace(
        loop, "        x = self.blocks(x)\n        return x + self.blocks[0].fc.bias\n")
    path.write_text(sequential.replace(
        UNET_LIKE[UNET_LIKE.index("        skips = []"):UNET_LIKE.index("\n\n\ndef build")],
        "        return self.mid(x).pow(2).mean()"))
    with pytest.raises(UserError) as refused:
        plan_stages(analyze(path).graph, 2)
    assert "pipeline stage 1 reads mid.blocks.0.fc.bias, which stage 0 holds" in refused.value.message
    assert refused.value.location.line == sequential.splitlines().index(
        "        return x + self.blocks[0].fc.bias") + 1
