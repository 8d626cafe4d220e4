"""The interlaced pipeline (issue 10 item 1, issue 29 item 1): the embedding and what shares its
weight (the LM head; T5/BART's encoder, decoder and head) split on the vocabulary over all
tp x pp devices, the blocks in lock-step 1F1B stages. Each call of a vocabulary-split module is
an SPMD step of its own (sEk, sGk) that every rank runs: the owner where its step makes the call,
the others between two of their own steps (or paused at a call of their own), never inside
another rank's step; an embedding's backward step runs after its owner's B. A walk of one
timeline of all ranks places them, the simulator checks the collectives before anything is
written. The gloo runs on a T5-style (TP 2 x PP 2) and a BART-style encoder-decoder are slow.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nnscaler_cst.errors import UserError
from nnscaler_cst.plan import interlaced
from nnscaler_cst.plan.schedules import Action, VocabSteps, load_schedule, placement
from nnscaler_cst.verify.simulate import simulate

REPO = Path(__file__).resolve().parents[1]

ORDER = ('order = ["F[k] < F[k+1]", "B[k] < B[k+1]", "F[k] < B[k]", "F[min(k+W, K-1)] < B[k]", '
         '"B[k] < F[k+W+1]"]')

# a GPT: the embedding first in stage 0's forward, the head last in the last stage's; their steps'
# seconds against a stage's forward of 1 (an embedding's backward runs after its owner's B)
EMBED = VocabSteps((0.0,), (0.05,), (0.1,), (True,))
HEAD = VocabSteps((1.0,), (0.1,), (0.2,), (False,))


def gpt(D: int) -> dict[int, VocabSteps]:
    return {0: EMBED, D - 1: HEAD}


def orders_of(table, D: int, M: int, vocab):
    place = placement(table, D)
    return interlaced.orders(table, D, M, place, vocab), place


def test_the_table_states_the_split_and_the_steps():
    table = load_schedule("interlaced")
    assert table.vocab == "tied" and table.virtual_stages == 1
    assert table.together == ("E[k] = F[k]", "G[k] = B[k]")


def test_each_call_is_a_step_of_every_rank_and_none_runs_inside_another_ranks_step():
    table = load_schedule("interlaced")
    orders, place = orders_of(table, 2, 2, gpt(2))
    assert [" ".join(map(str, o)) for o in orders] == [
        "0F0 0E0 0F1 0E1 1E0 1G0 1E1 1G1 0B0 0B1 0G0 0G1",
        "0E0 0E1 1F0 1E0 1B0 1G0 1F1 1E1 1B1 1G1 0G0 0G1"]
    events = simulate(orders, 2, placement=place, vocab=gpt(2))
    steps = [e for e in events if e.action.kind in "EG"]
    for step in steps:
        together = [e for e in steps if e.action == step.action]
        assert {e.rank for e in together} == {0, 1} and {e.start for e in together} == {step.start}
        for other in events:         # no rank is inside a step of its own while the call's step runs
            if other.action.kind in "FB" and other.rank != place.ranks[step.action.stage]:
                assert other.end <= step.start or other.start >= step.end, (step, other)


@pytest.mark.parametrize("D, M", [(2, 4), (4, 8), (4, 32)])
def test_every_rank_takes_part_in_every_vocabulary_step(D, M):
    table = load_schedule("interlaced")
    orders, place = orders_of(table, D, M, gpt(D))
    simulate(orders, D, placement=place, vocab=gpt(D))
    expected = {(k, s, m) for s in (0, D - 1) for k in "EG" for m in range(M)}
    for rank, order in enumerate(orders):
        own = [a for a in order if a.kind in "FB"]
        assert [a.stage for a in own] == [rank] * 2 * M            # its own 1F1B steps, all kept
        assert {(a.kind, a.stage, a.micro) for a in order if a.kind in "EG"} == expected
        forwards = [a.micro for a in own if a.kind == "F"]
        assert forwards == sorted(forwards)                        # the table's order within the rank


def test_the_calls_cost_their_own_steps_not_the_owners_whole_step():
    """A GPT at D = 4, M = 32: the steps of the embedding and the head cost every rank their own
    length, not a wait through the owner's step: the simulated step is within 2% of 1F1B's
    formula over each stage's time plus every vocabulary step."""
    table = load_schedule("interlaced")
    D, M = 4, 32
    orders, place = orders_of(table, D, M, gpt(D))
    span = max(e.end for e in simulate(orders, D, placement=place, vocab=gpt(D)))
    per_micro = 3.0 + sum(sum(v.forward) + sum(v.backward) for v in gpt(D).values())
    assert span == pytest.approx(interlaced.pipeline_seconds([3.0] * D, gpt(D), M), rel=0.02)
    assert span == pytest.approx((M + D - 1) * per_micro, rel=0.02)


