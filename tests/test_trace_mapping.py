"""Spec of trace-to-source attribution on real models: the nanoGPT-style fixture and
transformers' own GPT-2 and Llama source files, plus BERT, which the rules were not written for.

Every torch call the model makes is attributed to one exact node of the model's own source:
the node's text must be a call of what the trace says was called there (`self.c_attn(...)`
for a Conv1D, `.view(` for Tensor.view, `+` for Tensor.add), a module call must name a
submodule of that type in the built model, and the site must run inside the class that owns
the module path. Expectations come from the source text and the built model, not from the
tracer.
"""
from __future__ import annotations

import importlib
import inspect
import json
import os
import re
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import libcst as cst
import pytest
import torch

from nnscaler_cst.analysis import Analysis, analyze
from nnscaler_cst.source.files import SourceFile, Span

FIXTURE_MODELS = {"gpt": "gpt.py", "gpt2": "hf_gpt2.py", "llama": "hf_llama.py"}

# What a binary, unary, augmented or comparison operator calls, by its torch name stem.
OPERATOR_STEMS = {
    cst.Add: "add", cst.Subtract: "sub", cst.Multiply: "mul", cst.Divide: "div", cst.MatrixMultiply: "matmul",
    cst.Power: "pow", cst.Modulo: "remainder", cst.FloorDivide: "floordiv",
    cst.BitAnd: "and", cst.BitOr: "or", cst.BitXor: "xor",
    cst.AddAssign: "add", cst.SubtractAssign: "sub", cst.MultiplyAssign: "mul", cst.DivideAssign: "div",
    cst.PowerAssign: "pow", cst.ModuloAssign: "remainder", cst.FloorDivideAssign: "floordiv",
    cst.Minus: "neg", cst.BitInvert: "invert",
    cst.Equal: "eq", cst.NotEqual: "ne", cst.LessThan: "lt", cst.LessThanEqual: "le", cst.GreaterThan: "gt",
    cst.GreaterThanEqual: "ge",
}
STEM_ALIASES = {"mod": "remainder", "floor_divide": "floordiv", "truediv": "div"}

# transformers dispatches through a variable or property whose name differs from the function:
# `attention_interface = ALL_ATTENTION_FUNCTIONS[...]`, `self.loss_function` -> LOSS_MAPPING[...].
DYNAMIC_DISPATCH = {"attention_interface": {"sdpa_attention_forward"},
                    "loss_function": {"ForCausalLMLoss", "ForMaskedLMLoss"}}


# ---- analyses, one per model and test module -----------------------------------------------------
class Model:
    def __init__(self, analysis: Analysis):
        self.analysis = analysis
        self.graph = analysis.graph
        self.trace = analysis.trace
        self.module = analysis.entry.build()          # the same model, built for inspection
        self.class_file = str(Path(inspect.getsourcefile(type(self.module))).resolve())

    def source(self, path: str) -> SourceFile:
        return self.analysis.sources.get(path)

    def node(self, span: Span) -> cst.CSTNode | None:
        return self.source(span.path).node_at(span.line, span.col, span.end_line, span.end_col)


@pytest.fixture(scope="module", params=sorted(FIXTURE_MODELS))
def model(request, fixtures_dir) -> Model:
    return _analyzed(str(fixtures_dir / FIXTURE_MODELS[request.param]))


_CACHE: dict[str, Model] = {}


def _analyzed(path: str) -> Model:
    if path not in _CACHE:
        _CACHE[path] = Model(analyze(path))
    return _CACHE[path]


@pytest.fixture(scope="module")
def gpt(fixtures_dir) -> Model:
    return _analyzed(str(fixtures_dir / "gpt.py"))


@pytest.fixture(scope="module")
def gpt2(fixtures_dir) -> Model:
    return _analyzed(str(fixtures_dir / "hf_gpt2.py"))


@pytest.fixture(scope="module")
def llama(fixtures_dir) -> Model:
    return _analyzed(str(fixtures_dir / "hf_llama.py"))


