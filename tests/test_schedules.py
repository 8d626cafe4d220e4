"""Pipeline schedules (issue 5): the orders the schedule tables give, checked against the
textbook definitions written out by hand here, and the simulator that refuses orders that
would hang.

- 1F1B (PipeDream-flush / Megatron): rank i of D runs w = min(D - i - 1, M) warm-up forwards,
  then alternates one forward and one backward, then runs the remaining backwards.
- GPipe: every forward, then every backward, each in micro-batch order.
- Interleaved 1F1B with V virtual stages per rank: stage s lives on rank s % D; every stage
  runs every micro-batch forward and backward once; the bubble shrinks by V.
- Bubble of a flush schedule with equal stage times: (D - 1) / (D - 1 + M) of the time.

The deadlock tests hand the simulator orders (and the tool schedule tables) that would hang on
real processes, and expect a refusal that names the ranks and steps that wait.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from nnscaler_cst.errors import UserError
from nnscaler_cst.plan.schedules import Action, load_schedule, schedule, to_csv
from nnscaler_cst.verify.simulate import bubble_fraction, simulate

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 300
TOKEN = re.compile(r"^(\d+)([FB])(\d+)$")


def F(stage: int, micro: int) -> Action:
    return Action("F", stage, micro)


def B(stage: int, micro: int) -> Action:
    return Action("B", stage, micro)


def textbook_1f1b(rank: int, ranks: int, micro: int) -> list[Action]:
    """The 1F1B order of one rank, from its definition: warm-up, steady 1F1B, cool-down."""
    warmup = min(ranks - rank - 1, micro)
    order = [F(rank, m) for m in range(warmup)]                   # warm-up forwards
    for j in range(micro - warmup):                                # steady state: one F, one B
        order += [F(rank, warmup + j), B(rank, j)]
    order += [B(rank, m) for m in range(micro - warmup, micro)]    # cool-down backwards
    return order


def textbook_gpipe(rank: int, ranks: int, micro: int) -> list[Action]:
    return [F(rank, m) for m in range(micro)] + [B(rank, m) for m in range(micro)]


def run_cli(*args, cwd: Path = REPO) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200", "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "nnscaler_cst.cli", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S)


# --------------------------------------------------------------------------------------------
# The orders the tables give
# --------------------------------------------------------------------------------------------

def test_the_hand_written_1f1b_is_the_textbook_one():
    """Guard the oracle itself on a case small enough to read: D = 4, M = 4, rank 0 and 3."""
    assert " ".join(map(str, textbook_1f1b(0, 4, 4))) == "0F0 0F1 0F2 0F3 0B0 0B1 0B2 0B3"
    assert " ".join(map(str, textbook_1f1b(1, 4, 4))) == "1F0 1F1 1F2 1B0 1F3 1B1 1B2 1B3"
    assert " ".join(map(str, textbook_1f1b(3, 4, 4))) == "3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3"


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("micro", [4, 8])
def test_1f1b_table_gives_the_textbook_order(ranks, micro):
    orders = schedule(load_schedule("1f1b"), ranks, micro)
    assert len(orders) == ranks
    for rank in range(ranks):
        assert orders[rank] == textbook_1f1b(rank, ranks, micro), f"rank {rank}"


def test_1f1b_with_fewer_micro_batches_than_warm_up_forwards_is_the_textbook_order():
    """min(D - i - 1, M): with D = 8, M = 4 ranks 0..3 warm up with every micro-batch (GPipe)."""
    orders = schedule(load_schedule("1f1b"), 8, 4)
    assert [" ".join(map(str, o)) for o in orders] == \
        [" ".join(map(str, textbook_1f1b(r, 8, 4))) for r in range(8)]


def test_interleaved_with_as_many_micro_batches_as_ranks_does_not_deadlock():
    """Megatron-LM: with M == D every forward is warm-up, then every backward; no rank can
    start with a backward (an out-of-range constraint once vanished and rank 1 began with 5B0)."""
    orders = schedule(load_schedule("interleaved"), 4, 4)
    for rank, order in enumerate(orders):
        kinds = "".join(a.kind for a in order)
        assert kinds == "F" * 8 + "B" * 8, (rank, " ".join(map(str, order)))
    simulate(orders, 8)


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("micro", [4, 8])
def test_gpipe_table_gives_all_forwards_then_all_backwards(ranks, micro):
    orders = schedule(load_schedule("gpipe"), ranks, micro)
    assert orders == [textbook_gpipe(r, ranks, micro) for r in range(ranks)]


@pytest.mark.parametrize("ranks, micro", [(2, 4), (2, 8), (4, 8)])
def test_interleaved_runs_every_virtual_stage_once_per_micro_batch_on_its_own_rank(ranks, micro):
    table = load_schedule("interleaved")
    virtual = table.virtual_stages
    assert virtual == 2
    stages = ranks * virtual
    orders = schedule(table, ranks, micro)
    assert len(orders) == ranks
    for rank, order in enumerate(orders):
        assert all(a.stage % ranks == rank for a in order), (rank, order)
        for kind in "FB":
            runs = sorted((a.stage, a.micro) for a in order if a.kind == kind)
            mine = [s for s in range(stages) if s % ranks == rank]
            assert runs == [(s, m) for s in mine for m in range(micro)], (rank, kind)
        # a stage's backward of a micro-batch comes after its own forward of it
        position = {a: k for k, a in enumerate(order)}
        assert all(position[F(a.stage, a.micro)] < position[a] for a in order if a.kind == "B")
        # not GPipe in disguise: the first backward comes before the last forward
        kinds = [a.kind for a in order]
        assert kinds.index("B") < len(kinds) - 1 - kinds[::-1].index("F")
    simulate(orders, stages)


def test_interleaved_needs_micro_batches_in_multiples_of_the_ranks():
    with pytest.raises(UserError, match=r"multiple of the pipeline ranks"):
        schedule(load_schedule("interleaved"), 4, 6)


# --------------------------------------------------------------------------------------------
# The simulator
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
@pytest.mark.parametrize("ranks, micro", [(2, 4), (4, 8), (4, 4), (3, 5)])
def test_bubble_of_a_flush_schedule_with_equal_stages_is_the_textbook_fraction(name, ranks, micro):
    """All ranks are idle (D - 1) forward+backward slots out of (M + D - 1): (D-1)/(D-1+M)."""
    events = simulate(schedule(load_schedule(name), ranks, micro), ranks)
    assert len(events) == 2 * ranks * micro
    assert bubble_fraction(events, ranks) == pytest.approx((ranks - 1) / (ranks - 1 + micro), abs=1e-9)


@pytest.mark.parametrize("ranks, micro", [(2, 4), (4, 8)])
def test_interleaving_divides_the_bubble_by_the_virtual_stages(ranks, micro):
    """Megatron-LM (Narayanan et al. 2021): with V chunks per rank, each 1/V of the work, the
    bubble lasts (D - 1)/V of a micro-batch's forward+backward instead of D - 1."""
    table = load_schedule("interleaved")
    v = table.virtual_stages
    events = simulate(schedule(table, ranks, micro), ranks * v, forward_seconds=[1.0 / v] * (ranks * v))
    bubble = (ranks - 1) / v
    assert bubble_fraction(events, ranks) == pytest.approx(bubble / (bubble + micro), abs=1e-9)
    assert bubble_fraction(events, ranks) < (ranks - 1) / (ranks - 1 + micro)