def test_a_call_in_the_middle_of_a_step_pauses_the_others_until_it():
    """The owner's step pauses at its call: a rank whose step has a call half-way (a decoder's
    embedding after some of its stage's work) starts the call's step once every rank is between
    two steps, and goes on after it."""
    table = load_schedule("interlaced")
    vocab = {0: EMBED, 1: VocabSteps((0.5, 1.0), (0.05, 0.1), (0.1, 0.2), (True, False))}
    orders, place = orders_of(table, 2, 2, vocab)
    events = simulate(orders, 2, placement=place, vocab=vocab)
    first = [e for e in events if e.rank == 1 and e.action == Action("F", 1, 0)]
    middle = next(e for e in events if e.action == Action("E", 1, 0) and e.rank == 1)
    assert [round(e.end - e.start, 6) for e in first] == [0.5, 0.5, 0.0]    # cut at both calls
    assert first[0].end <= middle.start and first[1].start == middle.end


def test_a_together_other_than_the_owners_own_step_is_refused(tmp_path):
    broken = tmp_path / "broken.toml"
    broken.write_text(f'[schedule]\nname = "broken"\nwarmup = "D - i - 1"\n{ORDER}\nvocab = "tied"\n'
                      'together = ["E[k] = F[M - 1 - k]", "G[k] = B[k]"]\n')
    with pytest.raises(UserError, match="runs inside its owner's step"):
        orders_of(load_schedule(str(broken)), 2, 2, gpt(2))


def test_a_table_without_both_shares_is_refused(tmp_path):
    table_file = tmp_path / "half.toml"
    table_file.write_text(f'[schedule]\nname = "half"\nwarmup = "D - i - 1"\n{ORDER}\nvocab = "tied"\n'
                          'together = ["E[k] = F[k]"]\n')
    with pytest.raises(UserError, match="both E"):
        orders_of(load_schedule(str(table_file)), 2, 2, gpt(2))


def test_a_hand_edited_order_missing_or_moving_a_step_is_refused():
    table = load_schedule("interlaced")
    orders, place = orders_of(table, 2, 2, gpt(2))
    swapped = [list(o) for o in orders]
    swapped[1][0], swapped[1][1] = swapped[1][1], swapped[1][0]      # rank 1: 0E1 before 0E0
    with pytest.raises(UserError, match=r"rank 1 at step 0 \(0E1\) waits for rank 0"):
        simulate(swapped, 2, placement=place, vocab=gpt(2))
    dropped = [list(o) for o in orders]
    dropped[1].remove(Action("G", 0, 1))
    with pytest.raises(UserError, match="never runs it"):
        simulate(dropped, 2, placement=place, vocab=gpt(2))
    late = [list(o) for o in orders]
    late[0].remove(Action("E", 0, 1))
    late[0].insert(late[0].index(Action("B", 0, 0)) + 1, Action("E", 0, 1))   # after its next own step
    with pytest.raises(UserError, match=r"0F1, which pauses at 1 vocabulary call\(s\): its order must name 0E1"):
        simulate(late, 2, placement=place, vocab=gpt(2))
    early = [list(o) for o in orders]
    early[0].remove(Action("G", 0, 0))
    early[0].insert(early[0].index(Action("B", 0, 0)), Action("G", 0, 0))     # before the B it takes from
    with pytest.raises(UserError, match="before 0B0, whose gradient it takes"):
        simulate(early, 2, placement=place, vocab=gpt(2))


def test_the_tied_embedding_and_head_of_gpt_are_split_over_every_device():
    from nnscaler_cst.analysis import analyze
    from nnscaler_cst.plan.pipeline import plan_stages

    table = load_schedule("interlaced")
    analysis = analyze(REPO / "fixtures" / "gpt.py")
    stages = plan_stages(analysis.graph, 2, 1, None, placement(table, 2))
    assert stages.tied and "lm_head" in stages.drop[0]            # 1F1B: the head on the last stage only
    before = list(stages.stage_seconds)
    interlaced.apply(analysis.graph, stages, table, tp=2)
    assert stages.vocab_modules == ["lm_head", "transformer.wte"]
    assert stages.vocab_params == ["lm_head.weight", "transformer.wte.weight"]
    assert stages.vocab_stages == [0, 1] and stages.vocab_calls == {0: 1, 1: 1}
    embed, head = stages.vocab_steps[0], stages.vocab_steps[1]
    assert embed.at[0] < 1e-3 and embed.deferred == (True,)       # first in stage 0, its backward later
    assert head.at[0] > 0.9 and head.deferred == (False,)         # the head comes after the blocks
    assert stages.stage_seconds[1] < before[1]                    # the calls are steps of their own
    assert head.forward[0] == pytest.approx((before[1] - stages.stage_seconds[1]) / 4)   # 1/4 on each device
    assert not stages.tied                                         # one piece per device: nothing summed across stages
    assert all(m not in stages.drop[s] for s in (0, 1) for m in stages.vocab_modules)
    every, _ = interlaced.vocab_modules(analysis.graph, stages.trunk.blocks, 2, "all", table.location)
    assert "transformer.wpe" in every                              # "all": the position embedding too
    with pytest.raises(UserError, match="not divisible by the 3"):
        interlaced.vocab_modules(analysis.graph, stages.trunk.blocks, 3, "tied", table.location)


