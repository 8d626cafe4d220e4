"""Pipeline stages over the iterations of a loop calling one shared layer (issue 26: ALBERT's
encoder runs one layer group again and again; a universal transformer's one layer).

The blocks are the loop's iterations, block k the layer's k-th run: each stage runs its range
of iterations (`pp_iterations`), every stage holds the layer, and its parameters' gradients are
summed over the stages (SHARED_PARAMETERS), so that the copies stay equal. Layers of a list that
the loop runs in turn (ALBERT's several layer groups) are held by the stages running their
iterations. A loop calling the layer twice per iteration is refused: its iterations are not the
layer's runs.
"""
from __future__ import annotations

import textwrap

import pytest

from nnscaler_cst.errors import UserError

UNIVERSAL = textwrap.dedent('''
    import torch
    import torch.nn as nn
    import torch.nn.functional as F


    class Layer(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.norm = nn.LayerNorm(d)
            self.fc1 = nn.Linear(d, 2 * d)
            self.fc2 = nn.Linear(2 * d, d)

        def forward(self, x):
            return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


    class Universal(nn.Module):
        def __init__(self, vocab=16, d=8, steps=4):
            super().__init__()
            self.steps = steps
            self.embed = nn.Embedding(vocab, d)
            self.layer = Layer(d)
            self.head = nn.Linear(d, vocab)
            self.head.weight = self.embed.weight

        def forward(self, ids):
            x = self.embed(ids)
            for step in range(self.steps):
                x = self.layer(x) * (1.0 + 0.1 * step)
            return F.cross_entropy(self.head(x).flatten(0, 1), ids.flatten())


    def build():
        torch.manual_seed(0)
        return Universal()


    def example_inputs():
        return (torch.randint(0, 16, (4, 3)),)
''')

LOOP_CALL = "            x = self.layer(x) * (1.0 + 0.1 * step)\n"


def analyzed(tmp_path, text: str = UNIVERSAL):
    from nnscaler_cst.analysis import analyze
    path = tmp_path / "universal.py"
    path.write_text(text)
    return analyze(path)


def test_the_stages_divide_the_iterations_and_sum_the_shared_layers_gradients(tmp_path):
    from nnscaler_cst.plan.pipeline import plan_stages
    graph = analyzed(tmp_path).graph
    plan = plan_stages(graph, 4)
    assert plan.trunk.container == "layer" and plan.trunk.iterations
    assert plan.trunk.blocks == ["layer"] * 4
    assert plan.block_ranges == [(0, 1), (1, 2), (2, 3), (3, 4)]
    # the layer's k-th run is block k, on stage k
    fc1 = [n.index for n in graph.nodes if n.callee_path == "layer.fc1"]
    assert [plan.node_stage[i] for i in fc1] == [0, 1, 2, 3]
    assert all("layer" not in drop for drop in plan.drop.values())      # every stage holds the layer
    shared = {name for group in plan.shared for name in group}
    assert shared == {f"layer.{m}.{p}" for m in ("norm", "fc1", "fc2") for p in ("weight", "bias")}
    # summed over the whole pipeline, apart from the tied embedding on the first and the last stage
    assert plan.tied == [["embed.weight", "head.weight"]] and plan.tied_ranks == []


def test_the_rank_files_run_their_stages_iterations_of_the_loop(tmp_path):
    from nnscaler_cst.rewrite import PlanRequest, rewrite
    out = rewrite(analyzed(tmp_path), PlanRequest(pp=2, micro_batches=2))
    for stage, iterations in ((0, "(0, 2)"), (1, "(2, 4)")):
        code = out.files[f"model_stage{stage}.py"]
        assert "for step in pp_iterations(range(self.steps)):" in code
        assert f"STAGE_BLOCKS = {{{stage}: {iterations}}}" in code
        assert "PIPELINE_ITERATIONS = 4" in code
        assert "SHARED_PARAMETERS = ['layer.fc1.bias'" in code


def test_a_loop_calling_the_shared_layer_twice_per_iteration_is_refused_at_the_call(tmp_path):
    from nnscaler_cst.plan.pipeline import plan_stages
    text = UNIVERSAL.replace(LOOP_CALL, "            x = self.layer(self.layer(x)) * (1.0 + 0.1 * step)\n")
    assert text != UNIVERSAL
    with pytest.raises(UserError) as refused:
        plan_stages(analyzed(tmp_path, text).graph, 2)
    assert "calling it once per iteration" in refused.value.message
    assert refused.value.location.line == text.splitlines().index(
        "            x = self.layer(self.layer(x)) * (1.0 + 0.1 * step)") + 1


GROUPS = textwrap.dedent('''
    import torch
    from torch import nn


    class Groups(nn.Module):
        # ALBERT with two layer groups: each runs half the iterations, in turn
        def __init__(self):
            super().__init__()
            self.groups = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
            self.head = nn.Linear(8, 2)

        def forward(self, x):
            for i in range(4):
                x = torch.tanh(self.groups[i // 2](x))
            return self.head(x).sum()


    def build():
        return Groups()


    def example_inputs():
        return {"x": torch.randn(4, 8)}
''')


def test_layers_a_loop_runs_in_turn_are_held_by_the_stages_running_their_iterations(tmp_path):
    from nnscaler_cst.plan.pipeline import plan_stages
    plan = plan_stages(analyzed(tmp_path, GROUPS).graph, 2)
    assert plan.trunk.iterations and plan.trunk.blocks == ["groups.0", "groups.0", "groups.1", "groups.1"]
    assert plan.block_ranges == [(0, 2), (2, 4)]
    assert "groups.1" in plan.drop[0] and "groups.0" in plan.drop[1]
    assert plan.shared == [] and plan.tied == []


@pytest.mark.slow
def test_a_pipeline_over_a_shared_layers_iterations_trains_like_one_device(tmp_path):
    import subprocess
    import sys
    path = tmp_path / "universal.py"
    path.write_text(UNIVERSAL)
    result = subprocess.run([sys.executable, "-m", "nnscaler_cst", "verify", str(path), "--pp", "2",
                             "--micro-batches", "2", "-o", str(tmp_path / "out")],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PASS" in result.stdout