# ---- what a node says it calls ----------------------------------------------------------------------
def _called_name(func: cst.BaseExpression) -> str | None:
    if isinstance(func, cst.Name):
        return func.value
    if isinstance(func, cst.Attribute):
        return func.attr.value
    return None


def _stem(callee: str) -> str:
    """Tensor.__radd__ / Tensor.add_ / torch.add -> add; Tensor.__rmod__ -> remainder."""
    name = callee.rsplit(".", 1)[-1]
    dunder = name.startswith("__") and name.endswith("__")
    name = name.strip("_")
    if dunder and name[:1] in ("r", "i") and STEM_ALIASES.get(name[1:], name[1:]) in OPERATOR_STEMS.values():
        name = name[1:]
    return STEM_ALIASES.get(name, name)


def _enclosing(source: SourceFile, span: Span, kind: type) -> cst.CSTNode | None:
    """The innermost `kind` node (ClassDef, FunctionDef) whose range contains the span."""
    best, best_start = None, None
    for node, rng in source.positions.items():
        if isinstance(node, kind):
            whole = Span(span.path, rng.start.line, rng.start.column, rng.end.line, rng.end.column)
            if whole.contains(span) and (best_start is None or (whole.line, whole.col) > best_start):
                best, best_start = node, (whole.line, whole.col)
    return best


def _import(qualified: str):
    """torch.nn.Linear, transformers.pytorch_utils.Conv1D -> the class itself."""
    parts = qualified.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(qualified)


def _self_attribute_chain(func: cst.BaseExpression) -> list[str] | None:
    """`self.transformer.wte` -> ["transformer", "wte"]; None unless rooted at `self`."""
    chain = []
    while isinstance(func, cst.Attribute):
        chain.insert(0, func.attr.value)
        func = func.value
    return chain if isinstance(func, cst.Name) and func.value == "self" and chain else None


def mismatch(model: Model, site) -> str | None:
    """Why the node at the site does not plausibly call the site's callee; None when it does."""
    source = model.source(site.span.path)
    node = model.node(site.span)
    kind = site.nodes[0].callee_kind
    callee = site.callee
    if node is None:
        return "no node"
    text = source.module.code_for_node(node).strip()
    if kind == "torch":
        if isinstance(node, cst.Call):
            ok = _called_name(node.func) == callee.rsplit(".", 1)[-1]
        elif isinstance(node, (cst.BinaryOperation, cst.UnaryOperation, cst.AugAssign)):
            ok = OPERATOR_STEMS.get(type(node.operator)) == _stem(callee)
        elif isinstance(node, cst.Comparison):
            ok = [OPERATOR_STEMS.get(type(t.operator)) for t in node.comparisons] == [_stem(callee)]
        elif isinstance(node, cst.Subscript):
            ok = callee == "Tensor.__getitem__"
        elif isinstance(node, cst.Attribute):
            ok = callee == f"Tensor.{node.attr.value}"
        else:
            ok = False
    elif kind == "function":
        name = _called_name(node.func) if isinstance(node, cst.Call) else None
        target = callee.rsplit(".", 1)[-1]
        ok = name == target or target in DYNAMIC_DISPATCH.get(name, ())
    elif kind == "module":
        ok = isinstance(node, cst.Call) and _module_call_matches(model, site, node, source)
    else:
        ok = False
    return None if ok else f"{site.span}: {callee} ({kind}) at `{text[:80]}`"


def _module_call_matches(model: Model, site, node: cst.Call, source: SourceFile) -> bool:
    cls = _import(site.callee)
    chain = _self_attribute_chain(node.func)
    if chain is not None:       # self.c_attn(x): the submodule at module_path.c_attn is a `cls`
        return all(isinstance(model.module.get_submodule(".".join(filter(None, [n.module_path, *chain]))), cls)
                   for n in site.nodes)
    if isinstance(node.func, cst.Name):     # loss_fct(...): bound in this function to `cls(...)`
        function = _enclosing(source, site.span, cst.FunctionDef)
        body = source.module.code_for_node(function)
        return re.search(rf"\b{node.func.value}\s*=\s*[\w.]*\b{cls.__name__}\(", body) is not None
    return False