def test_simulator_timeline_follows_the_dependencies():
    """Stage s+1 starts micro-batch m's forward after stage s ends it; its backward before."""
    ranks, micro = 4, 8
    events = {e.action: e for e in simulate(schedule(load_schedule("1f1b"), ranks, micro), ranks)}
    for (kind, s, m) in [(k, s, m) for k in "FB" for s in range(ranks) for m in range(micro)]:
        e = events[Action(kind, s, m)]
        if kind == "F" and s > 0:
            assert e.start >= events[F(s - 1, m)].end
        if kind == "B":
            assert e.start >= events[F(s, m)].end
            if s < ranks - 1:
                assert e.start >= events[B(s + 1, m)].end


def test_simulator_refuses_a_cross_rank_deadlock_naming_ranks_and_steps():
    """Rank 1 does micro-batch 1 first; rank 0 needs rank 1's backward of micro-batch 0 first."""
    orders = [[F(0, 0), B(0, 0), F(0, 1), B(0, 1)],
              [F(1, 1), B(1, 1), F(1, 0), B(1, 0)]]
    with pytest.raises(UserError) as info:
        simulate(orders, 2)
    message = info.value.message
    assert "deadlock" in message
    assert re.search(r"rank 0 at step 1 \(0B0\) waits for 1B0 from rank 1", message), message
    assert re.search(r"rank 1 at step 0 \(1F1\) waits for 0F1 from rank 0", message), message


