"""A rule's dims are instantiated once per distinct call and copied for each equal one
(graph/oprules.py annotate's `seen`): every copy equals what instantiating its own call gives,
with its own tensor ids, and shares nothing mutable with another node's dims."""
from __future__ import annotations

import pytest

from nnscaler_cst.analysis import analyze
from nnscaler_cst.graph.oprules import annotate

MODEL = '''
import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, x):
        h = self.up(x)
        h = h * h                       # one tensor twice: the copy keeps it one tensor
        return x + self.down(torch.cat([h, h], dim=-1)[..., :h.shape[-1]])


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block(4) for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def build():
    return Model()


def example_inputs():
    return (torch.randn(2, 4),)


def loss(out):
    return out.sum()
'''


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    path = tmp_path_factory.mktemp("once") / "model.py"
    path.write_text(MODEL)
    return analyze(path).graph


def test_each_node_gets_the_dims_its_own_call_instantiates(graph):
    seen: dict = {}
    copied = 0
    for node in graph.trace.nodes:
        before = len(seen)
        rule, dims, problem = annotate(node, graph.trace, graph.rules, seen)
        fresh = annotate(node, graph.trace, graph.rules)
        assert (rule, dims, problem) == fresh
        copied += dims is not None and len(seen) == before
    assert copied >= 2 * 5          # the second and third block's calls are copies


def test_copies_share_no_mutable_part(graph):
    seen: dict = {}
    squares = [node for node in graph.trace.nodes if node.callee == "Tensor.mul"]
    first, second = (annotate(node, graph.trace, graph.rules, seen)[1] for node in squares[:2])
    assert first == annotate(squares[0], graph.trace, graph.rules)[1]
    assert first.inputs["arg0"].tid != second.inputs["arg0"].tid
    # x * x: one tensor, its two operands labelled alike in both
    assert first.inputs["arg0"].dims == first.inputs["arg1"].dims
    assert second.inputs["arg0"].dims == second.inputs["arg1"].dims
    second.outputs[0].dims.clear()
    second.reduced.add("k")
    assert first.outputs[0].dims and "k" not in first.reduced
    third = annotate(squares[2], graph.trace, graph.rules, seen)[1]
    assert third.outputs[0].dims and "k" not in third.reduced


@pytest.mark.parametrize("fixture", ["gpt.py", "evoformer.py"])
def test_layouts_kept_per_structure_equal_each_invocations_own(fixture):
    """The search derives an invocation's layouts and signature once per _structure (plan/search.py):
    for every invocation and label, what it is handed equals what its own dims give."""
    from pathlib import Path
    from nnscaler_cst.plan import search
    from nnscaler_cst.plan.layouts import REPLICATE, layouts_for
    graph = analyze(Path(__file__).resolve().parents[1] / "fixtures" / fixture).graph
    search._refined(graph)
    checked = 0
    for node in graph.nodes:
        i = node.index
        dims = graph.dims.get(i)
        names = search._kept_operand_names(graph, i)
        operands = frozenset(names)
        for label in [REPLICATE, *(dims.splittable() if dims is not None else [])]:
            own = layouts_for(dims, label, names)
            kept = search._layout(graph, i, label)
            assert (kept.inputs, kept.outputs, kept.split) == (own.inputs, own.outputs, own.split), (fixture, i, label)
            signature = search._signature(graph, i, label, operands, len(node.outputs), search._structure(graph, i))
            assert signature == search._derived_signature(graph, i, label, operands, len(node.outputs))
            checked += 1
    structures = len(set(search._search_cache(graph)["structure numbers"].values()))
    assert checked > len(graph.nodes) and structures < len(graph.nodes)    # some shared, as a block's repeats


# blocks each holding a parameter built by a factory in the model file (recorded for warnings)
GAINS = MODEL.replace("self.up = nn.Linear(d, 2 * d)", "self.up = nn.Linear(d, 2 * d)\n        self.gain = nn.Parameter(torch.ones(d))") \
    .replace("return x + self.down(", "return x * self.gain + self.down(")


@pytest.mark.parametrize("fixture", ["gpt.py", "evoformer.py", "vit.py", "gains"])
def test_candidates_shared_by_alike_invocations_equal_each_invocations_own(fixture, monkeypatch, tmp_path):
    """The search derives one candidate list per structure and _split_context (plan/search.py): the
    sites, their groups and the warnings' record of factory-built parameters are those every
    invocation deriving its own gives."""
    from pathlib import Path
    from nnscaler_cst.plan import search
    path = Path(__file__).resolve().parents[1] / "fixtures" / fixture
    if fixture == "gains":
        path = tmp_path / "model.py"
        path.write_text(GAINS)

    def derived(share: bool):
        monkeypatch.setattr(search, "SHARE_CANDIDATES", share)
        graph = analyze(path).graph
        found = {every: search.line_candidates(graph, every) for every in (False, True)}
        cache = search._search_cache(graph)
        return found, cache.get("factory_sizes"), len(cache.get(("candidates by context", False), {})), len(graph.nodes)
    shared, sizes, contexts, nodes = derived(True)
    own, own_sizes, _, _ = derived(False)
    assert shared == own and sizes == own_sizes
    assert 0 < contexts < nodes / 2       # a block's repeats share one derivation