# ---- every op mapped, most annotated ----------------------------------------------------------------
@pytest.mark.slow
def test_every_compute_op_is_mapped_to_a_source_node(model):
    summary = model.graph.summary()
    assert summary["compute_ops"] > 0
    assert summary["mapped"] == summary["compute_ops"]


@pytest.mark.slow
def test_every_site_resolves_to_a_node_of_the_source(model):
    assert [site.span for site in model.graph.sites.values() if model.node(site.span) is None] == []


@pytest.mark.slow
def test_at_least_95_percent_of_compute_ops_are_annotated(model):
    summary = model.graph.summary()
    assert summary["annotated"] >= 0.95 * summary["compute_ops"]


@pytest.mark.slow
def test_every_site_is_in_the_models_own_source_not_in_a_library(model):
    own = {model.class_file, str(model.analysis.entry.path)}
    assert {site.span.path for site in model.graph.sites.values()} <= own


# ---- attributed to the right node --------------------------------------------------------------------
@pytest.mark.slow
def test_every_site_node_calls_what_the_trace_says_was_called(model):
    problems = [p for site in model.graph.sites.values() if (p := mismatch(model, site))]
    assert problems == []


@pytest.mark.slow
def test_every_site_runs_inside_the_class_of_its_module_path(model):
    wrong = []
    for site in model.graph.sites.values():
        classdef = _enclosing(model.source(site.span.path), site.span, cst.ClassDef)
        if classdef is None:        # a free function (rotate_half): runs for whichever module called it
            continue
        for node in site.nodes:
            owner = model.module.get_submodule(node.module_path)
            if classdef.name.value not in [c.__name__ for c in type(owner).__mro__]:
                wrong.append(f"{site.span} in class {classdef.name.value}, module {node.module_path!r}")
    assert wrong == []


@pytest.mark.parametrize("callee, func_text", [
    ("transformers.pytorch_utils.Conv1D", "self.c_attn"),
    ("transformers.pytorch_utils.Conv1D", "self.c_proj"),
    ("transformers.integrations.sdpa_attention.sdpa_attention_forward", "attention_interface"),
    ("transformers.loss.loss_utils.ForCausalLMLoss", "self.loss_function"),
])
def test_gpt2_library_helpers_are_attributed_to_the_model_file_call_that_entered_them(gpt2, callee, func_text):
    funcs = set()
    for site in gpt2.graph.sites.values():
        if site.callee == callee:
            node = gpt2.node(site.span)
            assert site.span.path == gpt2.class_file
            funcs.add(gpt2.source(site.span.path).module.code_for_node(node.func))
    assert func_text in funcs


def test_llama_attention_is_attributed_to_the_attention_interface_call(llama):
    [site] = [s for s in llama.graph.sites.values()
              if s.callee == "transformers.integrations.sdpa_attention.sdpa_attention_forward"]
    node = llama.node(site.span)
    assert isinstance(node, cst.Call) and _called_name(node.func) == "attention_interface"
    assert {n.module_path for n in site.nodes} == {f"model.layers.{i}.self_attn"
                                                   for i in range(llama.module.config.num_hidden_layers)}


# ---- parameters ------------------------------------------------------------------------------------------
def constructor_problems(model: Model) -> list[str]:
    """Parameters whose ctor_span is not the constructor call assigned to their attribute."""
    wrong = []
    for info in model.trace.params.values():
        span = info.ctor_span
        if span is None or span.path != model.class_file:
            wrong.append(f"{info.name}: constructed at {span}")
            continue
        node = model.node(span)
        constructor = info.module_type.rsplit(".", 1)[-1]      # Linear, Conv1D, Embedding, Parameter
        if not (isinstance(node, cst.Call) and _called_name(node.func) == constructor):
            wrong.append(f"{info.name}: {info.module_type} at {span}")
            continue
        # the constructor's result is assigned to the attribute the parameter is reached by
        before = model.source(span.path).lines[span.line - 1][:span.col]
        target = re.search(r"(?:self\.)?(\w+)\s*=\s*$", before)
        owners = {alias.split(".")[-1 if constructor == "Parameter" else -2] for alias in info.aliases}
        if target is None or target.group(1) not in owners:
            wrong.append(f"{info.name}: `{before.strip()}` assigns none of {sorted(owners)}")
    return wrong


