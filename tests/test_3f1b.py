"""3F1B (generally NF1B; issue 10, item 2): a trunk run N times per micro-batch (AlphaFold2's
recycling), the first N-1 passes without gradient, pipelined by the table rules/plans/3f1b.toml
so the no-grad passes of later micro-batches fill the bubbles of earlier ones.

- The table's order, checked against the paper's constraints written out here: for every rank,
  f_c(m+1) before f_{c+1}(m) (f1(m+2) < f2(m+1) < f3(m) for N = 3), f_N(m + ofst) before b(m),
  b(m) before the next diagonal, ofst = D - i - 1.
- The simulator: pass c > 0 of a micro-batch waits on the first stage for pass c - 1 from the
  last stage; a table that breaks this is refused naming the steps and ranks that wait.
- Slow: the rewrite of fixtures/evoformer.py (PP = 2, 3 recycles) passes verify on gloo.
- Slow: with triangle attention and an extra-MSA stack run before the trunk in every pass, the
  stack is priced and cut on the first stage, and TP = 2 x PP = 2 passes verify on gloo.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from nnscaler_cst.errors import UserError
from nnscaler_cst.plan.schedules import Action, load_schedule, parse_action, placement, schedule, to_csv
from nnscaler_cst.verify.simulate import bubble_fraction, simulate

REPO = Path(__file__).resolve().parents[1]


def _orders(ranks, micro, passes):
    table = load_schedule("3f1b")
    orders = schedule(table, ranks, micro, passes)
    return table, orders


def _position(order):
    """(pass 1..N or "B", micro) -> step index; the forward with gradient is pass N."""
    passes = 1 + max((a.cycle + 1 for a in order if a.cycle is not None), default=0)
    return {(("B" if a.kind == "B" else (a.cycle + 1 if a.cycle is not None else passes)), a.micro): n
            for n, a in enumerate(order)}, passes


def test_3f1b_at_two_ranks_four_micro_batches_is_the_diagonal_order_written_out():
    """Rank 0 (W = 1) and rank 1 (W = 0) of D = 2, M = 4, N = 3, by hand: forwards in diagonals
    m + c (lower passes, later micro-batches, first), a backward after the diagonal ending with
    f3(m + W)."""
    _, orders = _orders(2, 4, 3)
    assert " ".join(map(str, orders[0])) == ("0F0r0 0F1r0 0F0r1 0F2r0 0F1r1 0F0 0F3r0 0F2r1 0F1 0B0 "
                                             "0F3r1 0F2 0B1 0F3 0B2 0B3")
    assert " ".join(map(str, orders[1])) == ("1F0r0 1F1r0 1F0r1 1F2r0 1F1r1 1F0 1B0 1F3r0 1F2r1 1F1 1B1 "
                                             "1F3r1 1F2 1B2 1F3 1B3")


@pytest.mark.parametrize("ranks, micro, passes", [(2, 2, 3), (2, 4, 3), (2, 8, 3), (4, 4, 3), (4, 8, 3),
                                                  (2, 4, 2), (3, 6, 4), (4, 8, 5)])
def test_3f1b_order_holds_the_papers_constraints_and_does_not_deadlock(ranks, micro, passes):
    table, orders = _orders(ranks, micro, passes)
    for rank, order in enumerate(orders):
        assert len(order) == micro * (passes + 1) and len(set(order)) == len(order)
        at, _ = _position(order)
        W = ranks - rank - 1
        for m in range(micro):
            for c in range(1, passes):
                assert at[(c, m)] < at[(c + 1, m)]                         # passes of one micro-batch in order
                if m + 1 < micro:
                    assert at[(c, m + 1)] < at[(c + 1, m)]                 # f1(m+2) < f2(m+1) < f3(m)
            assert at[(passes, min(m + W, micro - 1))] < at[("B", m)]      # f3(m + ofst) < b(m)
            for c in range(1, passes + 1):                                 # b(m) < the next diagonal
                if m + W + 1 + passes - c < micro:
                    assert at[("B", m)] < at[(c, m + W + 1 + passes - c)]
    events = simulate(orders, ranks, placement=placement(table, ranks), passes=passes)
    assert len(events) == ranks * micro * (passes + 1)


def test_3f1b_fills_the_bubbles_better_than_running_the_passes_one_micro_batch_after_another():
    """Simulated with B = 2F: the diagonal order against the same passes run without overlap
    (each micro-batch's no-grad passes, then 1F1B on the last pass), D = 2 and 4, M = 8, N = 3."""
    table = load_schedule("3f1b")
    for ranks in (2, 4):
        orders = schedule(table, ranks, 8, 3)
        ours = bubble_fraction(simulate(orders, ranks, placement=placement(table, ranks), passes=3), ranks)
        plain = []
        for rank, order in enumerate(orders):
            grad = [a for a in order if a.cycle is None]
            plain.append([Action("F", rank, m, c) for m in range(8) for c in range(2)] + grad)
        serial = bubble_fraction(simulate(plain, ranks, placement=placement(table, ranks), passes=3), ranks)
        assert ours < serial


def test_one_pass_is_1f1b():
    _, orders = _orders(4, 8, 1)
    one = schedule(load_schedule("1f1b"), 4, 8)
    assert orders == one


def test_a_schedule_without_recycling_refuses_several_passes():
    with pytest.raises(UserError, match="runs its trunk 3 times"):
        schedule(load_schedule("1f1b"), 2, 4, 3)


def test_actions_with_a_pass_read_back_and_go_to_csv():
    assert parse_action("0F2r1") == Action("F", 0, 2, 1)
    assert parse_action("1B3") == Action("B", 1, 3)
    assert str(Action("F", 1, 0, 0)) == "1F0r0"
    assert to_csv([[Action("F", 0, 0, 0), Action("F", 0, 0)]]) == "0F0r0,0F0\n"
    with pytest.raises(UserError, match="cannot read the pipeline action"):
        parse_action("0X1")


BROKEN = """[schedule]
name = "broken-3f1b"
recycling = true
warmup = "D - i - 1"
order = [
  "F{c}[k] < F{c+1}[k]", "B[k] < B[k+1]", "F[k] < B[k]", "F[min(k+W, K-1)] < B[k]",
  # rank 0 runs the next pass of micro-batch 0 before micro-batch 1's first; the last rank
  # takes micro-batch 1's first pass before micro-batch 0's
  "F{c}[k] < F{c}[k+1] when i < D - 1", "F{c}[k+1] < F{c}[k] when i == D - 1",
  "F{c+1}[k] < F{c}[k+1] when i == 0",
]
"""


def test_a_broken_3f1b_table_is_refused_by_the_simulator_naming_steps_and_ranks(tmp_path):
    """Rank 0 waits at 0F0r1 for rank 1's recycled 1F0r0, which rank 1 runs after 1F1r0, which
    waits for rank 0's 0F1r0, which rank 0 runs only after 0F0r1: a hang on real processes."""
    path = tmp_path / "broken.toml"
    path.write_text(BROKEN)
    table = load_schedule(str(path))
    orders = schedule(table, 2, 2, 3)         # each rank's constraints alone are satisfiable
    assert str(orders[0][1]) == "0F0r1" and str(orders[1][0]) == "1F1r0"
    with pytest.raises(UserError) as refused:
        simulate(orders, 2, placement=placement(table, 2), passes=3)
    message = str(refused.value)
    assert "deadlocks" in message
    assert "rank 0 at step 1 (0F0r1) waits for 1F0r0 from rank 1" in message
    assert "rank 1 at step 0 (1F1r0) waits for 0F1r0 from rank 0" in message


# A trunk that is a submodule's forward (`self.stack(...)`), run twice by a recycling loop that
# carries one value: the mechanism does not depend on the fixture's names.
RECYCLER = """import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, h):
        return h + torch.tanh(self.fc(self.norm(h)))


class Stack(nn.Module):
    def __init__(self, width, depth):
        super().__init__()
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))

    def forward(self, h):
        for layer in self.layers:
            h = layer(h)
        return h


class Recycler(nn.Module):
    def __init__(self, width=16, depth=4, passes=2):
        super().__init__()
        self.passes = passes
        self.inp = nn.Linear(8, width)
        self.stack = Stack(width, depth)
        self.back = nn.Linear(width, width)
        self.head = nn.Linear(width, 1)
        self.post = nn.Linear(width, width)

    def forward(self, x, y):
        h0 = self.inp(x)
        carry = torch.zeros_like(h0)
        for i in range(self.passes):
            with torch.set_grad_enabled(i == self.passes - 1):
                h = self.stack(h0 + self.back(carry))
            carry = self.post(h).detach()     # after the trunk's call: on the last stage
        return F.mse_loss(self.head(h), y)


def build():
    torch.manual_seed(0)
    return Recycler()


def example_inputs():
    return {"x": torch.randn(4, 8), "y": torch.randn(4, 1)}
"""

TWICE_WITHOUT_A_LOOP = RECYCLER.replace("""        for i in range(self.passes):
            with torch.set_grad_enabled(i == self.passes - 1):
                h = self.stack(h0 + self.back(carry))
            carry = self.post(h).detach()     # after the trunk's call: on the last stage
""", """        h = self.stack(self.stack(h0))
""")


def _analyze(tmp_path, text):
    from nnscaler_cst.analysis import analyze
    (tmp_path / "recycler.py").write_text(text)
    return analyze(tmp_path / "recycler.py")


def test_the_recycling_loop_around_a_submodule_trunk_is_found_with_its_carried_value(tmp_path):
    from nnscaler_cst.plan.pipeline import plan_stages
    plan = plan_stages(_analyze(tmp_path, RECYCLER).graph, 2, recycling=True)
    recycle = plan.trunk.recycle
    assert recycle.passes == 2 and recycle.carried == ["carry"]
    assert recycle.loop.line == RECYCLER.splitlines().index("        for i in range(self.passes):") + 1
    assert plan.block_ranges == [(0, 2), (2, 4)]
    # the loop's code after the trunk's call runs on the last stage only, before it on the first
    assert "post" in plan.drop[0] and "post" not in plan.drop[1] and not plan.tied
    assert plan.shadow[1] == ["back", "inp"]


def test_a_trunk_run_twice_without_a_loop_is_refused_for_3f1b(tmp_path):
    from nnscaler_cst.plan.pipeline import plan_stages
    graph = _analyze(tmp_path, TWICE_WITHOUT_A_LOOP).graph
    with pytest.raises(UserError, match="run 2 times in one forward, and no `for` loop calls it"):
        plan_stages(graph, 2, recycling=True)
    with pytest.raises(UserError, match="run 2 times in one forward") as refused:
        plan_stages(graph, 2)                  # 1F1B: refused, pointing at 3F1B
    assert "--schedule 3f1b" in refused.value.hint


def test_the_rewrite_runs_one_pass_per_action_and_is_deterministic(tmp_path):
    """The recycling loop of the rank files: its iterable wrapped in pp_passes, the carried value
    taken from the last stage at the top of the body and handed back at its end; the passes in
    PIPELINE_PASSES and SCHEDULE; the same bytes on a second run."""
    from nnscaler_cst.rewrite import PlanRequest, rewrite
    analysis = _analyze(tmp_path, RECYCLER)
    request = PlanRequest(pp=2, schedule="3f1b", micro_batches=2)
    files = rewrite(analysis, request).files
    stage0, stage1 = files["model_stage0.py"], files["model_stage1.py"]
    assert "        for i in pp_passes(range(self.passes)):  # pipeline (3F1B)" in stage0
    assert "            carry = pp_recycled(carry)  # pipeline: the first stage starts a later pass" in stage0
    assert "            pp_recycle(carry)  # pipeline: the last stage hands these to the first stage" in stage0
    assert "PIPELINE_PASSES = 2" in stage0 and 'SCHEDULE = "0F0r0 0F1r0 0F0 0F1 0B0 0B1"' in stage0
    assert 'SCHEDULE = "1F0r0 1F1r0 1F0 1B0 1F1 1B1"' in stage1
    assert "SFMrC = its pass C of the recycling loop" in stage0
    assert files["schedule.csv"] == "0F0r0,0F1r0,0F0,0F1,0B0,0B1\n1F0r0,1F1r0,1F0,1B0,1F1,1B1\n"
    assert rewrite(analysis, request).files == files


def _cli(*args, cwd=REPO):
    env = {**os.environ, "COLUMNS": "200", "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "nnscaler_cst.cli", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_3f1b_rewrite_of_the_evoformer_is_per_rank_code_and_passes_verify_on_gloo(tmp_path):
    """fixtures/evoformer.py (3 recycles) at PP = 2, 2 micro-batches (its batch is 2): the
    recycling loop runs one pass per action, the last stage hands the recycled values back, and
    the run matches the single device."""
    out = tmp_path / "out"
    result = _cli("fixtures/evoformer.py", "--pp", "2", "--schedule", "3f1b", "--micro-batches", "2", "-o", out)
    assert result.returncode == 0, result.stderr
    stage0 = (out / "model_stage0.py").read_text()
    assert "for cycle in pp_passes(range(self.recycles)):" in stage0
    assert "prev_m, prev_z = pp_recycled(prev_m, prev_z)" in stage0
    assert "pp_recycle(prev_m, prev_z)" in stage0 and "PIPELINE_PASSES = 3" in stage0
    assert 'SCHEDULE = "0F0r0 0F1r0 0F0r1 0F1r1 0F0 0F1 0B0 0B1"' in stage0
    assert "except _comm.RecycleBoundary" in (out / "__init__.py").read_text()
    result = _cli("verify", "fixtures/evoformer.py", "--pp", "2", "--schedule", "3f1b", "--micro-batches", "2")
    assert result.returncode == 0 and "PASSED" in result.stdout, result.stdout + result.stderr


@pytest.mark.slow
def test_3f1b_on_four_stages_with_middle_stages_passes_verify_on_gloo(tmp_path):
    """The evoformer with 4 blocks and a batch of 4, at PP = 4 and 4 micro-batches: middle stages
    receive and hand on every pass, the last hands back to the first."""
    text = (REPO / "fixtures" / "evoformer.py").read_text()
    text = text.replace("    return Evoformer()\n", "    return Evoformer(blocks=4)\n")
    text = text.replace("(2, 4, 8)", "(4, 4, 8)").replace("(2, 8, 8)", "(4, 8, 8)")
    (tmp_path / "evoformer4.py").write_text(text)
    result = _cli("verify", tmp_path / "evoformer4.py", "--pp", "4", "--schedule", "3f1b", "--micro-batches", "4")
    assert result.returncode == 0 and "PASSED" in result.stdout, result.stdout + result.stderr
    assert "4 gloo processes" in result.stdout


def _full_evoformer(tmp_path, batch: int = 2) -> Path:
    """fixtures/evoformer.py with triangle attention and an extra-MSA stack of 2 blocks before its 4
    Evoformer blocks in every cycle, `batch` proteins."""
    text = (REPO / "fixtures" / "evoformer.py").read_text()
    text = text.replace("    return Evoformer()\n",
                        "    return Evoformer(blocks=4, tri_heads=2, tri_c_head=4, extra_blocks=2)\n")
    text = text.replace("(2, 8, 8))}", "(2, 8, 8)),\n            \"extra_msa\": torch.randint(0, AMINO_ACIDS, (2, 6, 8))}")
    text = text.replace("(2, 4, 8)", f"({batch}, 4, 8)").replace("(2, 8, 8)", f"({batch}, 8, 8)")
    text = text.replace("(2, 6, 8)", f"({batch}, 6, 8)")
    (tmp_path / "evoformer_full.py").write_text(text)
    return tmp_path / "evoformer_full.py"


@pytest.mark.slow     # a trace, about 8 s: keeps the quick subset under 3 minutes
def test_3f1b_prices_the_code_before_the_trunk_of_every_pass_on_the_first_stage(tmp_path):
    """The extra-MSA stack runs before the trunk in every recycling pass, through a helper
    (`z = self.extra_stack(e0, z)`): the planner prices all its passes in the prologue (the first
    stage, where the rewrite runs it), and the stage plan puts its ops there and cuts the stages
    by them; only the code after the trunk's call (the recycled values' detach) goes last."""
    from nnscaler_cst.analysis import analyze
    from nnscaler_cst.plan import auto
    from nnscaler_cst.plan.pipeline import plan_stages
    graph = analyze(_full_evoformer(tmp_path), trace_mode="fake").graph
    blocks = auto._blocks(graph)
    extra = [n.index for n in graph.nodes if (n.module_path or "").startswith("extra_blocks.")]
    assert blocks.passes == 3 and len(extra) > 100
    assert all(blocks.region[i] == 0 for i in extra)
    stages = plan_stages(graph, 2, recycling=True)
    assert all(stages.node_stage[i] == 0 for i in extra)
    # the rewrite cuts where the planner priced: the stack's three passes weigh on the first stage
    assert stages.block_ranges == auto._stage_ranges(blocks, 2) == [(0, 1), (1, 4)]


@pytest.mark.slow     # a trace, about 8 s
def test_recompute_checkpoints_the_extra_msa_stack_and_prices_it(tmp_path):
    """--recompute checkpoints every list of repeated blocks, not only the one the pipeline cuts: the
    extra-MSA stack's blocks keep their inputs only, its pass with gradient runs its forward again,
    and what its blocks saved leaves the first stage's memory (its blocks run there)."""
    from nnscaler_cst.analysis import analyze
    from nnscaler_cst.plan.auto import Config, estimate_config
    from nnscaler_cst.plan.cost import load_cluster
    from nnscaler_cst.plan.recompute import other_block_inputs, other_lists, recompute_sites
    graph = analyze(_full_evoformer(tmp_path), trace_mode="fake").graph
    (extra,) = other_lists(graph)
    assert extra.blocks == ("extra_blocks.0", "extra_blocks.1") and extra.span.line == \
        graph.trace.module_calls["extra_blocks.0"][0].line
    assert len(recompute_sites(graph)) == 2 and extra.span in recompute_sites(graph)
    saved = sum(graph.trace.saved.get(n.index, 0) for n in graph.nodes
                if (n.module_path or "").startswith("extra_blocks."))
    kept = sum(other_block_inputs(graph).values())
    assert 0 < kept < saved
    cluster = load_cluster("h100-node")
    plain, checkpointed = (estimate_config(graph, Config(1, 1, 2, 2, schedule="3f1b", recompute=r), cluster, [], 1e12)
                           for r in (False, True))
    # stage 0 holds both micro-batches (half the batch each) of the stack: all of what it saved, of
    # which recompute keeps the blocks' inputs (and the block on stage 0 drops its own: 146 kB before)
    dropped = plain.stage_memory[0] - checkpointed.stage_memory[0]
    assert dropped > saved - kept, (dropped, saved, kept)
    assert checkpointed.seconds > plain.seconds


def test_find_trunk_takes_the_list_with_more_weights_of_two_equally_long(tmp_path):
    """Two lists of 2 blocks (an extra-MSA stack of width 8 built before 2 Evoformer blocks of width
    16): the pipeline cuts the Evoformer blocks, the heavier list, not the one built first."""
    from nnscaler_cst.analysis import analyze
    from nnscaler_cst.plan.pipeline import find_trunk
    text = (REPO / "fixtures" / "evoformer.py").read_text()
    text = text.replace("    return Evoformer()\n", "    return Evoformer(blocks=2, extra_blocks=2)\n")
    text = text.replace("(2, 8, 8))}", "(2, 8, 8)),\n            \"extra_msa\": torch.randint(0, AMINO_ACIDS, (2, 6, 8))}")
    (tmp_path / "evoformer_two.py").write_text(text)
    graph = analyze(tmp_path / "evoformer_two.py", trace_mode="fake").graph
    assert [len(g) for g in graph.blocks.values()] == [2, 2]
    assert find_trunk(graph).blocks == ["blocks.0", "blocks.1"]


@pytest.mark.slow
def test_3f1b_with_tp_dp_zero_and_a_cut_on_the_evoformer_with_the_extra_msa_stack_passes_verify(tmp_path):
    """The evoformer with triangle attention (starting and ending node) and an extra-MSA stack of 2
    blocks (global column attention) before its 4 Evoformer blocks in every cycle, 4 proteins, under
    the plan family `--plan auto` picks at AlphaFold2's fine-tuning sizes (benchmarks/BENCH_DGX2.md):
    3F1B at TP = 2 x DP = 2 x PP = 2 with ZeRO-1, the first stage cut after one block (what the
    stage-cut search hands over as --stages). The pipeline cuts the longer list (the Evoformer
    blocks), the extra-MSA stack runs on the first stage in every pass, every new module is split
    over tp, and the run matches with --recompute, every block of both lists under a checkpoint."""
    _full_evoformer(tmp_path, batch=4)
    out = tmp_path / "out"
    result = _cli("verify", tmp_path / "evoformer_full.py", "--tp", "2", "--dp", "2", "--pp", "2", "--schedule",
                  "3f1b", "--zero", "1", "--stages", "1", "--micro-batches", "2", "-o", out, "--recompute")
    assert result.returncode == 0 and "PASSED" in result.stdout, result.stdout + result.stderr
    assert "8 gloo processes" in result.stdout
    stage0, stage1 = (out / "model_stage0.py").read_text(), (out / "model_stage1.py").read_text()
    assert "STAGE_BLOCKS = {0: (0, 1)}" in stage0 and "STAGE_BLOCKS = {1: (1, 4)}" in stage1
    assert "for block in self.blocks:  # pipeline: this stage's blocks of blocks only" in stage0
    assert "for block in self.extra_blocks:\n" in stage0          # not cut: stage 0 runs all of it
    checkpointed = [f"{v}, z = torch.utils.checkpoint.checkpoint(block, {v}, z, use_reentrant=False)" for v in "em"]
    assert all(c in stage0 for c in checkpointed), stage0
    assert "self.bias = nn.Linear(c_z, heads // 2, bias=False)" in stage1       # triangle attention's heads split
    assert "self.k = nn.Linear(c_m, c_head // 2, bias=False)" in stage0         # global column attention split


@pytest.mark.slow
def test_3f1b_with_the_recycling_loop_in_the_entry_around_blocks_of_a_sibling_file_passes_verify(tmp_path):
    """The evoformer split in two files: blocks.py holds the blocks, the entry model.py the class
    with the block loop and the recycling loop (it imports the blocks): the entry's own classes
    are the ones cut into stages."""
    text = (REPO / "fixtures" / "evoformer.py").read_text()
    cut = text.index("class Evoformer(nn.Module)")
    (tmp_path / "blocks.py").write_text(text[:cut])
    (tmp_path / "model.py").write_text("import torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n\n"
                                       "from blocks import AMINO_ACIDS, DISTANCE_BINS, EvoformerBlock\n\n\n"
                                       + text[cut:])
    out = tmp_path / "out"
    result = _cli(tmp_path / "model.py", "--pp", "2", "--schedule", "3f1b", "--micro-batches", "2", "-o", out)
    assert result.returncode == 0, result.stderr
    assert "for cycle in pp_passes(range(self.recycles)):" in (out / "model_stage0.py").read_text()
    result = _cli("verify", tmp_path / "model.py", "--pp", "2", "--schedule", "3f1b", "--micro-batches", "2")
    assert result.returncode == 0 and "PASSED" in result.stdout, result.stdout + result.stderr


@pytest.mark.slow
def test_3f1b_on_a_submodule_trunk_carrying_one_value_passes_verify_on_gloo(tmp_path):
    (tmp_path / "recycler.py").write_text(RECYCLER)
    result = _cli("verify", tmp_path / "recycler.py", "--pp", "2", "--schedule", "3f1b", "--micro-batches", "4")
    assert result.returncode == 0 and "PASSED" in result.stdout, result.stdout + result.stderr


# The recycling loop written the other common way (issue 26): the no-gradient passes in a loop of
# RECYCLES - 1 under `torch.no_grad()`, the last pass, with gradient, written again after the loop;
# each pass writes the recycled row into a slice of its input (`m[:, 0] = m[:, 0] + ...`).
LOOP_THEN_LAST = """import torch
import torch.nn as nn
import torch.nn.functional as F

RECYCLES = 3


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, h):
        return h + self.down(F.gelu(self.up(self.norm(h))))


class Recycled(nn.Module):
    def __init__(self, vocab=12, width=16, depth=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.recycle_m = nn.Linear(width, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, vocab)

    def trunk(self, m):
        for block in self.blocks:
            m = block(m)
        return m

    def forward(self, tokens, targets):
        prev = torch.zeros_like(self.embed(tokens)[:, 0])
        with torch.no_grad():
            for _ in range(RECYCLES - 1):
                m = self.embed(tokens)
                m[:, 0] = m[:, 0] + self.recycle_m(prev)
                m = self.trunk(m)
                prev = m[:, 0]
        m = self.embed(tokens)
        m[:, 0] = m[:, 0] + self.recycle_m(prev)
        m = self.trunk(m)
        return F.cross_entropy(self.head(m).flatten(0, 2), targets.flatten())


def build():
    torch.manual_seed(0)
    return Recycled()


def example_inputs():
    return {"tokens": torch.randint(0, 12, (2, 4, 8)), "targets": torch.randint(0, 12, (2, 4, 8))}
"""


@pytest.fixture(scope="module")
def loop_then_last(tmp_path_factory):
    return _analyze(tmp_path_factory.mktemp("loop_then_last"), LOOP_THEN_LAST)


def test_a_last_pass_written_after_a_no_grad_loop_is_counted_with_the_loops(loop_then_last):
    """3 passes: 2 in the loop, 1 after it; the code between the loop and that pass (the embedding
    and the recycled row's sum, through `self.embed`) runs on the first stage, as in the loop."""
    from nnscaler_cst.plan.pipeline import plan_stages
    lines = LOOP_THEN_LAST.splitlines()
    plan = plan_stages(loop_then_last.graph, 2, recycling=True)
    recycle = plan.trunk.recycle
    assert recycle.passes == 3 and recycle.carried == ["prev"]
    assert recycle.loop.line == lines.index("            for _ in range(RECYCLES - 1):") + 1
    assert recycle.after.line == len(lines) - lines[::-1].index("        m = self.trunk(m)")
    assert plan.shadow[1] == ["embed", "recycle_m"] and not plan.tied      # not held by the last stage


def test_the_rewrite_runs_the_loops_passes_then_the_last_one_after_it(loop_then_last):
    """The loop's actions run one pass each; the action of the last pass runs none of the loop's
    and starts the pass after it from what the last stage handed back."""
    from nnscaler_cst.rewrite import PlanRequest, rewrite
    stage0 = rewrite(loop_then_last, PlanRequest(pp=2, schedule="3f1b", micro_batches=2)).files["model_stage0.py"]
    assert ("            for _ in pp_passes(range(RECYCLES - 1), after=1):  # pipeline (3F1B): the pass this step "
            "runs, one per pipeline action\n"
            "                prev = pp_recycled(prev)  # pipeline: the first stage starts a later pass") in stage0
    assert ("                pp_recycle(prev)  # pipeline: the last stage hands these to the first stage and ends "
            "here, on every pass but the last\n"
            "            prev = pp_recycled(prev)  # pipeline: so does the last pass, after the loop\n"
            "        m = self.embed(tokens)\n") in stage0
    assert "PIPELINE_PASSES = 3" in stage0


def test_a_pass_written_before_the_recycling_loop_is_refused_at_its_call(tmp_path):
    from nnscaler_cst.plan.pipeline import plan_stages
    text = LOOP_THEN_LAST.replace("""        prev = torch.zeros_like(self.embed(tokens)[:, 0])
""", """        prev = self.trunk(self.embed(tokens))[:, 0]
""")
    lines = text.splitlines()
    loop = lines.index("            for _ in range(RECYCLES - 1):") + 1
    with pytest.raises(UserError, match=f"run 4 times in one forward: in the loop at line {loop} and here") as refused:
        plan_stages(_analyze(tmp_path, text).graph, 2, recycling=True)
    assert refused.value.location.line == lines.index("        prev = self.trunk(self.embed(tokens))[:, 0]") + 1


def test_pp_passes_gives_the_loop_its_passes_and_none_to_the_pass_after_it():
    from nnscaler_cst.runtime import _comm
    state = (_comm.PIPE.cycle, _comm.PIPE.passes)
    try:
        _comm.PIPE.passes = 3
        runs = {}
        for cycle in range(3):
            _comm.PIPE.cycle = cycle
            runs[cycle] = _comm.pp_passes(range(2), after=1)
        assert runs == {0: [0], 1: [1], 2: []}
        with pytest.raises(RuntimeError, match="the recycling loop runs 2 passes; the schedule was made for 3"):
            _comm.pp_passes(range(2))
        _comm.PIPE.cycle = None                    # the dry run: the last pass only
        assert _comm.pp_passes(range(2), after=1) == [] and _comm.pp_passes(range(3)) == [2]
    finally:
        _comm.PIPE.cycle, _comm.PIPE.passes = state


def test_tp_writes_a_split_value_into_a_slice_of_a_tensor_converted_for_the_write(loop_then_last):
    """`m[:, 0] = m[:, 0] + self.recycle_m(prev)` with m gathered for the write: the value reads m
    as the plan has it (split), so it is computed before m is rebound (as Python computes it before
    the write), then written. Before: the value read the gathered m, and the dry run failed."""
    from nnscaler_cst.rewrite import PlanRequest, rewrite
    model = rewrite(loop_then_last, PlanRequest(tp=2)).files["model.py"]
    assert ("        m = self.embed(tokens)\n"
            "        m_written2 = tp_gather(m[:, 0] + self.recycle_m(prev), TP, dim=2)  # tp_gather: fwd: all-gather, "
            "bwd: keep own slice\n"
            "        m = tp_gather(m, TP, dim=3)  # tp_gather: fwd: all-gather, bwd: keep own slice\n"
            "        m[:, 0] = m_written2\n") in model


@pytest.mark.slow
def test_3f1b_and_tp_on_a_loop_then_last_recycling_pass_verify_on_gloo(tmp_path):
    (tmp_path / "recycled.py").write_text(LOOP_THEN_LAST)
    result = _cli("verify", tmp_path / "recycled.py", "--pp", "2", "--tp", "2", "--schedule", "3f1b",
                  "--micro-batches", "2")
    assert result.returncode == 0 and "PASSED" in result.stdout, result.stdout + result.stderr


def test_verify_simulates_the_schedule_written_in_the_rank_files_with_its_passes():
    """check_schedules reads SCHEDULE (hand edits included) with its `r` passes and refuses a
    hand-edited order that would hang before any process starts."""
    from types import SimpleNamespace
    from nnscaler_cst.verify.equivalence import check_schedules
    _, orders = _orders(2, 2, 3)

    def package(rank0):
        modules = [SimpleNamespace(SCHEDULE=" ".join(map(str, order)), STAGE_RANKS=[0, 1], PIPELINE_LENGTH=2,
                                   PIPELINE_STAGE_COUNT=2, PIPELINE_PASSES=3) for order in orders]
        modules[0].SCHEDULE = rank0
        return SimpleNamespace(PP_SIZE=2, TP_SIZE=1, DP_SIZE=1, rank_module=lambda rank: modules[rank])
    check_schedules(package(" ".join(map(str, orders[0]))))
    # rank 0 starts micro-batch 0's second pass before handing on micro-batch 0's first
    edited = "0F0r1 0F0r0 0F1r0 0F1r1 0F0 0F1 0B0 0B1"
    with pytest.raises(UserError, match=r"rank 0 at step 0 \(0F0r1\) waits for 1F0r0 from rank 1"):
        check_schedules(package(edited))


@pytest.mark.slow
def test_rewrite_refuses_a_deadlocking_3f1b_table_with_exit_2(tmp_path):
    (tmp_path / "broken.toml").write_text(BROKEN)
    result = _cli("fixtures/evoformer.py", "--pp", "2", "--schedule", tmp_path / "broken.toml", "--micro-batches", "2",
                  "-o", tmp_path / "out")
    assert result.returncode == 2 and not (tmp_path / "out").exists()
    assert "deadlocks" in result.stderr and "rank 0 at step 1 (0F0r1)" in result.stderr, result.stderr


def test_the_planner_prices_3f1b_by_its_order_where_the_passes_wait_for_the_pipeline(tmp_path):
    """Eight stages and three passes: pass c + 1 of a micro-batch starts on the first stage only
    after pass c has come round all eight, one micro-batch after the diagonal the order gives it,
    so 3F1B's order idles where 1F1B's formula over the same stage times does not (about 20% at
    D = 8, M = 32; BENCH_DGX2's AlphaFold2). The planner's estimate is the order's simulated
    timeline (extrapolated from 2D and 3D micro-batches): within 2% of simulating all 32."""
    from nnscaler_cst.plan.auto import Config, estimate_config
    from nnscaler_cst.plan.cost import load_cluster
    text = RECYCLER.replace("depth=4, passes=2", "depth=8, passes=3").replace("randn(4, 8)", "randn(32, 8)") \
        .replace("randn(4, 1)", "randn(32, 1)")
    graph = _analyze(tmp_path, text).graph
    D, M = 8, 32
    estimate = estimate_config(graph, Config(tp=1, dp=1, pp=D, micro_batches=M, schedule="3f1b"),
                               load_cluster("cpu-gloo"), [])
    stage = estimate.stage_seconds
    events = simulate(schedule(load_schedule("3f1b"), D, M, 3), D, forward_seconds=[t / 5 for t in stage], passes=3)
    simulated = max(e.end for e in events)
    formula = sum(stage) + (M - 1) * max(stage)
    assert estimate.pipeline_seconds == pytest.approx(simulated, rel=0.02)
    assert simulated > 1.1 * formula
