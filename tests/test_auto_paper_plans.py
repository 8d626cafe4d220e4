"""`--plan auto` searches the nnScaler paper's plans beside tp x dp x pp (issue 29 item 3): co-shard
with its factor C, the interlaced pipeline, interleaved virtual stages, Chimera, and 3F1B where the
trunk recycles, each priced by the cost and memory models and pruned by constraints.

Quick: small models traced on fake tensors at shapes where one plan is the cheapest that fits an
H100 node's budget (rules/devices/h100-node.toml), each chosen without naming it; the pipeline
formulas against the tool's own simulator; the space's size with and without the constraints.
Slow: `verify --plan auto` of what the search picks at small shapes (gloo).
"""
from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from nnscaler_cst.analysis import analyze
from nnscaler_cst.plan.auto import Config, _Fixed, _order_problem, _ranks, estimate_config, pipeline_seconds, search_auto
from nnscaler_cst.plan.cost import load_cluster
from nnscaler_cst.plan.schedules import load_schedule, placement, schedule
from nnscaler_cst.verify.simulate import simulate

REPO = Path(__file__).resolve().parents[1]
H100 = load_cluster("h100-node")

# Attention over long sequences: the scores (batch x heads x seq x seq) are most of what a block
# keeps for backward, so under a tight budget a plan must drop them: recompute every block, or
# co-shard the attention core (recompute the core only).
ATTENTION = '''
import torch
import torch.nn as nn
import torch.nn.functional as F

WIDTH, HEADS, SEQ, LAYERS, BATCH = {width}, {heads}, {seq}, 4, {batch}


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.fc = nn.Linear(WIDTH, 2 * WIDTH)
        self.out = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).split(WIDTH, dim=-1)
        q = q.view(b, s, HEADS, WIDTH // HEADS).transpose(1, 2)
        k = k.view(b, s, HEADS, WIDTH // HEADS).transpose(1, 2)
        v = v.view(b, s, HEADS, WIDTH // HEADS).transpose(1, 2)
        att = F.softmax(q @ k.transpose(-2, -1) * (WIDTH // HEADS) ** -0.5, dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, s, WIDTH)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(LAYERS)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


def build():
    return Net()


def example_inputs():
    return (torch.randn(BATCH, SEQ, WIDTH),)
'''

# A language model whose vocabulary dwarfs its layers (T5's setting in the paper), the embedding
# and the head sharing one weight; the layers' odd widths split no weight two or four ways, so
# tensor parallelism divides the vocabulary only and runs the layers whole on every device.
VOCAB = '''
import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, WIDTH, LAYERS, SEQ, BATCH = {vocab}, {width}, {layers}, {seq}, {batch}


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, 3 * WIDTH)
        self.out = nn.Linear(3 * WIDTH, WIDTH)

    def forward(self, x):
        return x + self.out(F.gelu(self.fc(self.norm(x))))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList([Block() for _ in range(LAYERS)])
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), ids.flatten())


def build():
    return Net()


def example_inputs():
    return (torch.randint(0, VOCAB, (BATCH, SEQ)),)
'''

# AlphaFold2's trunk (fixtures/evoformer.py) run 3 times with recycling, pair representation 64 x 64.
RECYCLING = f'''
import sys
import torch
sys.path.insert(0, {str(REPO / "fixtures")!r})
from evoformer import AMINO_ACIDS, DISTANCE_BINS, Evoformer  # noqa: E402


def build():
    return Evoformer(c_m=64, c_z=32, heads=4, c_head=16, c_hidden=16, blocks=4, recycles=3, max_relpos=32)


def example_inputs():
    return {{"msa": torch.randint(0, AMINO_ACIDS, (8, 32, 64)),
            "distances": torch.randint(0, DISTANCE_BINS, (8, 64, 64))}}
'''


def _fake(tmp_path_factory, name: str, text: str):
    path = tmp_path_factory.mktemp(name) / "model.py"
    path.write_text(text)
    return analyze(path, trace_mode="fake").graph