@pytest.mark.slow
def test_every_parameter_points_at_the_constructor_call_that_made_it(model):
    assert constructor_problems(model) == []


@pytest.mark.slow
def test_every_parameter_of_the_built_model_is_traced_once(model):
    built = dict(model.module.named_parameters(remove_duplicate=False))
    traced = [alias for info in model.trace.params.values() for alias in info.aliases]
    assert sorted(traced) == sorted(built)
    assert len(model.trace.params) == len(list(model.module.parameters()))


@pytest.mark.parametrize("fixture, tied", [
    ("gpt", {"transformer.wte.weight", "lm_head.weight"}),
    ("gpt2", {"transformer.wte.weight", "lm_head.weight"}),
])
def test_tied_weights_are_one_parameter_with_both_names(request, fixture, tied):
    model = request.getfixturevalue(fixture)
    holders = [info for info in model.trace.params.values() if set(info.aliases) & tied]
    assert len(holders) == 1 and set(holders[0].aliases) == tied


def test_gpt_tied_weight_was_constructed_by_lm_head_not_the_embedding(gpt):
    # GPT assigns lm_head's weight to wte, so the surviving tensor is the one nn.Linear made.
    [info] = [i for i in gpt.trace.params.values() if "lm_head.weight" in i.aliases]
    assert info.module_type == "torch.nn.Linear"
    line = gpt.source(info.ctor_span.path).lines[info.ctor_span.line - 1]
    assert line.strip().startswith("self.lm_head = nn.Linear(")


# ---- repeated blocks ------------------------------------------------------------------------------------
def _layers(module: torch.nn.Module) -> int:
    config = module.config
    return getattr(config, "n_layer", None) or config.num_hidden_layers


@pytest.mark.parametrize("fixture, kind, container", [
    ("gpt", "Block", "transformer.h"),
    ("gpt2", "GPT2Block", "transformer.h"),
    ("llama", "LlamaDecoderLayer", "model.layers"),
])
def test_repeated_blocks_are_detected(request, fixture, kind, container):
    model = request.getfixturevalue(fixture)
    expected = [f"{container}.{i}" for i in range(_layers(model.module))]
    assert model.graph.blocks == {f"{kind} ({container}.*)": expected}


def test_a_site_in_a_repeated_block_is_one_site_run_by_every_block(gpt):
    [site] = [s for s in gpt.graph.sites.values()
              if s.callee == "torch.nn.Linear" and "c_attn" in gpt.source(s.span.path).lines[s.span.line - 1]]
    assert sorted(n.module_path for n in site.nodes) == [f"transformer.h.{i}.attn" for i in range(_layers(gpt.module))]


# ---- the inspect --json view -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def inspect_json(repo_root) -> dict[str, dict]:
    """`inspect --json` of every fixture model, run from the repository root, in parallel."""
    def run(name):
        result = subprocess.run([sys.executable, "-m", "nnscaler_cst.cli", "inspect", f"fixtures/{name}", "--json"],
                                cwd=repo_root, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        return dict(zip(FIXTURE_MODELS, pool.map(run, FIXTURE_MODELS.values())))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(FIXTURE_MODELS))
def test_inspect_json_summary_counts_ops_as_integers(inspect_json, name):
    summary = inspect_json[name]["summary"]
    assert all(type(summary[key]) is int for key in ("compute_ops", "mapped", "annotated", "sites"))
    assert summary["mapped"] == summary["compute_ops"] > 0
    assert summary["annotated"] >= 0.95 * summary["compute_ops"]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(FIXTURE_MODELS))