def test_simulator_refuses_a_backward_before_its_own_forward():
    orders = [[F(0, 0), B(0, 0)], [B(1, 0), F(1, 0)]]
    with pytest.raises(UserError, match=r"rank 1 at step 0 \(1B0\) waits for 1F0 from itself"):
        simulate(orders, 2)


def test_simulator_refuses_a_receive_nobody_sends():
    """Rank 1 expects micro-batch 2, which rank 0 never runs."""
    orders = [[F(0, 0), B(0, 0)], [F(1, 0), B(1, 0), F(1, 2), B(1, 2)]]
    with pytest.raises(UserError, match=r"rank 1 at step 2 \(1F2\) waits for 0F2 from rank 0, which never runs it"):
        simulate(orders, 2)


def test_simulator_refuses_an_action_on_the_wrong_rank_and_a_repeated_action():
    with pytest.raises(UserError, match=r"rank 0 step 1 runs 1F0"):
        simulate([[F(0, 0), F(1, 0), B(0, 0)], [F(1, 0), B(1, 0)]], 2)
    with pytest.raises(UserError, match=r"rank 0 runs 0F0 twice \(step 1\)"):
        simulate([[F(0, 0), F(0, 0), B(0, 0)], [F(1, 0), B(1, 0)]], 2)


# --------------------------------------------------------------------------------------------
# CSV in torch.distributed.pipelining's action grammar
# --------------------------------------------------------------------------------------------

def test_to_csv_writes_one_row_per_rank_in_the_action_grammar():
    orders = schedule(load_schedule("1f1b"), 2, 2)
    assert to_csv(orders) == "0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n"


@pytest.mark.slow
def test_schedule_command_prints_the_csv_of_the_textbook_1f1b():
    result = run_cli("schedule", "fixtures/gpt.py", "--pp", 4, "--micro-batches", 8, "--csv")
    assert result.returncode == 0, result.stderr
    rows = result.stdout.strip().splitlines()
    assert len(rows) == 4
    for rank, row in enumerate(rows):
        tokens = row.split(",")
        matches = [TOKEN.match(t) for t in tokens]
        assert all(matches), row
        parsed = [Action(m.group(2), int(m.group(1)), int(m.group(3))) for m in matches]
        assert parsed == textbook_1f1b(rank, 4, 8)


# --------------------------------------------------------------------------------------------
# A broken schedule table: refused before anything is written
# --------------------------------------------------------------------------------------------

# Rank 0 runs B[k] before F[k+1] (no warm-up); the last rank runs F[k+1] before B[k]. Rank 0's
# F1 waits for its B0, which waits for the last rank's B0, which waits for its F1, which waits
# for rank 0's F1: a cycle. Each rank's constraints alone are satisfiable.
DEADLOCK_TABLE = """\
[schedule]
name = "deadlock"
description = "deliberately hangs"
virtual_stages = 1
order = ["F[k] < F[k+1]", "B[k] < B[k+1]", "F[k] < B[k]",
         "B[k] < F[k+1] when i == 0", "F[k+1] < B[k] when i == D-1"]
"""