@pytest.fixture(scope="module")
def attention(tmp_path_factory):
    return _fake(tmp_path_factory, "attention", ATTENTION.format(width=256, heads=16, seq=1024, batch=8))


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
    return _fake(tmp_path_factory, "vocab", VOCAB.format(vocab=131072, width=1275, layers=8, seq=128, batch=16))


def test_where_memory_forces_recompute_the_search_co_shards_the_attention_core(attention):
    """Under 400 MB per device every plan without co-shard keeps the scores unless it recomputes
    whole blocks; co-shard (C pieces of the heads per device, the core's forward run again) fits
    and costs less than any recompute (at 1 GB a Chimera pipeline keeps them all: activations are
    counted as autograd keeps them, the softmax's output alone of the scores). At 800 MB (this
    test's budget before micro-batches were searched at pp = 1) gradient accumulation fits without
    either: 2 micro-batches hold half the scores, for their per-call overheads twice."""
    accumulating = search_auto(attention, 2, H100, [], 8e8)
    assert accumulating.config.pp == 1 and accumulating.config.micro_batches > 1, accumulating.config
    assert not accumulating.config.recompute and accumulating.config.coshard == 1
    choice = search_auto(attention, 2, H100, [], 4e8)
    assert choice.config.kind == "co-shard" and choice.config.coshard >= 2 and not choice.config.recompute
    others = [e for e in choice.candidates if e.why_not is None and e.config.kind == "tp x dp"]
    assert others and all(e.config.recompute for e in others)
    assert all(e.seconds > choice.best.seconds for e in others)
    # the same split without co-shard does not fit: recompute is what the others pay for
    plain = estimate_config(attention, Config(choice.config.tp, choice.config.dp), H100, [], 4e8)
    assert plain.why_not is not None
    again = estimate_config(attention, choice.config, H100, [], 4e8)
    assert again.seconds == pytest.approx(choice.best.seconds) and again.memory == choice.best.memory


def test_co_shard_is_priced_only_where_it_could_win(attention):
    """Co-shard only adds to its split's time (one more forward of the regions it cuts), so a
    family whose split is already slower than the fastest fitting plan is not priced (pricing it
    rewrites the model): the bound it reports holds for every configuration of the family, and the
    choice is the one pricing them all would make."""
    choice = search_auto(attention, 4, H100, [], 8e8)
    unpriced = [e for e in choice.candidates if (e.why_not or "").startswith("co-shard not priced")]
    assert unpriced and choice.config.coshard == 1
    for e in unpriced:
        assert e.seconds >= choice.best.seconds
        tp, dp = e.config.tp, e.config.dp
        for micro in (1, 2):
            for zero in (0, 1):
                for recompute in (False, True):
                    priced = estimate_config(attention, Config(tp, dp, 1, micro, zero, recompute, coshard=2), H100,
                                             [], 8e8)
                    assert priced.seconds >= e.seconds * (1 - 1e-12), (priced.config.describe(), e.seconds)


def test_a_huge_shared_vocabulary_makes_the_search_interlace_the_pipeline(vocab):
    """1F1B keeps the whole shared vocabulary weight on its first and on its last stage; the
    interlaced pipeline splits it (and the embedding's and head's work) over the pipeline ranks,
    and is the fastest plan that fits 1.9 GB, where no plan without it fits (an embedding lookup
    costs its output, not a matmul over the table: the FLOP balance gives 1F1B's embedding stage
    its share of blocks beside the table; before, 1F1B fitted with more micro-batches). At 2.1 GB
    (the budget before micro-batches were searched at pp = 1) tp=4 with gradient accumulation over
    4 micro-batches fits too (2.03 GB) and is priced 0.4% faster."""
    choice = search_auto(vocab, 4, H100, [], 1.9e9)
    assert choice.config.pp > 1 and choice.config.schedule == "interlaced", choice.config
    same = Config(choice.config.tp, choice.config.dp, choice.config.pp, choice.config.micro_batches,
                  choice.config.zero, choice.config.recompute)
    one_f_one_b = estimate_config(vocab, same, H100, [], 1.9e9)
    assert one_f_one_b.memory > choice.best.memory and one_f_one_b.why_not is not None
    others = [e for e in choice.candidates if e.config.schedule != "interlaced"]
    assert others and all(e.why_not is not None for e in others)