def test_inspect_json_has_one_entry_per_site(inspect_json, name, fixtures_dir, repo_root):
    report = inspect_json[name]
    model = _analyzed(str(fixtures_dir / FIXTURE_MODELS[name]))

    def shown(path: str) -> str:
        path = Path(path)
        return str(path.relative_to(repo_root)) if path.is_relative_to(repo_root) else str(path)

    expected = sorted(f"{shown(span.path)}:{span.line}:{span.col + 1} {callee}" for span, callee in model.graph.sites)
    assert len(report["sites"]) == report["summary"]["sites"]
    assert sorted(f"{s['location']} {s['callee']}" for s in report["sites"]) == expected


# ---- Python operators ------------------------------------------------------------------------------------
OPERATORS_MODEL = """
    import torch
    import torch.nn as nn


    class Operators(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(8))

        def forward(self, x):
            y = x * self.w
            a = (y + 1) - (2 - y) + 1 / (y * y + 1) - y / 3 + y ** 2 + 2 ** y - (-y) + 2 * y
            z = y.detach()                      # no gradient through // and %
            b = z // 3 + 2 // (z.abs() + 1) + z % 3 + 5 % (z.abs() + 1)
            m = (y >= 0) & (y <= 1) | (y < 0) ^ (y > 1) | (y == 0) | ~(y != 0)
            a -= 1
            a *= 2
            a /= 2
            a += 1
            a **= 1
            b //= 1
            b %= 3
            return (a * m).sum() + b.sum()


    def build():
        return Operators()


    def example_inputs():
        return (torch.randn(4, 8),)
"""


@pytest.fixture(scope="module")
def operators(tmp_path_factory) -> Model:
    path = tmp_path_factory.mktemp("operators") / "operators.py"
    path.write_text(textwrap.dedent(OPERATORS_MODEL).lstrip("\n"))
    return _analyzed(str(path))


def test_every_python_operator_on_tensors_maps_to_its_operator_expression(operators):
    assert [p for site in operators.graph.sites.values() if (p := mismatch(operators, site))] == []


def test_every_python_operator_on_tensors_is_annotated(operators):
    # all of them are elementwise; a missing rule would leave the op replicated
    unannotated = {site.callee: site.problem for site in operators.graph.sites.values() if site.dims is None}
    assert unannotated == {}


# ---- a model the rules were not written for ---------------------------------------------------------------
BERT_ENTRY = """
    import torch
    from transformers import BertConfig, BertForMaskedLM


    def build():
        config = BertConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=128, max_position_embeddings=64,
                            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        return BertForMaskedLM(config)


    def example_inputs():
        input_ids = torch.randint(0, 256, (4, 16))
        return {"input_ids": input_ids, "labels": input_ids}
"""


@pytest.fixture(scope="module")
def bert(tmp_path_factory) -> Model:
    path = tmp_path_factory.mktemp("bert") / "bert_entry.py"
    path.write_text(textwrap.dedent(BERT_ENTRY).lstrip("\n"))
    return _analyzed(str(path))


@pytest.mark.slow
def test_bert_every_compute_op_is_mapped(bert):
    summary = bert.graph.summary()
    assert summary["compute_ops"] > 0 and summary["mapped"] == summary["compute_ops"]


@pytest.mark.slow
def test_bert_at_least_95_percent_annotated_measured_100(bert):
    summary = bert.graph.summary()
    assert summary["annotated"] >= 0.95 * summary["compute_ops"]


@pytest.mark.slow
def test_bert_every_site_node_calls_what_the_trace_says_was_called(bert):
    assert [p for site in bert.graph.sites.values() if (p := mismatch(bert, site))] == []


@pytest.mark.slow
def test_bert_parameters_point_at_their_constructors(bert):
    assert constructor_problems(bert) == []


@pytest.mark.slow
def test_bert_layers_are_detected_as_repeated_blocks(bert):
    layers = bert.module.config.num_hidden_layers
    assert bert.graph.blocks == {"BertLayer (bert.encoder.layer.*)": [f"bert.encoder.layer.{i}" for i in range(layers)]}
