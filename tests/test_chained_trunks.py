"""Pipelines over chained trunks (issue 10): an encoder's block list, then a decoder's, each looped
over in a method of the module holding it, cut as one chain of blocks so that stages balance
across both (T5 and BART through transformers are in test_interlaced.py and test_unseen_models.py).

The model below is written for these tests: distinct encoder and decoder classes (BART's layout),
one embedding shared by the encoder, the decoder and the head, an encoder returning a dict (what a
later stage gets back in place of running it) and a decoder reading the encoder's output in every
block (an argument of its method, not a hand-off variable).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from nnscaler_cst.analysis import analyze
from nnscaler_cst.errors import UserError
from nnscaler_cst.plan.pipeline import ChainRole, _chain_roles, plan_stages
from nnscaler_cst.rewrite import PlanRequest, rewrite

ENCODER_DECODER = '''
import torch
import torch.nn as nn


class Layer(nn.Module):
    def __init__(self, d, cross=False):
        super().__init__()
        self.mix = nn.Linear(d, d)
        self.cross = nn.Linear(d, d) if cross else None
        self.norm = nn.LayerNorm(d)

    def forward(self, h, memory=None):
        h = h + torch.tanh(self.mix(h))
        if self.cross is not None:
            h = h + self.cross(memory).mean(dim=1, keepdim=True)
        return self.norm(h)


class Encoder(nn.Module):
    def __init__(self, embed, d, n):
        super().__init__()
        self.embed = embed
        self.layers = nn.ModuleList([Layer(d) for _ in range(n)])
        self.norm = nn.LayerNorm(d)

    def forward(self, ids):
        h = self.embed(ids) * 2.0
        for layer in self.layers:
            h = layer(h)
        return {"last": self.norm(h)}


class Decoder(nn.Module):
    def __init__(self, embed, d, n):
        super().__init__()
        self.embed = embed
        self.layers = nn.ModuleList([Layer(d, cross=True) for _ in range(n)])

    def forward(self, ids, memory):
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h, memory)
        return h


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared = nn.Embedding(64, 32)
        self.encoder = Encoder(self.shared, 32, 2)
        self.decoder = Decoder(self.shared, 32, 2)
        self.head = nn.Linear(32, 64, bias=False)
        self.head.weight = self.shared.weight

    def forward(self, src, tgt):
        memory = self.encoder(src)["last"]
        logits = self.head(self.decoder(tgt, memory))
        return nn.functional.cross_entropy(logits.flatten(0, 1), tgt.flatten())


def build():
    return Model()


def example_inputs():
    return torch.randint(0, 64, (4, 8)), torch.randint(0, 64, (4, 6))
'''


def _write(tmp_path: Path) -> Path:
    path = tmp_path / "encdec.py"
    path.write_text(ENCODER_DECODER)
    return path


def _trunks(*sizes):
    return [SimpleNamespace(owner=f"t{i}", blocks=[f"t{i}.layers.{b}" for b in range(n)]) for i, n in enumerate(sizes)]


def test_each_stage_plays_its_part_in_each_trunk_of_the_chain():
    enter, receive, skip = (lambda *a: ChainRole("enter", *a)), (lambda *a: ChainRole("receive", *a)), \
        ChainRole("skip", 0, 0, False)
    # 2 + 2 blocks on 4 stages: stage 1 ends where the decoder starts, so it runs the decoder's
    # prologue and hands on before its first block; stages 2 and 3 start after the encoder
    assert _chain_roles(_trunks(2, 2), [(0, 1), (1, 2), (2, 3), (3, 4)]) == {
        0: {"t0": enter(0, 1, True)},
        1: {"t0": receive(1, 2, False), "t1": enter(0, 0, True)},
        2: {"t0": skip, "t1": receive(0, 1, True)},
        3: {"t0": skip, "t1": receive(1, 2, False)}}
    # 3 + 1 on 2 stages: the cut inside the encoder; the second stage ends it and runs the decoder
    assert _chain_roles(_trunks(3, 1), [(0, 2), (2, 4)]) == {
        0: {"t0": enter(0, 2, True)},
        1: {"t0": receive(2, 3, False), "t1": enter(0, 1, False)}}


def test_the_stages_cut_both_block_lists_and_the_tied_embedding_sits_where_it_is_called(tmp_path):
    graph = analyze(_write(tmp_path)).graph
    plan = plan_stages(graph, 4)
    assert [t.container for t in plan.chain] == ["encoder.layers", "decoder.layers"]
    assert plan.blocks == ["encoder.layers.0", "encoder.layers.1", "decoder.layers.0", "decoder.layers.1"]
    assert plan.block_ranges == [(0, 1), (1, 2), (2, 3), (3, 4)]
    # the encoder's embedding on stage 0, the decoder's on stage 1 (it ends where the decoder
    # starts), the head on stage 3: one weight, three holders, its gradient summed over them
    assert plan.tied_ranks == [0, 1, 3]
    assert "encoder.norm" in plan.drop[0] and "encoder.norm" not in plan.drop[1]
    # on 2 stages the work balances after the first decoder block: a decoder block is two of an
    # encoder's linears (its cross linear), the tied head on the last stage two more; an
    # embedding lookup costs its output, no matmul
    two = plan_stages(graph, 2)
    assert two.block_ranges == [(0, 3), (3, 4)] and two.local_ranges(1) == {"encoder.layers": (0, 0),
                                                                            "decoder.layers": (1, 2)}


# the encoder sets its own state before its blocks (BigBird-Pegasus switches its attention type so)
SETTING_STATE = ENCODER_DECODER.replace(
    "    def forward(self, ids):\n        h = self.embed(ids) * 2.0\n",
    "    def set_scale(self, value):\n        self.scale = value\n\n"
    "    def forward(self, ids):\n        self.set_scale(2.0)\n        h = self.embed(ids) * self.scale\n")


def test_state_an_encoder_sets_concerns_only_the_stages_that_run_it(tmp_path):
    assert "self.set_scale(2.0)" in SETTING_STATE
    path = tmp_path / "setting.py"
    path.write_text(SETTING_STATE)
    graph = analyze(path).graph
    plan_stages(graph, 2)            # stage 1 skips the encoder: the write is no concern of it
    with pytest.raises(UserError, match="sets encoder.scale"):
        plan_stages(graph, 4)        # stage 1 runs the encoder's second block without the write


def test_each_trunk_method_asks_its_self_what_this_stage_does(tmp_path):
    # cut where the decoder starts: stage 1 skips the encoder and receives before the decoder's blocks
    files = rewrite(analyze(_write(tmp_path)), PlanRequest(pp=2, micro_batches=2, stage_cuts=[2])).files
    text = files["model_stage1.py"]
    assert "if pp_skips(self):" in text and "return pp_passed(self)" in text
    assert 'return pp_returns(self, {"last": self.norm(h)})' in text
    assert "h, = pp_received(self)" in text and "pp_hand_on(self, h)" in text
    assert "STAGE_TRUNKS = {1: {'encoder': ('skip', 0, 0, False), 'decoder': ('receive', 0, 2, False)}}" in text


def test_plan_auto_prices_stages_over_the_whole_chain(tmp_path):
    from nnscaler_cst.plan.auto import _blocks, _stage_ranges
    blocks = _blocks(analyze(_write(tmp_path)).graph)
    assert blocks.count == 4 and _stage_ranges(blocks, 2) == [(0, 3), (3, 4)]     # as plan_stages cuts it


def test_the_encoder_output_is_kept_and_handed_on_only_where_decoder_blocks_read_it(tmp_path):
    # every decoder block reads the encoder's output: the stages holding decoder blocks keep it
    # (once, under recompute), and the cuts from where it is made to its last reader carry it;
    # the encoder's stages neither keep nor send it (auto priced it on every stage)
    from nnscaler_cst.plan.auto import _blocks, _regions, _stage_ranges, _stages
    from nnscaler_cst.plan.cost import load_cluster
    graph = analyze(_write(tmp_path)).graph
    blocks = _blocks(graph)
    assert _stage_ranges(blocks, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]    # enc 0, enc 1, dec 0, dec 1
    stages = _stages(_regions(graph, blocks, None, 1, load_cluster("cpu-gloo").axis(1, 1)), blocks, 4)
    assert stages.reads_shared == [False, False, True, True]
    # enc 0 | enc 1: not made yet; enc 1 | dec 0 and dec 0 | dec 1: carried; each cut counts on both sides
    assert stages.shared_sends == [0, 1, 2, 1]


def test_recompute_checkpoints_the_blocks_of_every_list_of_the_chain(tmp_path):
    files = rewrite(analyze(_write(tmp_path)), PlanRequest(pp=2, micro_batches=2, recompute=True)).files
    text = files["model_stage0.py"]
    assert "h = torch.utils.checkpoint.checkpoint(layer, h, use_reentrant=False)" in text
    assert "h = torch.utils.checkpoint.checkpoint(layer, h, memory, use_reentrant=False)" in text


@pytest.mark.slow
@pytest.mark.parametrize("args", [("--pp", "4", "--micro-batches", "4"),
                                  ("--pp", "2", "--micro-batches", "2", "--schedule", "interlaced")],
                         ids=["pp4", "interlaced-pp2"])
def test_a_chained_encoder_decoder_trains_like_one_device(tmp_path, args):
    result = subprocess.run([sys.executable, "-m", "nnscaler_cst.cli", "verify", str(_write(tmp_path)), *args,
                             "--json"], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    outcome = json.loads(result.stdout) if result.stdout.strip().startswith("{") else None
    assert result.returncode == 0 and outcome and outcome["passed"] is True, result.stdout + result.stderr