@pytest.mark.parametrize("tp, pp, micro, recompute", [(1, 4, 16, False), (2, 2, 16, False), (1, 2, 8, False),
                                                      (1, 4, 16, True)])
def test_the_searchs_interlaced_price_is_the_walks(vocab, tp, pp, micro, recompute):
    """What `--plan auto` prices an interlaced configuration at (estimate_config, the search's
    analytic form) agrees with plan/interlaced.py `estimate` (the walk of the steps' order on the
    simulator's timeline) within 10% in time, and within 1% in each stage's memory: every
    vocabulary step, the head's fused cross entropy included, runs on each of the tp x pp devices
    on 1/(tp x pp) of the vocabulary, the stages are balanced without them, a stage keeps the
    table's lock-step warm-up of micro-batches (2 (D - 1 - i) + 1), and a step's saved tensors
    live while their owner stage holds the micro-batch (before: the steps at 1/pp, the loss on the
    last stage: up to 1.63x the walk's step and 1.84x its memory at 10ca8ff; then 1F1B's D - i in
    flight and the steps' tensors on every stage's count: 4% over at stage 0 here, and at the
    artifact's T5 31.1 against 27.9 GiB, so the search fit nothing where the walk fit interlaced)."""
    from nnscaler_cst.plan import interlaced
    config = Config(tp=tp, dp=4 // (tp * pp), pp=pp, micro_batches=micro, schedule="interlaced", recompute=recompute)
    searched = estimate_config(vocab, config, H100, [], 1e12)
    walked = interlaced.estimate(vocab, config, H100, [], 1e12, table=None)
    assert searched.seconds == pytest.approx(walked.seconds, rel=0.1)
    assert searched.stage_memory == pytest.approx(walked.stage_memory, rel=0.01)


# fixtures/evoformer.py (3 recycles) with 8 blocks, its batch of 2 proteins: on 4 devices data
# parallelism fills 2 of them at most, and the rest is tensor parallelism or a pipeline
RECYCLING_SMALL = (REPO / "fixtures" / "evoformer.py").read_text().replace("    return Evoformer()\n",
                                                                           "    return Evoformer(blocks=8)\n")
GLOO = load_cluster("cpu-gloo")
RECYCLING_BUDGET = 1e6


@pytest.mark.slow             # about 20 s: the split of an Evoformer block solved for tp 2 and 4
def test_where_dp_cannot_fill_the_devices_and_tp_pays_for_its_links_the_search_chooses_3f1b(tmp_path_factory):
    """2 proteins on 4 devices of gloo's links (158 us a collective, rules/devices/cpu-gloo.toml):
    dp takes 2 devices at most; tensor parallelism pays a collective per split op of every block in
    every pass, a pipeline a hand-off per stage and pass. Under 1 MB per device tp 2 x dp 2 must
    recompute, and free to choose every dimension (no --pp, no --schedule) the search pipelines the
    recycling trunk under 3F1B (the only order for it) at dp 2 x pp 2, over 10% below the best
    plan without a pipeline."""
    graph = _fake(tmp_path_factory, "recycling", RECYCLING_SMALL)
    free = search_auto(graph, 4, GLOO, [], RECYCLING_BUDGET)
    assert (free.config.pp, free.config.dp, free.config.schedule) == (2, 2, "3f1b"), free.config
    fitting = sorted((e for e in free.candidates if e.why_not is None), key=lambda e: e.seconds)
    best_tp = next(e for e in fitting if e.config.pp == 1)
    assert best_tp.config.tp > 1 and best_tp.config.recompute and best_tp.seconds > 1.1 * free.best.seconds


@pytest.mark.parametrize("order", ["1f1b", "interleaved", "chimera"])
def test_the_pipeline_step_agrees_with_the_simulator_within_10_percent(order):
    """The search's closed form of each schedule against verify/simulate.py over the table's own
    order, stage times drawn at random within 20% of each other (backward = 2 forwards)."""
    rng = random.Random(order)
    table = load_schedule(order)
    for pp, micro in ((2, 4), (4, 4), (4, 8)):
        place = placement(table, pp)
        _, length = _ranks(order, pp)
        chunk = [rng.uniform(0.8, 1.2) for _ in range(length)]
        _, estimate = pipeline_seconds(order, pp, micro, chunk)
        events = simulate(schedule(table, pp, micro), len(place.ranks), placement=place,
                          forward_seconds=[chunk[v % length] / 3 for v in range(len(place.ranks))])
        assert estimate == pytest.approx(max(e.end for e in events), rel=0.1), (pp, micro)


def test_an_order_the_table_cannot_solve_is_not_chosen():
    """Chimera's order constraints have no solution for 16 micro-batches on 4 ranks: that
    configuration is refused, not emitted."""
    assert "contradict" in _order_problem(Config(1, 1, 4, 16, schedule="chimera"), type("B", (), {"passes": 1}))
    assert _order_problem(Config(1, 1, 4, 8, schedule="chimera"), type("B", (), {"passes": 1})) is None


def test_plan_reports_the_space_and_the_best_of_each_kind(vocab):
    from nnscaler_cst.plan.ir import Plan
    from nnscaler_cst.report.plan_view import search_json, search_lines
    choice = search_auto(vocab, 4, H100, [], 2.1e9)
    assert choice.space > 10 * choice.evaluated > 0
    plan = Plan("auto", {"tp": choice.config.tp, "dp": choice.config.dp, "pp": choice.config.pp})
    plan.auto = choice
    text = "\n".join(search_lines(plan))
    assert f"of {choice.space} without the constraints" in text
    for kind in ("tp x dp", "1f1b", "interleaved", "chimera", "interlaced", "co-shard"):
        assert f"    {kind} " in text
    kinds = search_json(plan)["best_of_each_kind"]
    assert kinds["interlaced"]["schedule"] == "interlaced" and kinds["co-shard"]["why_not"]


# --------------------------------------------------------------------------------------------
# End to end (gloo processes): what the search picks at small shapes trains like one device
# --------------------------------------------------------------------------------------------

def _verify(tmp_path, text: str, *options, cluster: str = "h100-node") -> dict:
    model = tmp_path / "model.py"
    model.write_text(text)
    result = subprocess.run([sys.executable, "-m", "nnscaler_cst.cli", "verify", str(model), "--plan", "auto",
                             *map(str, options), "--cluster", cluster, "-o", str(tmp_path / "out"), "--json",
                             "--steps", "2"], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads(result.stdout[result.stdout.index("{"):])["passed"]
    return json.loads((tmp_path / "out" / "plan.json").read_text())


@pytest.mark.slow
def test_auto_co_shard_at_small_shapes_verifies(tmp_path):
    plan = _verify(tmp_path, ATTENTION.format(width=32, heads=4, seq=64, batch=2), "--devices", 2,
                   "--memory-budget", 5e5)       # at 1 MB a pipeline without recompute fits and wins
    assert "co-shard=" in plan["plan"], plan["plan"]


@pytest.mark.slow
def test_auto_interlaced_at_small_shapes_verifies(tmp_path):
    plan = _verify(tmp_path, VOCAB.format(vocab=4096, width=45, layers=4, seq=8, batch=4), "--devices", 4,
                   "--memory-budget", 2.5e6)
    assert "schedule=interlaced" in plan["plan"], plan["plan"]


@pytest.mark.slow
def test_auto_3f1b_at_small_shapes_verifies(tmp_path):
    """What the free search above chooses (no --pp, no --schedule) trains like one device."""
    plan = _verify(tmp_path, RECYCLING_SMALL, "--devices", 4, "--memory-budget", RECYCLING_BUDGET, cluster="cpu-gloo")
    assert "pp=2" in plan["plan"] and "schedule=3f1b" in plan["plan"], plan["plan"]
