"""`--plan auto` (issue 9): one search over tensor, pipeline and data parallelism, micro-batches,
ZeRO, recompute and sequence parallelism, costed with the cost model and the memory model per
device; and the split search under it, solved exactly by variable elimination and checked by z3.

Quick: elimination against brute force and against z3's optimiser; the memory model's rules;
small models where memory forces a pipeline or ZeRO, against byte counts computed here from
their sizes. Slow: `verify --plan auto` under a budget that makes the search pick pipeline
stages with ZeRO. (Planning time is a benchmark: benchmarks/bench_planning.py.)
"""
from __future__ import annotations

import itertools
import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest

from nnscaler_cst.analysis import analyze
from nnscaler_cst.errors import UserError
from nnscaler_cst.materialize.conversions import fused_collectives
from nnscaler_cst.plan import search
from nnscaler_cst.plan.auto import Config, estimate_config, search_auto
from nnscaler_cst.plan.cost import load_cluster
from nnscaler_cst.plan import eliminate
from nnscaler_cst.plan.eliminate import minimize, minimize_avoiding
from nnscaler_cst.plan.memory import device_memory, micro_batches_in_flight, saved_bytes
from nnscaler_cst.plan.pipeline import plan_stages
from nnscaler_cst.plan.tables import load_table
from nnscaler_cst.rewrite import PlanRequest, rewrite

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "fixtures"
CPU = load_cluster("cpu-gloo")
WIDTH = 15            # odd: no weight matrix splits two ways, so tensor parallelism cannot save memory
FLOAT = 4


@pytest.fixture(scope="module")
def _llama_analysis():
    return analyze(FIXTURES / "hf_llama.py")


@pytest.fixture
def llama(_llama_analysis):
    """hf_llama's graph, traced once per module, without what earlier searches kept on it."""
    graph = _llama_analysis.graph
    graph.__dict__.pop("_search_cache", None)
    return graph