def test_the_planners_estimate_is_the_simulated_step_of_the_plan():
    """plan/interlaced.py `estimate` (what `--plan auto` calls): the GPT fixture at tp 2 x pp 2,
    8 micro-batches, priced from the walk on the simulator's timeline; the same step as simulating
    the walk's orders over its stage and call times, and its calls priced on every device."""
    from nnscaler_cst.analysis import analyze
    from nnscaler_cst.plan.auto import Config
    from nnscaler_cst.plan.cost import load_cluster

    graph = analyze(REPO / "fixtures" / "gpt.py").graph
    config = Config(tp=2, dp=1, pp=2, micro_batches=8, schedule="interlaced")
    estimate, vocab, stage = interlaced.price(graph, config, load_cluster("cpu-gloo"))
    assert estimate.config == config and estimate.why_not is None
    assert sorted(vocab) == [0, 1] and all(v.forward[0] > 0 and v.backward[0] > 0 for v in vocab.values())
    table = load_schedule("interlaced")
    forward = [t / 3 for t in stage]
    orders = interlaced.orders(table, 2, 8, placement(table, 2), vocab, forward)
    span = max(e.end for e in simulate(orders, 2, forward_seconds=forward, placement=placement(table, 2), vocab=vocab))
    assert estimate.pipeline_seconds == pytest.approx(span, rel=1e-6)
    assert estimate.seconds == pytest.approx(span + estimate.sync_seconds, rel=1e-6)


# --- gloo runs: a T5-style and a BART-style encoder-decoder, one embedding shared by the
# encoder, the decoder and the LM head (transformers' own classes, tiny configs) ---

T5 = '''
import torch
from transformers import T5Config, T5ForConditionalGeneration


def build():
    config = T5Config(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
                      num_heads=4, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    return T5ForConditionalGeneration(config)


def example_inputs():
    ids = torch.randint(3, 128, (4, 16))
    return {"input_ids": ids, "labels": ids}
'''

from test_unseen_models import BART  # noqa: E402  (the same tiny BART entry)

