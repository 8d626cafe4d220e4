"""The interlaced pipeline (issue 10, item 1): the embedding and what shares its weight (the LM
head; T5/BART's encoder, decoder and head) split on the vocabulary over all pipeline ranks, the
blocks in 1F1B stages. Every other rank runs its share of a vocabulary op (sEk / sGk) at the
step of the stage that calls it; rules/plans/interlaced.toml states that (`together`), a walk of
one timeline of all ranks places the shares, and the simulator checks the collectives before
anything is written. The gloo runs on a T5-style and a BART-style encoder-decoder are slow.
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
from nnscaler_cst.plan.schedules import Action, load_schedule, placement
from nnscaler_cst.verify.simulate import simulate

REPO = Path(__file__).resolve().parents[1]

ORDER = ('order = ["F[k] < F[k+1]", "B[k] < B[k+1]", "F[k] < B[k]", "F[min(k+W, K-1)] < B[k]", '
         '"B[k] < F[k+W+1]"]')


def orders_of(table, D: int, M: int, owners: list[int]):
    place = placement(table, D)
    return interlaced.orders(table, D, M, place, owners), place


def test_the_table_states_the_split_and_the_shares():
    table = load_schedule("interlaced")
    assert table.vocab == "tied" and table.virtual_stages == 1
    assert table.together == ("E[k] = F[k]", "G[k] = B[k]")


def test_each_share_runs_at_its_owners_step_and_the_order_runs():
    table = load_schedule("interlaced")
    orders, place = orders_of(table, 2, 2, [0, 1])     # GPT at PP=2: embedding on stage 0, head on stage 1
    assert [" ".join(map(str, o)) for o in orders] == ["0F0 0F1 1E0 1G0 0B0 1E1 1G1 0B1",
                                                       "0E0 0E1 1F0 1B0 0G0 1F1 1B1 0G1"]
    events = simulate(orders, 2, placement=place, shared=[0, 1])
    start = {(e.rank, e.action): e.start for e in events}
    for stage, owner, peer in ((0, 0, 1), (1, 1, 0)):
        for m in range(2):
            assert start[(peer, Action("E", stage, m))] == start[(owner, Action("F", stage, m))]
            assert start[(peer, Action("G", stage, m))] == start[(owner, Action("B", stage, m))]


@pytest.mark.parametrize("D, M, owners", [(2, 4, [0, 1]), (4, 4, [0, 3]), (4, 8, [0, 3]), (4, 4, [0])])
def test_every_rank_takes_part_in_every_vocabulary_step(D, M, owners):
    table = load_schedule("interlaced")
    orders, place = orders_of(table, D, M, owners)
    simulate(orders, D, placement=place, shared=owners)
    for rank, order in enumerate(orders):
        own = [a for a in order if a.kind in "FB"]
        assert [a.stage for a in own] == [rank] * 2 * M            # its own 1F1B steps, all kept
        shares = {(a.kind, a.stage, a.micro) for a in order if a.kind in "EG"}
        expected = {(k, s, m) for s in owners if s != rank for k in "EG" for m in range(M)}
        assert shares == expected
        forwards = [a.micro for a in own if a.kind == "F"]
        assert forwards == sorted(forwards)                        # the table's order within the rank


def test_a_broken_table_is_refused_with_the_step_and_the_ranks(tmp_path):
    broken = tmp_path / "broken.toml"
    broken.write_text(f'[schedule]\nname = "broken"\nwarmup = "D - i - 1"\n{ORDER}\nvocab = "tied"\n'
                      'together = ["E[k] = F[M - 1 - k]", "G[k] = B[k]"]\n')
    table = load_schedule(str(broken))
    orders, place = orders_of(table, 2, 2, [0, 1])
    with pytest.raises(UserError) as error:
        simulate(orders, 2, placement=place, shared=[0, 1])
    message = str(error.value)
    assert "deadlocks" in message and "rank 0 at step 0 (0F0) waits for rank 1 to join 0E0" in message
    assert "collective over all ranks" in message


def test_a_table_without_both_shares_is_refused(tmp_path):
    table_file = tmp_path / "half.toml"
    table_file.write_text(f'[schedule]\nname = "half"\nwarmup = "D - i - 1"\n{ORDER}\nvocab = "tied"\n'
                          'together = ["E[k] = F[k]"]\n')
    with pytest.raises(UserError, match="both E"):
        orders_of(load_schedule(str(table_file)), 2, 2, [0, 1])


def test_a_hand_edited_order_missing_or_moving_a_share_is_refused():
    table = load_schedule("interlaced")
    orders, place = orders_of(table, 2, 2, [0, 1])
    swapped = [list(o) for o in orders]
    swapped[1][0], swapped[1][1] = swapped[1][1], swapped[1][0]      # rank 1: 0E1 before 0E0
    with pytest.raises(UserError, match=r"rank 1 at step 0 \(0E1\)"):
        simulate(swapped, 2, placement=place, shared=[0, 1])
    dropped = [list(o) for o in orders]
    dropped[1].remove(Action("G", 0, 1))
    with pytest.raises(UserError, match="never runs it"):
        simulate(dropped, 2, placement=place, shared=[0, 1])
    own = [list(o) for o in orders]
    own[0].insert(0, Action("E", 0, 0))                              # a share of its own stage
    with pytest.raises(UserError, match="is its own"):
        simulate(own, 2, placement=place, shared=[0, 1])


def test_the_tied_embedding_and_head_of_gpt_are_split_over_every_stage():
    from nnscaler_cst.analysis import analyze
    from nnscaler_cst.plan.pipeline import plan_stages

    table = load_schedule("interlaced")
    analysis = analyze(REPO / "fixtures" / "gpt.py")
    stages = plan_stages(analysis.graph, 2, 1, None, placement(table, 2))
    assert stages.tied and "lm_head" in stages.drop[0]            # 1F1B: the head on the last stage only
    interlaced.apply(analysis.graph, stages, table)
    assert stages.vocab_modules == ["lm_head", "transformer.wte"]
    assert stages.vocab_params == ["lm_head.weight", "transformer.wte.weight"]
    assert stages.vocab_stages == [0, 1] and stages.vocab_calls == {0: 1, 1: 1}
    assert not stages.tied                                         # one share per rank: nothing summed across stages
    assert all(m not in stages.drop[s] for s in (0, 1) for m in stages.vocab_modules)
    every, _ = interlaced.vocab_modules(analysis.graph, stages.trunk.blocks, 2, "all", table.location)
    assert "transformer.wpe" in every                              # "all": the position embedding too
    with pytest.raises(UserError, match="not divisible by the 3"):
        interlaced.vocab_modules(analysis.graph, stages.trunk.blocks, 3, "tied", table.location)


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
    shards = [line for line in (tmp_path / "out" / "__init__.py").read_text().splitlines()
              if line.startswith("PP_VOCAB_SPLITS")]
    assert shards and "lm_head.weight" in shards[0]