def cli(*args, cwd=REPO):
    return subprocess.run([sys.executable, "-m", "nnscaler_cst.cli", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=900)


# --------------------------------------------------------------------------------------------
# Variable elimination
# --------------------------------------------------------------------------------------------

def random_pairwise_problem(rng):
    """(n, domains, unary, pairs): up to 6 sites of up to 4 options, some forbidden (inf)."""
    n = rng.randint(1, 6)
    domains = [rng.randint(1, 4) for _ in range(n)]
    unary = [[rng.choice([0, 1, 2, 7, math.inf]) for _ in range(d)] for d in domains]
    pairs = {(i, j): [[rng.choice([0, 1, 3, math.inf]) for _ in range(domains[j])] for _ in range(domains[i])]
             for i, j in itertools.combinations(range(n), 2) if rng.random() < 0.4}
    return n, domains, unary, pairs


def test_elimination_finds_the_brute_force_minimum_with_forbidden_pairs_and_higher_factors():
    rng = random.Random(7)
    for _ in range(200):
        n, domains, unary, pairs = random_pairwise_problem(rng)
        triple = tuple(sorted(rng.sample(range(n), min(3, n))))
        # a sparse factor over up to three sites: its absent entries count 0
        extra = {triple: {x: math.inf for x in itertools.product(*(range(domains[v]) for v in triple))
                          if rng.random() < 0.2}}

        def total(x):
            return (sum(unary[i][x[i]] for i in range(n)) + sum(t[x[i]][x[j]] for (i, j), t in pairs.items())
                    + extra[triple].get(tuple(x[v] for v in triple), 0))
        best = min(total(x) for x in itertools.product(*map(range, domains)))
        value, assignment = minimize(domains, unary, pairs, extra)
        assert value == best
        if math.isfinite(best):
            assert total(assignment) == best


@pytest.mark.parametrize("factors_fit", [True, False])
def test_elimination_avoiding_named_combinations_finds_the_brute_force_minimum(factors_fit, monkeypatch):
    """Combinations the caller names only when an optimum holds one (z3's agreement facts), ruled
    out by factors while the tables stay narrow, and by branching when they would not (here:
    any factor made too wide, so only branching runs)."""
    if not factors_fit:
        plain = eliminate.minimize

        def narrow_only(domains, unary, pairs, factors_over=None):
            if factors_over:
                raise eliminate.TooWide("a factor over named combinations")
            return plain(domains, unary, pairs)
        monkeypatch.setattr(eliminate, "minimize", narrow_only)
    rng = random.Random(11)
    for _ in range(150):
        n, domains, unary, pairs = random_pairwise_problem(rng)
        forbidden = []
        for _ in range(rng.randint(0, 6)):
            sites = tuple(sorted(rng.sample(range(n), rng.randint(1, n))))
            forbidden.append((sites, tuple(rng.randrange(domains[s]) for s in sites)))

        def conflict(x):
            return next(((s, v) for s, v in forbidden if all(x[k] == a for k, a in zip(s, v))), None)

        def total(x):
            return sum(unary[i][x[i]] for i in range(n)) + sum(t[x[i]][x[j]] for (i, j), t in pairs.items())
        best = min((total(x) for x in itertools.product(*map(range, domains)) if conflict(x) is None),
                   default=math.inf)
        value, assignment = minimize_avoiding(domains, unary, pairs, conflict, max_solves=10 ** 6)
        assert value == best
        if math.isfinite(best):
            assert conflict(assignment) is None and total(assignment) == best


def test_elimination_is_exact_on_integers_past_float_precision():
    big = 10 ** 20        # a stand-in priced with every collective dear gives such costs
    unary = [[big, big + 1], [big + 3, big]]
    value, assignment = minimize([2, 2], unary, {(0, 1): [[0, 5], [0, 1]]})
    assert (value, assignment) == (2 * big + 2, [1, 1])


@pytest.mark.parametrize("fixture, table, tp, dp", [("gpt", "megatron", 2, 1)])
def test_the_split_search_costs_what_z3s_optimiser_finds(fixture, table, tp, dp, monkeypatch):
    """Elimination (with z3 checking the argument-agreement facts) against the whole problem
    handed to z3's optimiser, as the search did before: the same least cost and memory. The
    cases z3 takes minutes on (the full space, hf_llama, complex_rotary: one ran past 15 minutes
    in CI) are part 3 of benchmarks/bench_planning.py."""
    graph = analyze(FIXTURES / f"{fixture}.py").graph
    constraints = load_table(table).for_axis("tp") if table else []
    device = CPU.axis(1, tp)
    solved_by_z3 = search._solved_by_z3

    def declined(*args, **kwargs):
        raise AssertionError("elimination handed the problem to z3")
    with fused_collectives(table == "sequence_parallel"):
        monkeypatch.setattr(search, "_solved_by_z3", declined)
        fast = search.search_axis(graph, "tp", tp, constraints, device, data_parallel=dp)
        monkeypatch.setattr(search, "_solved_by_z3", solved_by_z3)
        monkeypatch.setattr(search, "_eliminated", lambda *args, **kwargs: None)
        slow = search.search_axis(graph, "tp", tp, constraints, device, data_parallel=dp)
    assert fast.cost == pytest.approx(slow.cost, rel=1e-12, abs=1e-12)
    assert fast.memory == slow.memory


def test_shared_arguments_group_where_a_producer_feeds_two_of_them():
    """Arguments fed by several producers must agree; a producer feeding two of them joins their
    facts, and no fact spans two groups (so a conflict is named within one group)."""
    sources = {"a": {"s1", "s2"}, "b": {"s2", "s3"}, "c": {"s4", "s5"}, "d": {"s3", "s6"}, "e": {"s7"}}
    groups = search._agreement_groups(sources, {"a", "b", "c", "d"})
    assert groups == [(frozenset("abd"), ["s1", "s2", "s3", "s6"]), (frozenset("c"), ["s4", "s5"])]
    # joined late: two groups found apart merge when an argument shares a producer with each
    joined = search._agreement_groups({"a": {"s1", "s2"}, "b": {"s3", "s4"}, "c": {"s2", "s3"}}, {"a", "b", "c"})
    assert joined == [(frozenset("abc"), ["s1", "s2", "s3", "s4"])]

@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_a_conflict_is_named_among_its_groups_facts_with_the_same_optimum(tp, monkeypatch, llama):
    """hf_llama's cheapest split breaks an argument's agreement (four groups of shared arguments):
    z3 names the choices breaking it among that group's facts, the search goes on by elimination
    (never handing the problem to z3), and ends at the optimum it reaches with every fact in one
    group, as it named them before."""
    graph = llama
    checked = []
    disagreeing = search._disagreeing_sources

    def recorded(*args, fixed=None, only=None, **kwargs):
        if fixed is None:
            checked.append(only)
        return disagreeing(*args, fixed=fixed, only=only, **kwargs)

    def declined(*args, **kwargs):
        raise AssertionError("elimination handed the problem to z3")
    groups = []
    grouping = search._agreement_groups
    monkeypatch.setattr(search, "_agreement_groups", lambda *args: groups.append(grouping(*args)) or groups[-1])
    monkeypatch.setattr(search, "_disagreeing_sources", recorded)
    monkeypatch.setattr(search, "_solved_by_z3", declined)
    grouped = search.search_axis(graph, "tp", tp, [], CPU.axis(1, tp))
    assert groups and len(groups[-1]) > 1
    assert checked and all(only is not None for only in checked)      # a conflict was named, in a group
    monkeypatch.setattr(search, "_agreement_groups", lambda sources, shared: [
        (frozenset(shared), sorted({s for a in shared for s in sources[a]}, key=str))] if shared else [])
    graph.__dict__.pop("_search_cache")         # z3's answers were kept per group
    whole = search.search_axis(graph, "tp", tp, [], CPU.axis(1, tp))
    assert (grouped.cost, grouped.memory) == (whole.cost, whole.memory)


def test_conflicts_named_in_one_split_search_are_ruled_out_in_another_only_where_z3_confirms_them(monkeypatch, llama):
    """--plan auto solves the split of each tensor-parallel size at several batch slicings: the
    conflicts z3 named at one are ruled out from the start at the next (fewer eliminations, the
    same optimum as a search knowing none), and only after z3 confirms each breaks that problem's
    own facts: a combination the optimum itself holds, planted as if named before, changes nothing."""
    graph = llama
    solves = []
    eliminated = eliminate.minimize
    monkeypatch.setattr(eliminate, "minimize", lambda *args: solves.append(1) or eliminated(*args))

    def search_at(slices: int):
        solves.clear()
        plan = search.search_axis(graph, "tp", 2, [], CPU.axis(1, 2), data_parallel=slices)
        return (plan.cost, plan.memory, plan.choices.node_choice), len(solves), plan.site_choice
    alone, alone_solves, optimum = search_at(1)
    named = search._search_table(graph, "known_conflicts")
    assert named, "hf_llama's split names no conflict: the test needs one"
    planted = {arguments: {tuple((sid, optimum[sid]) for sid, _ in combination) for combination in combinations}
               for arguments, combinations in named.items()}
    graph.__dict__.pop("_search_cache")
    search_at(2)
    assert search._search_table(graph, "known_conflicts")
    warm, warm_solves, _ = search_at(1)
    assert warm == alone and warm_solves < alone_solves
    graph.__dict__.pop("_search_cache")
    search._search_table(graph, "known_conflicts").update(planted)     # held by the optimum: no conflict
    assert search_at(1)[0] == alone


def test_region_prices_kept_across_the_splits_of_one_size_are_those_of_a_fresh_pricing(llama):
    """plan/auto.py `_regions` keeps each op's price per graph, axis size and device, by the key
    a repeated block's ops share (site, shapes, split and the producers' splits): pricing one
    split after another at that size gives the second exactly what pricing it alone gives."""
    from nnscaler_cst.plan import auto
    graph = llama
    blocks, device = auto._blocks(graph), CPU.axis(1, 2)
    first, second = (search.search_axis(graph, "tp", 2, table, device)
                     for table in ([], load_table("sequence_parallel").for_axis("tp")))
    assert first.choices.node_choice != second.choices.node_choice
    auto._regions(graph, blocks, first, 2, device)
    after_first = auto._regions(graph, blocks, second, 2, device)
    search._search_table(graph, "region_prices").clear()
    assert after_first == auto._regions(graph, blocks, second, 2, device)


@pytest.mark.slow
def test_split_searches_sharing_a_graphs_tables_find_what_each_finds_alone(llama):
    """plan/search.py keeps, per graph, the cost tables of each size and slicing (shared by the
    variants --plan auto solves at that size; the ops' own prices also across fused collectives)
    and each constraint's answers per group of alike instances (shared across sizes). Each of
    these searches, solved after the others on one graph, finds exactly what it finds alone."""
    graph = llama
    variants = [("auto", [], False)] + [(name, load_table(name).for_axis("tp"), load_table(name).fused_collectives)
                                        for name in ("sequence_parallel", "coshard")]

    def solved(n, table, fused, slices):
        with fused_collectives(fused):
            plan = search.search_axis(graph, "tp", n, table, CPU.axis(1, n), data_parallel=slices, explain=False)
        return plan.choices.node_choice, plan.cost, plan.memory, plan.restricted, plan.left_whole

    runs = [(n, name, table, fused, slices) for n in (2, 4) for slices in (1, 2) for name, table, fused in variants]
    together = [solved(n, table, fused, slices) for n, _, table, fused, slices in runs]
    assert len({repr(plan[0]) for plan in together}) > 2        # the variants split unalike
    for (n, name, table, fused, slices), shared in zip(runs, together):
        graph.__dict__.pop("_search_cache")
        assert solved(n, table, fused, slices) == shared, (n, name, slices)


@pytest.mark.slow
def test_a_constraint_asked_per_group_of_alike_instances_answers_as_asked_per_instance(llama):
    """The search narrows a site by a constraint per group of instances with equal candidates
    (one list of labels, `allows_every`, kept across sizes): the options left are those every
    selected instance allows, asked one by one, at each size, for tables and for constraints that
    select some instances of a site only (one layer's weights, one layer's module)."""
    from nnscaler_cst.errors import Location
    from nnscaler_cst.plan.tables import Constraint
    graph = llama
    layer0 = sorted(p for p in graph.trace.params if ".0." in p and p.endswith("weight"))
    assert layer0
    here = Location("test", 1, 1)
    constraints = [*(c for name in ("sequence_parallel", "coshard", "megatron") for c in load_table(name).for_axis("tp")),
                   Constraint("layer0-whole", here, "tp", {"params": layer0}, forbid="splitting-params"),
                   Constraint("layer1-replicated", here, "tp", {"module": "*layers.1*"}, algo="replicate")]
    candidates = search._site_candidates(graph, False)
    narrowed = 0
    for n in (2, 4, 2):
        options = search.site_options(graph, n)
        for constraint in constraints:
            _, allows, selected_at, groups_selected, allows_every = search._constraint_answers(graph, constraint)
            for sid, opts in options.items():
                selected = selected_at(sid, opts.nodes)
                if not selected:
                    continue
                kinds = groups_selected(sid, candidates[sid][1], selected, False)
                for k in range(len(opts.options)):
                    alone = all(allows(i, opts.labels[i][k]) for i in selected)
                    assert alone == all(allows_every(kind, opts.labels[kind[0]][k]) for kind in kinds), \
                        (n, constraint.id, sid, k)
                    narrowed += not alone
    assert narrowed       # some constraint rules some option out


def test_z3s_optimiser_stopped_at_its_limit_gives_a_valid_plan_and_says_so(monkeypatch):
    """A model elimination declines (too densely connected: DeepSeek-V4 at TP=2 ran past 400 s
    in z3) gets the best plan z3 found within Z3_LIMIT_S, at worst a feasible one, with a warning;
    never a hang. Here the limit is 1 ms on the GPT fixture's full space, which z3 needs seconds for."""
    graph = analyze(FIXTURES / "gpt.py").graph
    best = search.search_axis(graph, "tp", 2, [])
    monkeypatch.setattr(search, "_eliminated", lambda *args, **kwargs: None)
    monkeypatch.setattr(search, "Z3_LIMIT_S", 0.001)
    stopped = search.search_axis(graph, "tp", 2, [])
    assert any("search stopped after 0.001 s" in w for w in stopped.left_whole), stopped.left_whole
    assert not any("search stopped" in w for w in best.left_whole)
    assert math.isfinite(stopped.cost) and stopped.cost >= best.cost
    assert set(stopped.choices.node_choice) == set(best.choices.node_choice)      # every op decided


@pytest.mark.slow
def test_over_the_budget_the_least_memory_is_z3s_lexicographic_optimum(monkeypatch):
    graph = analyze(FIXTURES / "gpt.py").graph
    budget = search.search_axis(graph, "tp", 2, []).memory * 0.9      # the cheapest plan does not fit
    fast = search.search_axis(graph, "tp", 2, [], memory_budget=budget)
    monkeypatch.setattr(search, "_eliminated", lambda *args, **kwargs: None)
    slow = search.search_axis(graph, "tp", 2, [], memory_budget=budget)
    assert (fast.cost, fast.memory) == (slow.cost, slow.memory) and fast.memory <= budget


# --------------------------------------------------------------------------------------------
# The memory model
# --------------------------------------------------------------------------------------------

def test_1f1b_keeps_stages_minus_stage_micro_batches_gpipe_all():
    assert [micro_batches_in_flight(s, 4, 8) for s in range(4)] == [4, 3, 2, 1]
    assert [micro_batches_in_flight(s, 4, 2) for s in range(4)] == [2, 2, 2, 1]
    assert [micro_batches_in_flight(s, 4, 8, "gpipe") for s in range(4)] == [8] * 4


@pytest.mark.parametrize("zero, held, gathered", [(0, (4000, 4000, 8000), 0), (1, (5000, 4000, 2000), 0),
                                                  (2, (5000, 1000, 2000), 25 * FLOAT),
                                                  (3, (1000, 1000, 2000), 2 * 25 * FLOAT)])
def test_device_memory_adds_zero_state_activations_in_flight_and_what_recompute_rebuilds(zero, held, gathered):
    memory = device_memory(1000, zero, 4, 300.0, 3, rebuilt=50.0, block_params=10, root_params=5)
    assert (memory.params, memory.grads, memory.optimizer) == held
    assert memory.activations == 900.0 and memory.rebuilt == 50.0
    assert memory.gathered == gathered      # the root unit and two blocks: gradients, ZeRO-3 parameters too
    assert memory.total == sum(held) + 900 + 50 + memory.gathered


# --------------------------------------------------------------------------------------------
# Memory forces the search's hand
# --------------------------------------------------------------------------------------------

NO_BLOCKS = f'''
import torch
import torch.nn as nn


class Net(nn.Module):
    """Three layers of an odd width and no loop over blocks: neither tensor parallelism nor
    pipeline stages can hold less, only ZeRO over data parallelism."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear({WIDTH}, {WIDTH})
        self.b = nn.Linear({WIDTH}, {WIDTH})
        self.c = nn.Linear({WIDTH}, {WIDTH})

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x))))).pow(2).mean()


def build():
    return Net()


def example_inputs():
    return (torch.randn(8, {WIDTH}),)
'''

BLOCKS = f'''
import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear({WIDTH}, {WIDTH})

    def forward(self, x):
        return torch.relu(self.fc(x))


class Net(nn.Module):
    """Four blocks of an odd width, on a batch of one: no data parallelism, no weight split;
    only pipeline stages hold less."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(4)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


def build():
    return Net()


def example_inputs():
    return (torch.randn(1, {WIDTH}),)
'''

LAYER_PARAMS = WIDTH * WIDTH + WIDTH       # a Linear's weight and bias


@pytest.fixture(scope="module")
def no_blocks(tmp_path_factory):
    path = tmp_path_factory.mktemp("zero") / "model.py"
    path.write_text(NO_BLOCKS)
    return analyze(path)


@pytest.fixture(scope="module")
def blocks(tmp_path_factory):
    path = tmp_path_factory.mktemp("pipe") / "model.py"
    path.write_text(BLOCKS)
    return analyze(path)


def test_a_budget_only_zero_1_meets_makes_the_search_shard_the_optimizer_state(no_blocks):
    """A model without blocks is one ZeRO unit: its gradients are whole until the backward ends
    and ZeRO-3 gathers all of it, so ZeRO-2 and 3 hold as much as plain data parallelism (16
    bytes a parameter); ZeRO-1 holds less (whole weights and gradients, the shard the optimizer
    steps and its AdamW state)."""
    graph = no_blocks.graph
    params = 3 * LAYER_PARAMS
    assert sum(math.prod(p.shape) for p in graph.trace.params.values()) == params
    activations = sum(saved_bytes(n, graph.trace) for n in graph.nodes) / 2      # half the batch per rank
    shard = math.ceil(params / 2)
    zero1 = (params + shard) * FLOAT + params * FLOAT + shard * 8
    budget = (zero1 + 16 * params) / 2 + activations
    choice = search_auto(graph, 2, CPU, [], budget)
    assert (choice.config.dp, choice.config.zero, choice.config.pp) == (2, 1, 1), choice.config
    assert choice.best.memory == zero1 + activations
    refused = {(e.config.tp, e.config.dp, e.config.pp): e.why_not for e in choice.candidates if e.why_not}
    assert "blocks" in refused[(1, 1, 2)] or "loop" in refused[(1, 1, 2)]     # no blocks to cut into stages
    # below it, gradient accumulation (micro-batches at pp = 1) holds one micro-batch's activations at a
    # time: ZeRO-1 with 2, then 4 micro-batches of the rank's 4 samples; below 1 sample's, nothing fits
    for micro in (2, 4):
        smaller = search_auto(graph, 2, CPU, [], zero1 + 2 * activations / micro - 1)
        assert (smaller.config.dp, smaller.config.zero, smaller.config.pp, smaller.config.micro_batches) == \
            (2, 1, 1, micro), smaller.config
        assert smaller.best.memory == zero1 + activations / micro
    with pytest.raises(UserError, match="no plan on 2 devices fits"):
        search_auto(graph, 2, CPU, [], zero1 + activations / 4 - 1)


def test_a_budget_below_the_whole_model_makes_the_search_cut_pipeline_stages(blocks):
    graph = blocks.graph
    params = 4 * LAYER_PARAMS
    whole = params * 16 + sum(saved_bytes(n, graph.trace) for n in graph.nodes)
    choice = search_auto(graph, 2, CPU, [], params * 16 - 1)      # not even the weights' state fits whole
    assert (choice.config.pp, choice.config.dp, choice.config.micro_batches) == (2, 1, 1), choice.config
    stages = plan_stages(graph, 2)                  # where the rewrite cuts: the search prices the same stages
    assert stages.block_ranges == [(0, 2), (2, 4)]
    for s in range(2):
        held = 2 * LAYER_PARAMS * 16                 # two blocks' weights, gradients and AdamW state
        kept = sum(saved_bytes(n, graph.trace) for n in graph.nodes if stages.node_stage[n.index] == s)
        assert choice.best.stage_memory[s] == pytest.approx(held + kept * micro_batches_in_flight(s, 2, 1))
    assert choice.best.memory < whole


def test_rewrite_emits_the_configuration_the_search_chose(blocks):
    result = rewrite(blocks, PlanRequest(plan="auto", devices=2, memory_budget=4 * LAYER_PARAMS * 16 - 1))
    assert result.plan.mesh == {"tp": 1, "dp": 1, "pp": 2}
    assert result.plan.name.startswith("auto(tp=1,dp=1,pp=2,micro-batches=1)")
    assert result.stages is not None and result.stages.block_ranges == [(0, 2), (2, 4)]
    assert result.plan.estimated_step_seconds == result.plan.auto.best.seconds


def test_options_the_user_gives_are_kept_and_the_rest_searched(no_blocks):
    request = PlanRequest(plan="auto", devices=2, zero=3)
    result = rewrite(no_blocks, request)
    assert result.plan.mesh["dp"] == 2 and result.plan.auto.config.zero == 3
    assert "ZERO_STAGE = 3" in result.files["__init__.py"]


def test_the_estimate_of_a_configuration_is_the_one_the_search_ranks(blocks):
    graph = blocks.graph
    choice = search_auto(graph, 2, CPU, [], None)
    again = estimate_config(graph, choice.config, CPU, [])
    assert again.seconds == pytest.approx(choice.best.seconds) and again.memory == choice.best.memory


@pytest.mark.slow     # over 5 s: keeps the quick subset under 3 minutes
def test_a_trunk_run_in_a_recycling_loop_is_pipelined_under_3f1b():
    """The evoformer runs its blocks 3 times per forward (AlphaFold2's recycling): 1F1B cannot
    pipeline it, 3F1B can, so the search's pipeline configurations name that schedule (they were
    all refused), and the rewrite emits it."""
    analysis = analyze(FIXTURES / "evoformer.py")
    choice = search_auto(analysis.graph, 4, CPU, [], None)
    piped = [e for e in choice.candidates if e.config.pp > 1]
    assert all(e.config.schedule == "3f1b" for e in piped) and any(e.why_not is None for e in piped)
    assert all(e.config.schedule == "1f1b" for e in choice.candidates if e.config.pp == 1)
    result = rewrite(analysis, PlanRequest(plan="auto", devices=2, pp=2))
    assert result.plan.name.startswith("auto(tp=1,dp=1,pp=2,micro-batches=") and "schedule=3f1b" in result.plan.name
    assert "PIPELINE_PASSES = 3" in result.files["model_stage0.py"]


# --------------------------------------------------------------------------------------------
# End to end (gloo processes)
# --------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_auto_under_a_budget_that_needs_stages_and_zero_verifies(tmp_path):
    """The GPT fixture on 4 devices with twice its weights' bytes per device: whole replicas do
    not fit; the search cuts two stages and shards the data-parallel state, and that trains like
    the single-device model."""
    graph = analyze(FIXTURES / "gpt.py").graph
    weights = sum(graph.trace.tensors[p.tid].nbytes for p in graph.trace.params.values())
    result = cli("verify", FIXTURES / "gpt.py", "--plan", "auto", "--devices", "4", "--memory-budget", 2 * weights,
                 "-o", tmp_path / "out", "--json", "--steps", "2")
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads(result.stdout[result.stdout.index("{"):])["passed"]
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    assert plan["mesh"]["pp"] > 1 or "zero" in plan["plan"], plan["plan"]
    assert plan["mesh"] != {"tp": 1, "dp": 4, "pp": 1} or "zero" in plan["plan"]


@pytest.mark.slow
def test_auto_pipelining_a_recycling_trunk_under_3f1b_verifies(tmp_path):
    result = cli("verify", FIXTURES / "evoformer.py", "--plan", "auto", "--devices", "2", "--pp", "2",
                 "-o", tmp_path / "out", "--json", "--steps", "2")
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads(result.stdout[result.stdout.index("{"):])["passed"]
    assert "schedule=3f1b" in json.loads((tmp_path / "out" / "plan.json").read_text())["plan"]