CASES = {
    "t5-pp2xtp2-m4": (T5, ("--pp", "2", "--tp", "2", "--micro-batches", "4")),
    "bart-pp2-m2": (BART, ("--pp", "2", "--micro-batches", "2")),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_interlaced_encoder_decoder_trains_like_the_single_device_run(tmp_path, case):
    pytest.importorskip("transformers")
    text, options = CASES[case]
    model = tmp_path / "model.py"
    model.write_text(text.lstrip())
    env = {**os.environ, "COLUMNS": "200", "PYTHONWARNINGS": "ignore"}
    result = subprocess.run([sys.executable, "-m", "nnscaler_cst.cli", "verify", str(model), *options,
                             "--schedule", "interlaced", "-o", str(tmp_path / "out"), "--json"],
                            capture_output=True, text=True, timeout=900, env=env)
    start = result.stdout.find("{")
    assert start >= 0, result.stdout + result.stderr
    outcome = json.loads(result.stdout[start:])
    assert result.returncode == 0 and outcome["passed"] is True, result.stdout + result.stderr
    rank0 = (tmp_path / "out" / "model_stage0.py").read_text()
    assert "VOCAB_MODULES = " in rank0 and "1E0" in rank0          # rank 0 takes part in stage 1's head
    assert "VOCAB_DEFERRED = " in rank0
    shards = [line for line in (tmp_path / "out" / "__init__.py").read_text().splitlines()
              if line.startswith("PP_VOCAB_SPLITS")]
    assert shards and "lm_head.weight" in shards[0]


# a table far larger than the blocks: what a device holds is its 1/(tp x pp) piece of the table
BIG_TABLE = '''
import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return x + self.fc(x)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16384, 16)
        self.blocks = nn.ModuleList([Block() for _ in range(2)])
        self.head = nn.Linear(16, 16384, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), ids.flatten())


def build():
    return Model()


def example_inputs():
    return {"ids": torch.randint(0, 16384, (2, 2))}
'''


def test_each_device_holds_its_piece_of_the_vocabulary_state(tmp_path):
    """price's memory: the table's weight, gradient and optimizer state (16 bytes an element) on
    one device is 1/(tp x pp) of it, whatever the tensor-parallel split kept whole (the vocabulary
    modules are whole on tp: they were counted 1/pp before)."""
    from nnscaler_cst.analysis import analyze
    from nnscaler_cst.plan.auto import Config
    from nnscaler_cst.plan.cost import load_cluster

    entry = tmp_path / "big_table.py"
    entry.write_text(BIG_TABLE)
    graph = analyze(entry).graph
    table_state = 16384 * 16 * 16
    estimate, _, _ = interlaced.price(graph, Config(tp=2, dp=1, pp=2, micro_batches=2, schedule="interlaced"),
                                      load_cluster("cpu-gloo"))
    assert table_state / 4 <= estimate.memory < 0.3 * table_state


# --- a head fused with its cross entropy (issue 29): the loss runs split on the vocabulary in the
# head's step, so no logits are gathered; priced as such and written as vocab_cross_entropy ---

UNFUSED = BIG_TABLE.replace("return nn.functional.cross_entropy(self.head(x).flatten(0, 1), ids.flatten())",
                            "logits = self.head(x)\n"
                            "        return nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten()) + "
                            "logits.mean()")


def _priced(tmp_path, text):
    from nnscaler_cst.analysis import analyze
    from nnscaler_cst.plan.auto import Config
    from nnscaler_cst.plan.cost import load_cluster

    entry = tmp_path / "model.py"
    entry.write_text(text.replace("(2, 2)", "(8, 64)"))
    graph = analyze(entry).graph
    return graph, interlaced.price(graph, Config(tp=2, dp=1, pp=2, micro_batches=2, schedule="interlaced"),
                                   load_cluster("cpu-gloo"))


def test_a_head_only_a_cross_entropy_takes_runs_the_loss_in_its_step_and_moves_no_logits(tmp_path, monkeypatch):
    """The head's logits (8 x 64 x 16384) go only to a cross entropy: the head and the loss are
    one step, priced with the loss's compute over all devices and its token-sized all-reduces
    instead of the logits gathered to the owner and their gradient scattered back (the same model
    priced without the fusion); a head whose logits something else reads (their mean) is not fused."""
    graph, (fused, steps, stages) = _priced(tmp_path, BIG_TABLE)
    assert list(interlaced.fused_losses(graph, ["embed", "head"]).values()) == [[5, 6, 8]]   # head, flatten, loss
    assert interlaced.fused_heads(graph, ["embed", "head"]) == ["head"]
    monkeypatch.setattr(interlaced, "fused_losses", lambda graph, modules: {})
    _, (gathered, gathered_steps, gathered_stages) = _priced(tmp_path, BIG_TABLE)
    assert fused.seconds < 0.5 * gathered.seconds
    assert steps[1].forward[0] < 0.5 * gathered_steps[1].forward[0]           # no logits gathered
    assert stages[1] < gathered_stages[1]                                      # the loss is no longer the owner's
    monkeypatch.undo()
    other, _ = _priced(tmp_path, UNFUSED)
    assert not interlaced.fused_losses(other, ["embed", "head"])


@pytest.mark.slow
def test_a_tied_head_fused_with_its_cross_entropy_trains_like_the_single_device_run(tmp_path):
    """PP 2 (the vocabulary over 2 devices), a tied embedding and head, a cross entropy with an
    ignore_index (one micro-batch: a mean over the tokens it keeps): the written code runs the
    loss as vocab_cross_entropy, and verify passes."""
    model = tmp_path / "model.py"
    model.write_text(BIG_TABLE.replace("16384", "64").replace("(2, 2)", "(2, 8)").replace(
        "ids.flatten())", "ids.flatten().masked_fill(ids.flatten() < 32, -1), ignore_index=-1)"))
    result = subprocess.run([sys.executable, "-m", "nnscaler_cst.cli", "verify", str(model), "--pp", "2",
                             "--micro-batches", "1", "--schedule", "interlaced", "-o", str(tmp_path / "out"), "--json"],
                            capture_output=True, text=True, timeout=600,
                            env={**os.environ, "COLUMNS": "200", "PYTHONWARNINGS": "ignore"})
    start = result.stdout.find("{")
    assert start >= 0, result.stdout + result.stderr
    assert result.returncode == 0 and json.loads(result.stdout[start:])["passed"] is True, result.stdout + result.stderr
    last = (tmp_path / "out" / "model_stage1.py").read_text()
    assert "return vocab_cross_entropy(self.head(x).flatten(0, 1), " in last and "VOCAB_LOSSES = ['head']" in last
