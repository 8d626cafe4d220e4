"""`--plan auto` searches where to cut the pipeline (plan/auto.py `_cut_search`): the FLOP-balanced
cut misses what holds memory without FLOPs (an embedding table) and what costs time beyond FLOPs,
so a configuration that does not fit at that cut may fit at another; the cut found goes to the
rewrite as `--stages` would (a pipeline cut by `--stages` verifies: tests/test_pipeline_plan.py
`pp2_stages1`). Byte counts computed here from the model's sizes decide which cut fits.
"""
from __future__ import annotations

import pytest

from nnscaler_cst.analysis import analyze
from nnscaler_cst.errors import UserError
from nnscaler_cst.plan.auto import Config, _Fixed, estimate_config, search_auto
from nnscaler_cst.plan.cost import load_cluster
from nnscaler_cst.plan.pipeline import plan_stages
from nnscaler_cst.rewrite import PlanRequest, rewrite

CPU = load_cluster("cpu-gloo")
WIDTH, VOCAB, LAYERS = 31, 512, 4       # odd width: no weight splits two ways
BLOCK = WIDTH * WIDTH + WIDTH           # a block's Linear
TABLE = VOCAB * WIDTH                   # the embedding: many bytes, no FLOPs
STATE = 16                              # bytes a parameter: fp32 weight, gradient, AdamW's two moments

MODEL = f'''
import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear({WIDTH}, {WIDTH})

    def forward(self, x):
        return torch.tanh(self.fc(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding({VOCAB}, {WIDTH})
        self.blocks = nn.ModuleList([Block() for _ in range({LAYERS})])

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


def build():
    return Net()


def example_inputs():
    return (torch.randint(0, {VOCAB}, (1, 3)),)
'''

# the FLOP-balanced cut's first stage holds the table and two blocks: one byte less does not fit it
BUDGET = (TABLE + 2 * BLOCK) * STATE - 1


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("cuts") / "model.py"
    path.write_text(MODEL)
    return path


def test_a_cut_that_fits_is_searched_where_the_flop_balanced_one_does_not(model):
    graph = analyze(model).graph
    assert plan_stages(graph, 2).block_ranges == [(0, 2), (2, 4)]     # the FLOP balance: 2 blocks each
    at_flops = estimate_config(graph, Config(1, 1, 2), CPU, [], BUDGET)
    assert at_flops.why_not is not None and at_flops.stage_memory[0] >= (TABLE + 2 * BLOCK) * STATE
    choice = search_auto(graph, 2, CPU, [], BUDGET, fixed=_Fixed(pp=2))
    assert choice.config.cuts == (1,), choice.config           # the table and one block on the first stage
    assert choice.best.why_not is None and choice.best.memory <= BUDGET
    assert choice.best.stage_memory[0] >= (TABLE + BLOCK) * STATE
    assert choice.best.stage_memory[1] >= 3 * BLOCK * STATE
    again = estimate_config(graph, choice.config, CPU, [], BUDGET)     # priced at its cut as the search did
    assert (again.seconds, again.memory) == (choice.best.seconds, choice.best.memory)
    # where the user gave --stages the cut is not searched: at the FLOP-balanced cut nothing fits
    with pytest.raises(UserError, match="no plan on 2 devices fits"):
        search_auto(graph, 2, CPU, [], BUDGET, fixed=_Fixed(pp=2, search_cuts=False))


def test_the_rewrite_cuts_where_the_search_chose(model):
    result = rewrite(analyze(model), PlanRequest(plan="auto", devices=2, pp=2, memory_budget=BUDGET))
    assert result.plan.auto.config.cuts == (1,)
    assert result.stages.block_ranges == [(0, 1), (1, 4)]
    assert "stages=1" in result.plan.name


# The same net with its blocks run in a recycling loop (AlphaFold2's way): pipelined under 3F1B only
RECYCLING = MODEL.replace('''        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()''', '''        x0 = self.embed(ids)
        prev = torch.zeros_like(x0)
        for cycle in range(3):
            last = cycle == 2
            with torch.set_grad_enabled(last and torch.is_grad_enabled()):
                x = self.trunk(x0 + prev)
            if not last:
                prev = x.detach()
        return x.pow(2).mean()

    def trunk(self, x):
        for block in self.blocks:
            x = block(x)
        return x''')


def test_3f1b_on_a_recycling_trunk_is_cut_where_it_fits(tmp_path):
    """3F1B's first stage holds the table and runs what comes before the trunk in every pass: the
    search cuts its stages as it cuts 1F1B's, and the rewrite takes that cut."""
    assert RECYCLING != MODEL
    path = tmp_path / "model.py"
    path.write_text(RECYCLING)
    analysis = analyze(path)
    at_flops = estimate_config(analysis.graph, Config(1, 1, 2, schedule="3f1b"), CPU, [], BUDGET)
    assert at_flops.why_not is not None and at_flops.stage_memory[0] >= (TABLE + 2 * BLOCK) * STATE
    result = rewrite(analysis, PlanRequest(plan="auto", devices=2, pp=2, memory_budget=BUDGET))
    chosen = result.plan.auto
    assert (chosen.config.schedule, chosen.config.cuts) == ("3f1b", (1,)), chosen.config
    assert chosen.best.why_not is None and chosen.best.stage_memory[0] >= (TABLE + BLOCK) * STATE
    assert result.stages.block_ranges == [(0, 1), (1, 4)] and "schedule=3f1b" in result.plan.name
