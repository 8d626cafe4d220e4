"""Chimera (issue 10, item 3): two pipelines in opposite directions over the same D ranks, each
rank holding one stage of each (model stages i and D - 1 - i), the replicas' gradients summed.

The schedule is a table, rules/plans/chimera.toml: op-assign (`pipelines = 2`, `stage_rank`)
and op-order constraints that z3 orders; the simulator checks every order before anything is
written. The gloo runs are marked slow.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nnscaler_cst.errors import UserError
from nnscaler_cst.plan.schedules import load_schedule, placement, schedule
from nnscaler_cst.verify.simulate import bubble_fraction, simulate

REPO = Path(__file__).resolve().parents[1]
GPT = REPO / "fixtures" / "gpt.py"


def cli(*args, cwd: Path = REPO) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200", "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "nnscaler_cst.cli", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=900)


def simulated_bubble(name: str, D: int, M: int) -> float:
    table = load_schedule(name)
    place = placement(table, D)
    orders = schedule(table, D, M)
    return bubble_fraction(simulate(orders, len(place.ranks), placement=place), D)


def test_each_rank_holds_a_stage_of_each_pipeline_and_replicas_pair_up():
    table = load_schedule("chimera")
    four = placement(table, 4)
    assert four.ranks == (0, 1, 2, 3, 3, 2, 1, 0) and four.length == 4
    assert [four.stages_of(r) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert four.replica_groups() == [[0, 3], [1, 2]]          # rank i and D - 1 - i hold the same model stages
    assert placement(table, 2).replica_groups() == [[0, 1]]
    one_f1b = load_schedule("1f1b")
    assert placement(one_f1b, 4).replica_groups() == [[0], [1], [2], [3]]   # nothing replicated


def test_the_table_orders_each_rank_and_the_order_runs():
    orders = schedule(load_schedule("chimera"), 4, 4)
    assert [" ".join(map(str, order)) for order in orders] == [
        "0F0 0F2 7F1 7B1 7F3 7B3 0B0 0B2",        # rank 0: down stage 0 (even micro-batches), up stage 3 (odd)
        "1F0 6F1 1F2 6F3 6B1 1B0 6B3 1B2",
        "5F1 2F0 5F3 2F2 2B0 5B1 2B2 5B3",
        "4F1 4F3 3F0 3B0 3F2 3B2 4B1 4B3",
    ]


@pytest.mark.parametrize("D, M", [(2, 4), (4, 4), (4, 8), (6, 6)])
def test_the_simulated_bubble_is_below_1f1b_and_near_the_formula(D, M):
    """Simulated with F = 1, B = 2: (D - 2)/(D - 2 + 2M) holds exactly at D = 2 (no bubble) and
    the bubble stays below 1F1B's; the formula counts forwards and backwards alike, so with
    B = 2F it is reached only at D = 2."""
    chimera, one_f1b = simulated_bubble("chimera", D, M), simulated_bubble("1f1b", D, M)
    formula = (D - 2) / (D - 2 + 2 * M)
    assert chimera < one_f1b
    assert formula - 1e-9 <= chimera <= formula + 0.1
    if D == 2:
        assert chimera == 0.0


def test_micro_batches_must_pair_up_over_the_two_pipelines():
    with pytest.raises(UserError, match=r"multiple of its 2 pipelines"):
        schedule(load_schedule("chimera"), 4, 3)


def test_a_broken_table_is_refused_with_the_steps_and_ranks(tmp_path):
    """Rank 0 puts its down backwards before its up forwards, rank 1 its up backwards before its
    down forwards: each waits for the other."""
    text = (REPO / "rules" / "plans" / "chimera.toml").read_text()
    broken = tmp_path / "broken.toml"
    start = text.index("order = [")
    broken.write_text(text[:start] + 'order = ["F[k] < F[k+2]", "B[k] < B[k+2]", "F[k] < B[k]", '
                      '"B[k] < F[j] when k % 2 == i % 2 and j % 2 != i % 2"]\n')
    table = load_schedule(str(broken))
    place = placement(table, 2)
    with pytest.raises(UserError, match=r"deadlocks: rank 0 at step \d+ \(0B0\) waits for 1B0 from rank 1") as info:
        simulate(schedule(table, 2, 4), 4, placement=place)
    assert "rank 1 at step" in str(info.value)


def test_a_stage_placement_that_leaves_a_rank_without_its_stages_is_refused(tmp_path):
    text = (REPO / "rules" / "plans" / "chimera.toml").read_text()
    broken = tmp_path / "lopsided.toml"
    broken.write_text(text.replace('stage_rank = "v if v < D else 2 * D - 1 - v"', 'stage_rank = "v % 2"'))
    with pytest.raises(UserError, match=r"stage_rank gives rank 0 the stages \[0, 2, 4, 6\], not 2") as info:
        placement(load_schedule(str(broken)), 4)
    assert str(info.value.location.path).endswith("lopsided.toml")


# ---- the rewrite, and proven on gloo --------------------------------------------------------------
@pytest.mark.slow
def test_schedule_command_shows_each_rank_and_the_formula():
    result = cli("schedule", GPT, "--pp", "4", "--schedule", "chimera", "--micro-batches", "4")
    assert result.returncode == 0, result.stderr
    assert "rank 0: 0F0 0F2 7F1 7B1 7F3 7B3 0B0 0B2" in result.stdout
    assert "stage 4: blocks 0-0" in result.stdout and "stage 7: blocks 3-3" in result.stdout
    assert "chimera formula (D - 2)/(D - 2 + 2 * M) = 20.0%" in " ".join(result.stdout.split())


@pytest.mark.slow
@pytest.mark.parametrize("pp", [2, 4])
def test_chimera_trains_like_the_single_device_run(tmp_path, pp):
    out = tmp_path / "out"
    result = cli("verify", GPT, "--pp", pp, "--schedule", "chimera", "--micro-batches", 4, "-o", out, "--json")
    outcome = json.loads(result.stdout[result.stdout.find("{"):])
    assert result.returncode == 0 and outcome["passed"] is True, (outcome, result.stderr[-3000:])
    rank0 = (out / f"model_stages0_{2 * pp - 1}.py").read_text()
    assert f"PIPELINE_STAGES = [0, {2 * pp - 1}]" in rank0
    assert f"PIPELINE_REPLICAS = {[[r, pp - 1 - r] for r in range(pp // 2)]}" in rank0
    plan = json.loads((out / "plan.json").read_text())
    # every op runs once per pipeline: stage s of the first, and its replica s + D of the second
    pieces = {}
    for a in plan["op_assign"]:
        if a["axis"] == "pp":
            pieces.setdefault(a["site"], set()).add(a["piece"])
    assert pieces and all(p == {s for m in p if m < pp for s in (m, m + pp)} for p in pieces.values()), pieces