# F[k] < B[k] and B[k] < F[k] on rank 0: no order satisfies both.
CONTRADICTION_TABLE = """\
[schedule]
name = "contradiction"
virtual_stages = 1
order = ["F[k] < F[k+1]", "B[k] < B[k+1]", "F[k] < B[k]",
         "B[k] < F[k] when i == 0"]
"""


@pytest.fixture(scope="module")
def broken_rules_checkout(tmp_path_factory) -> Path:
    """A copy of the tool with two more schedule tables in its built-in rules: the test runs
    `python -m nnscaler_cst.cli` from a copy of the package next to a copy of rules/ (a user
    would rather name a folder of their own in NNSCALER_RULES_PATH)."""
    root = tmp_path_factory.mktemp("checkout")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(REPO / "nnscaler_cst", root / "nnscaler_cst", ignore=ignore)
    shutil.copytree(REPO / "rules", root / "rules", ignore=ignore)
    shutil.copytree(REPO / "fixtures", root / "fixtures", ignore=ignore)
    (root / "rules" / "plans" / "deadlock.toml").write_text(DEADLOCK_TABLE)
    (root / "rules" / "plans" / "contradiction.toml").write_text(CONTRADICTION_TABLE)
    where = subprocess.run(
        [sys.executable, "-c", "import nnscaler_cst.graph.oprules as o; print(o.RULES_DIR)"],
        cwd=root, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert Path(where.stdout.strip()) == root / "rules", where.stdout + where.stderr
    return root


@pytest.fixture(scope="module")
def broken_runs(broken_rules_checkout):
    root = broken_rules_checkout
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(run_cli, "fixtures/gpt.py", "--pp", 2, "--micro-batches", 4,
                                     "--schedule", name, "-o", f"out_{name}", cwd=root)
                   for name in ("deadlock", "contradiction")}
        return {name: f.result() for name, f in futures.items()}


@pytest.mark.slow
def test_the_deadlock_table_alone_is_satisfiable_per_rank_and_deadlocks_in_the_simulator(
        broken_rules_checkout, monkeypatch):
    monkeypatch.setenv("NNSCALER_RULES_PATH", str(broken_rules_checkout / "rules"))
    orders = schedule(load_schedule("deadlock"), 2, 4)
    assert orders[0] == [F(0, 0), B(0, 0), F(0, 1), B(0, 1), F(0, 2), B(0, 2), F(0, 3), B(0, 3)]
    assert orders[1][:2] == [F(1, 0), F(1, 1)]
    with pytest.raises(UserError, match="deadlock"):
        simulate(orders, 2)


@pytest.mark.slow
def test_rewrite_refuses_a_deadlocking_schedule_table_with_exit_2(broken_runs, broken_rules_checkout):
    result = broken_runs["deadlock"]
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    error = result.stderr
    assert "error: the pipeline schedule deadlocks" in error, error
    assert re.search(r"rank 0 at step 1 \(0B0\) waits for 1B0 from rank 1", error), error
    assert re.search(r"rank 1 at step 1 \(1F1\) waits for 0F1 from rank 0", error), error
    assert not (broken_rules_checkout / "out_deadlock").exists(), "a refused rewrite wrote output"


@pytest.mark.slow
def test_rewrite_refuses_a_contradictory_schedule_table_naming_the_table(broken_runs, broken_rules_checkout):
    result = broken_runs["contradiction"]
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    first = result.stderr.strip().splitlines()[0]
    assert re.match(r"^\S*rules/plans/contradiction\.toml:\d+:\d+: error: .*contradict.* on rank 0", first), first
    assert not (broken_rules_checkout / "out_contradiction").exists()
