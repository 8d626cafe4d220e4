"""Models written in other styles: layers called by nn.Sequential, batches that cannot be sliced,
layers no rule can split, writes by index (`x[:, 0] = v`), and research-style decoders
(complex rotary embeddings, kv heads widened with `expand`, `mask.type_as(x)`), and an
AlphaFold2-style trunk (fixtures/evoformer.py: MSA and pair representations, attention with a
pair bias, outer-product mean, triangle updates, einsum everywhere, recycling without gradients).

A call to an nn.Sequential from the model file is traced as calls to each of its layers, so
the planner sees (and may split) every layer; when collectives must sit between layers, the
rewrite cuts the call into runs of the container (`self.features[3:](tp_copy(...))`), keeping
the state dict keys. Data parallelism and micro-batches slice the batch, which is refused at
the op that would mix samples (a value reduced over the batch meeting the batch; BatchNorm under
micro-batches: data-parallel ranks sum its statistics, see test_coverage_causes.py).
A layer holding weights that no rule splits (an nn.LSTM with projections) stays whole on every
tensor-parallel rank, with a warning at its call, instead of making the plan unsatisfiable.

The gloo runs are marked slow.
"""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from nnscaler_cst.analysis import analyze
from nnscaler_cst.plan.batch import batch_split_problem
from nnscaler_cst.report.inspect_view import inspect_json

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 600


def cli(*args, cwd: Path = REPO) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200", "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "nnscaler_cst.cli", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S)


def statement_with(source: str, needle: str) -> str:
    lines = [line.strip() for line in source.splitlines() if needle in line]
    assert len(lines) == 1, f"{needle!r} is on {len(lines)} lines"
    return lines[0]


# ---- tracing through nn.Sequential -----------------------------------------------------------
def test_each_layer_of_an_nn_sequential_is_a_site_of_its_own(fixtures_dir):
    report = inspect_json(analyze(fixtures_dir / "convnet.py").graph)
    features = [s for s in report["sites"] if s["layer"]]
    # nn.Sequential(Conv2d, ReLU, MaxPool2d, Conv2d, ReLU, AdaptiveAvgPool2d), as the model built it
    assert [(s["layer"], s["callee"].rsplit(".", 1)[1]) for s in features] == [
        ("[0]", "Conv2d"), ("[1]", "ReLU"), ("[2]", "MaxPool2d"),
        ("[3]", "Conv2d"), ("[4]", "ReLU"), ("[5]", "AdaptiveAvgPool2d")]
    source = (fixtures_dir / "convnet.py").read_text().splitlines()
    line = next(i for i, text in enumerate(source, 1) if "self.features(images)" in text)
    assert {s["location"].rsplit(":", 2)[1] for s in features} == {str(line)}   # all at that call
    assert all(s["annotation"] for s in report["sites"])
    summary = report["summary"]
    assert summary["mapped"] == summary["annotated"] == summary["compute_ops"]


def test_a_layer_gets_the_parameters_of_its_own_module(fixtures_dir):
    graph = analyze(fixtures_dir / "einsum_transformer.py").graph
    linear = next(n for n in graph.nodes if n.span is not None and n.span.via == ("1",))
    assert linear.callee == "torch.nn.Linear" and linear.callee_path == "head.1"
    shapes = {name: graph.trace.tensors[tid].shape for name, tid in graph.param_operands(linear.index)}
    assert shapes == {"self.weight": (96, 32), "self.bias": (96,)}


# ---- rewriting between the layers --------------------------------------------------------------
@pytest.fixture(scope="module")
def convnet_tp2(tmp_path_factory, fixtures_dir):
    out = tmp_path_factory.mktemp("convnet") / "tp2"
    result = cli("rewrite", fixtures_dir / "convnet.py", "--tp", "2", "-o", out)
    assert result.returncode == 0, result.stderr
    return out


@pytest.mark.slow
def test_the_sequential_call_is_cut_only_where_a_collective_goes(convnet_tp2):
    source = (convnet_tp2 / "model.py").read_text()
    ast.parse(source)
    line = statement_with(source, "self.features[")
    call = line.split("  #")[0]
    # the first conv is split by output channel, the second by input channel: one gather between
    assert call.startswith("x = self.features[3:](") and "self.features[:3](images)" in call, call
    assert call.count("tp_gather(") == 1
    assert "nn.Conv2d(3, 8 // 2, 3, padding=1)" in source


@pytest.mark.slow
def test_cut_sequential_keeps_the_single_device_state_dict_keys(convnet_tp2, fixtures_dir):
    code = textwrap.dedent(f"""
        import importlib, json, sys
        sys.path.insert(0, {str(convnet_tp2.parent)!r})
        package = importlib.import_module({convnet_tp2.name!r})
        sys.path.insert(0, {str(fixtures_dir)!r})
        import convnet
        print(json.dumps([sorted(package.build(0).state_dict()), sorted(convnet.build().state_dict())]))
        """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT_S)
    assert result.returncode == 0, result.stderr
    rank_keys, model_keys = json.loads(result.stdout)
    assert rank_keys == model_keys


@pytest.mark.slow
def test_a_sequential_with_a_split_implementation_between_layers(tmp_path, fixtures_dir):
    out = tmp_path / "out"
    result = cli("rewrite", fixtures_dir / "einsum_transformer.py", "--tp", "2", "-o", out)
    assert result.returncode == 0, result.stderr
    line = statement_with((out / "model.py").read_text(), "self.head[")
    assert line.startswith("logits = self.head[1](tp_copy(self.head[0](h), TP))"), line


@pytest.mark.slow
def test_a_fused_qkv_reshaped_into_3_heads_and_head_dim_splits_by_heads(tmp_path, fixtures_dir):
    """timm's `qkv(x).reshape(B, N, 3, heads, hd)`: the heads, not the leading 3, are split (the
    Linear's rows in 3 groups), and unbind keeps the batch where it is (data parallel accepted)."""
    out = tmp_path / "out"
    result = cli("rewrite", fixtures_dir / "vit.py", "--tp", "2", "--dp", "2", "-o", out)
    assert result.returncode == 0, result.stderr
    source = (out / "model.py").read_text()
    assert "self.qkv = nn.Linear(dim, dim * 3 // 2)  # out_features / 2, 3 fused blocks split alike" in source
    assert ".reshape(B, N, 3, self.heads // 2, C // self.heads)" in source
    layers = json.loads((out / "plan.json").read_text())["op_trans"]
    mlp = sorted((t["site"][-3:], t["algo"]) for t in layers if t["axis"] == "tp" and t["callee"] == "torch.nn.Linear"
                 and t["site"].endswith(("[0]", "[2]")))
    assert [site for site, _ in mlp] == ["[0]", "[2]"] and mlp[0][1] != mlp[1][1]   # column, then row


# ---- a Sequential trunk for pipelines ----------------------------------------------------------
@pytest.mark.slow
def test_a_pipeline_cuts_an_nn_sequential_of_blocks(tmp_path, fixtures_dir):
    out = tmp_path / "out"
    result = cli("rewrite", fixtures_dir / "residual_mlp.py", "--pp", "2", "-o", out)
    assert result.returncode == 0, result.stderr
    ranges = []
    for stage in range(2):
        source = (out / f"model_stage{stage}.py").read_text()
        assert "x = self.blocks(x)  # pipeline: this stage's blocks of blocks only" in source
        ranges += ast.literal_eval(statement_with(source, "STAGE_BLOCKS = ").split("=", 1)[1].split("#")[0]).values()
    (a, b), (c, d) = ranges
    assert a == 0 and b == c and d == 4 and 0 < b < 4, ranges      # the 4 blocks, cut once


@pytest.mark.slow
def test_a_sequential_trunk_inside_a_return_is_moved_onto_its_own_line_and_verifies(tmp_path, fixtures_dir):
    model = tmp_path / "model.py"
    model.write_text((fixtures_dir / "residual_mlp.py").read_text().replace(
        "        x = self.blocks(x)\n        return self.out(x).pow(2).mean()",
        "        return self.out(self.blocks(x)).pow(2).mean()"))
    result = cli("verify", model, "--pp", "2", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    source = (tmp_path / "parallel" / "model_stage0.py").read_text()
    assert "x = self.blocks(x)  # pipeline: this stage's blocks of blocks only" in source


def test_a_sequential_trunk_whose_input_is_read_again_in_its_expression_is_refused(tmp_path, fixtures_dir):
    # moving the call onto a line `x = self.blocks(x)` would change what the later `x` reads
    model = tmp_path / "model.py"
    model.write_text((fixtures_dir / "residual_mlp.py").read_text().replace(
        "        x = self.blocks(x)\n        return self.out(x).pow(2).mean()",
        "        return (self.out(self.blocks(x)) + x.sum()).pow(2).mean()"))
    result = cli("rewrite", model, "--pp", "2", "-o", tmp_path / "out", cwd=tmp_path)
    assert result.returncode == 2
    line = next(i for i, l in enumerate(model.read_text().splitlines(), 1) if "self.blocks(x)" in l)
    assert f"model.py:{line}:" in result.stderr and "x = self.blocks(x)" in result.stderr
    assert not (tmp_path / "out").exists()


# ---- batches that cannot be sliced ----------------------------------------------------------------
BATCHNORM = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 2)

    def forward(self, x, t):
        h = torch.relu(self.bn(self.conv(x))).mean(dim=(2, 3))
        return nn.functional.cross_entropy(self.fc(h), t)


def build():
    return Net()


def example_inputs():
    return torch.randn(8, 3, 8, 8), torch.randint(0, 2, (8,))
'''

CENTERED = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        h = h - h.SUMMARY(dim=0)
        return h.pow(2).mean()


def build():
    return Net()


def example_inputs():
    return (torch.randn(8, 4),)
'''


@pytest.mark.parametrize("source, needle, why", [
    (CENTERED.replace("SUMMARY", "mean"), "h.mean(", "Tensor.mean needs the whole batch"),
    (CENTERED.replace("SUMMARY", "sum"), "h - h.sum(", "combines a value reduced over the batch"),
], ids=["batch-mean", "minus-the-batch-sum"])
@pytest.mark.slow
def test_data_parallel_over_an_op_that_mixes_samples_is_refused(tmp_path, source, needle, why):
    model = tmp_path / "model.py"
    model.write_text(source.lstrip("\n"))
    result = cli("rewrite", model, "--dp", "2", "-o", tmp_path / "out", cwd=tmp_path)
    assert result.returncode == 2, result.stdout
    lines = model.read_text().splitlines()
    number = next(i for i, l in enumerate(lines, 1) if needle in l)
    column = lines[number - 1].index(needle) + 1
    assert f"model.py:{number}:{column}: error: " in result.stderr and why in result.stderr, result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_the_same_models_rewrite_without_data_parallel(tmp_path):
    model = tmp_path / "model.py"
    model.write_text(BATCHNORM.lstrip("\n"))
    assert cli("rewrite", model, "--tp", "2", "-o", tmp_path / "out", cwd=tmp_path).returncode == 0


@pytest.mark.slow
def test_auto_plans_around_a_batch_that_cannot_be_sliced(tmp_path):
    model = tmp_path / "model.py"
    model.write_text(CENTERED.replace("SUMMARY", "mean").lstrip("\n"))
    result = cli("plan", model, "--plan", "auto", "--devices", "2", "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout[result.stdout.find("{"):])
    assert plan["mesh"]["dp"] == 1 and plan["mesh"]["tp"] == 2, plan["mesh"]


# ---- layers no rule can split ------------------------------------------------------------------
ATTENTION = '''
import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, h, batch_first=True)   # its key bias has a zero gradient
        self.ff = nn.ModuleDict({"up": nn.Linear(d, 2 * d), "down": nn.Linear(2 * d, d)})

    def forward(self, x):
        y = self.ln(x)
        y, _ = self.attn(y, y, y, need_weights=False)
        x = x + y
        return x + self.ff["down"](torch.relu(self.ff["up"](x)))


class Model(nn.Module):
    def __init__(self, d=16, h=2, n=2):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, h) for _ in range(n))
        self.proj = nn.Linear(d, 4)

    def forward(self, x, y):
        for blk in self.blocks:
            x = blk(x)
        return {"loss": nn.functional.mse_loss(self.proj(x), y)}


def build():
    torch.manual_seed(0)
    return Model()


def example_inputs():
    torch.manual_seed(1)
    return torch.randn(4, 8, 16), torch.randn(4, 8, 4)


def loss(out):
    return out["loss"]
'''


@pytest.fixture
def recurrent_model(tmp_path) -> Path:
    model = tmp_path / "model.py"
    model.write_text(ATTENTION.lstrip("\n").replace(
        "nn.MultiheadAttention(d, h, batch_first=True)", "nn.LSTM(d, 2 * d, batch_first=True, proj_size=d)").replace(
        "self.attn(y, y, y, need_weights=False)", "self.attn(y)"))
    return model


@pytest.mark.slow
def test_a_layer_no_rule_splits_stays_whole_with_a_warning(recurrent_model, tmp_path):
    out = tmp_path / "out"
    result = cli("rewrite", recurrent_model, "--tp", "2", "-o", out, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = recurrent_model.read_text().splitlines()
    number = next(i for i, l in enumerate(lines, 1) if "self.attn(" in l)
    where = f"model.py:{number}:{lines[number - 1].index('self.attn(') + 1}"
    assert f"{where}: warning: torch.nn.LSTM is replicated" in result.stderr, result.stderr
    plan = json.loads((out / "plan.json").read_text())
    assert any(w.startswith(where) for w in plan["warnings"])
    layouts = {name: info["tp"] for name, info in plan["params"].items()}
    assert layouts["blocks.0.attn.weight_ih_l0"] == "R"
    assert layouts["blocks.0.ff.up.weight"] != "R"          # the rest still follows Megatron


BERT_WITH_DROPOUT = '''
import torch
from transformers import BertConfig, BertForMaskedLM


def build():
    # transformers' default dropout (0.1 on hidden states and attention probabilities)
    config = BertConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=64)
    return BertForMaskedLM(config)


def example_inputs():
    ids = torch.randint(0, 256, (4, 16))
    return {"input_ids": ids, "labels": ids}
'''

SCALED_EMBEDDING = '''
import torch
import torch.nn as nn
import torch.nn.functional as F


class ScaledEmbedding(nn.Embedding):
    """A word embedding that scales its rows: its forward reaches nn.Embedding's by super()."""

    def __init__(self, vocab, dim, padding_idx, scale):
        super().__init__(vocab, dim, padding_idx)
        self.scale = scale

    def forward(self, ids):
        return super().forward(ids) * self.scale


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


class LM(nn.Module):
    def __init__(self, vocab=128, dim=32):
        super().__init__()
        self.embed = ScaledEmbedding(vocab, dim, padding_idx=0, scale=dim ** 0.5)
        self.blocks = nn.ModuleList([Block(dim) for _ in range(2)])
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids, labels):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def build():
    return LM()


def example_inputs():
    ids = torch.randint(0, 128, (4, 16))
    return ids, ids
'''


LAYER_SCALE = '''
import torch
import torch.nn as nn


class Config:
    hidden = 16
    inner = 32
    layer_scale_init_value = 0.1


class Block(nn.Module):
    """An MLP whose hidden features are scaled by parameters made in the ways models write them:
    BEiT/Data2Vec's `init_values * torch.ones(n)`, CaiT's `torch.full`, ConvNeXt's `torch.ones(n) * v`."""

    def __init__(self, config):
        super().__init__()
        self.inner = config.inner
        inner = config.inner
        shape = (inner,)
        self.up = nn.Linear(config.hidden, config.inner)
        self.down = nn.Linear(config.inner, config.hidden)
        self.lambda_1 = nn.Parameter(config.layer_scale_init_value * torch.ones(config.inner), requires_grad=True)
        self.gamma = nn.Parameter(torch.full((inner,), 0.5))
        self.scale = nn.Parameter(torch.ones(self.inner) * 0.9)
        self.shift = nn.Parameter(torch.zeros(inner))
        self.gain = nn.Parameter(data=torch.ones(size=(config.inner,)) + 1.0)
        self.jitter = nn.Parameter(torch.empty(inner).uniform_(0.5, 1.5))
        self.tail = nn.Parameter(torch.ones(shape) * 0.7)      # a whole shape by name: stays whole

    def forward(self, x):
        h = torch.relu(self.up(x)) * self.lambda_1 + self.shift
        h = h * self.gamma * self.scale * self.gain * self.jitter * self.tail
        return x + self.down(h)


class Model(nn.Module):
    def __init__(self, config=Config()):
        super().__init__()
        self.blocks = nn.ModuleList([Block(config) for _ in range(2)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def build():
    return Model()


def example_inputs():
    return {"x": torch.randn(4, 8, 16)}
'''


ENTRIES = {"attention": ATTENTION, "bert": BERT_WITH_DROPOUT, "scaled-embedding": SCALED_EMBEDDING,
           "layer-scale": LAYER_SCALE}


def test_layer_scale_parameters_are_built_at_their_local_size_or_kept_whole(tmp_path):
    """A parameter a tensor factory makes in __init__ (a layer scale) and the plan splits is built at
    its local size: the factory's size argument is divided, whatever form the call takes. One whose
    size cannot be found (`torch.ones(shape)`, shape a tuple) stays whole, with a warning at its
    line, instead of refusing the rewrite."""
    from nnscaler_cst.rewrite import PlanRequest, rewrite
    (tmp_path / "layer_scale.py").write_text(LAYER_SCALE.lstrip("\n"))
    result = rewrite(analyze(tmp_path / "layer_scale.py"), PlanRequest(tp=2))
    model = result.files["model.py"]
    for local in ["nn.Parameter(config.layer_scale_init_value * torch.ones(config.inner // 2), requires_grad=True)",
                  "nn.Parameter(torch.full((inner // 2,), 0.5))", "nn.Parameter(torch.ones(self.inner // 2) * 0.9)",
                  "nn.Parameter(torch.zeros(inner // 2))", "nn.Parameter(data=torch.ones(size=(config.inner // 2,)) + 1.0)",
                  "nn.Parameter(torch.empty(inner // 2).uniform_(0.5, 1.5))"]:
        assert local in model
    assert "self.tail = nn.Parameter(torch.ones(shape) * 0.7)" in model
    line = next(i for i, text in enumerate(LAYER_SCALE.lstrip("\n").splitlines(), 1) if "self.tail =" in text)
    warned = [w for w in result.plan.warnings if "blocks.0.tail" in w]
    assert len(warned) == 1 and f"layer_scale.py:{line}:" in warned[0] and "stays whole" in warned[0], warned


# ---- writes by index ---------------------------------------------------------------------------
def test_a_write_by_index_is_an_op_whose_result_needs_the_written_values_gradient(fixtures_dir):
    """`x[:, 0] = self.cls_token` makes x depend on a parameter: without the write in the graph, the
    planner sees an input that needs no gradient and leaves out the backward all-reduce."""
    graph = analyze(fixtures_dir / "indexed_writes.py").graph
    trace = graph.trace
    writes = [n for n in graph.nodes if n.callee == "Tensor.__setitem__"]
    assert len(writes) == 3
    cls_token = trace.tensors[trace.params["cls_token"].tid]
    first = writes[0]
    assert cls_token.tid in first.inputs
    assert all(trace.tensors[t].requires_grad for t in first.outputs)
    summary = inspect_json(graph)["summary"]
    assert summary["annotated"] == summary["compute_ops"]


# ---- research-style decoders ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def rotary_graph(fixtures_dir):
    return analyze(fixtures_dir / "complex_rotary.py").graph


@pytest.mark.slow
def test_a_tensor_read_only_for_its_dtype_is_no_input_of_the_call(rotary_graph):
    """`mask.type_as(x)` reads x's dtype, not its data: x's batch and layout must not constrain it."""
    graph = rotary_graph
    casts = [n for n in graph.nodes if n.callee == "Tensor.type_as" and n.module_path == ""]
    assert casts, "the mask cast is a site"
    mask_cast = casts[0]
    assert [graph.trace.tensors[t].shape for t in mask_cast.inputs] == [(16, 16)]
    assert mask_cast.operand("arg1").value == torch.float32


def test_batches_pass_through_complex_rotary_and_widened_kv_heads(rotary_graph):
    assert batch_split_problem(rotary_graph, "data parallel") is None


LEADING_DIMS_ATTENTION = """import torch
import torch.nn as nn


class Attention(nn.Module):
    def __init__(self, c=16, heads=4):
        super().__init__()
        self.heads, self.c_head = heads, c // heads
        self.q, self.k, self.v = nn.Linear(c, c), nn.Linear(c, c), nn.Linear(c, c)
        self.out = nn.Linear(c, c)

    def forward(self, x):
        *lead, n, _ = x.shape
        q = self.q(x).view(*lead, n, self.heads, self.c_head).transpose(-2, -3)
        k = self.k(x).view((*lead, n, self.heads, self.c_head)).transpose(-2, -3)
        v = self.v(x).reshape(*lead, n, self.heads, -1).transpose(-2, -3)
        o = (q @ k.transpose(-1, -2)).softmax(-1) @ v
        return self.out(o.transpose(-2, -3).reshape(*lead, n, self.heads * self.c_head)).square().mean()


def build():
    return Attention()


def example_inputs():
    return {"x": torch.randn(2, 3, 5, 16)}
"""


def test_sizes_after_a_starred_leading_shape_are_made_local_from_the_end(tmp_path):
    """`view(*lead, n, self.heads, self.c_head)` (AlphaFold/OpenFold style): the heads size is
    found by its place from the end, so the heads stay split through the attention."""
    from nnscaler_cst.rewrite import PlanRequest, rewrite
    (tmp_path / "attention.py").write_text(LEADING_DIMS_ATTENTION)
    model = rewrite(analyze(tmp_path / "attention.py"), PlanRequest(tp=2)).files["model.py"]
    assert "view(*lead, n, self.heads // 2, self.c_head)" in model
    assert "view((*lead, n, self.heads // 2, self.c_head))" in model
    assert "reshape(*lead, n, self.heads * self.c_head // 2)" in model
    forward = model[model.index("def forward"):]
    assert "tp_gather" not in forward and forward.count("tp_reduce(") == 1    # only after the output projection


@pytest.mark.slow          # a whole-model CLI run
def test_a_trunk_run_again_by_recycling_is_refused_for_pipelines_at_its_blocks_call(tmp_path, fixtures_dir):
    """Evoformer's forward runs its block loop three times (recycling): a pipeline stage runs its
    blocks once per micro-batch, so --pp is refused before anything is written."""
    source = (fixtures_dir / "evoformer.py").read_text().splitlines()
    line = next(i for i, text in enumerate(source, 1) if "= block(m, z)" in text)
    result = cli("rewrite", fixtures_dir / "evoformer.py", "--pp", "2", "--micro-batches", "2",
                 "-o", tmp_path / "out")
    assert result.returncode == 2 and not (tmp_path / "out").exists()
    assert f"evoformer.py:{line}:" in result.stderr and "run 3 times in one forward" in result.stderr


# ---- proven on gloo -------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("fixture, args", [
    ("convnet.py", ("--tp", "2")),
    ("einsum_transformer.py", ("--tp", "2")),
    ("residual_mlp.py", ("--pp", "2", "--tp", "2")),
    ("attention", ("--tp", "2")),
    ("vit.py", ("--tp", "2", "--dp", "2")),
    ("bert", ("--tp", "2")),
    ("indexed_writes.py", ("--tp", "2")),
    ("complex_rotary.py", ("--tp", "2", "--dp", "2")),
    ("evoformer.py", ("--tp", "2", "--dp", "2")),
    ("stored_buffer.py", ("--tp", "2")),
    ("stored_buffer.py", ("--pp", "2", "--micro-batches", "2")),
    ("scaled-embedding", ("--tp", "2")),
    ("layer-scale", ("--tp", "2")),
    ("layer-scale", ("--dp", "2", "--tp", "2")),
], ids=["convnet-tp2", "einsum-tp2", "residual-pp2xtp2", "multihead-attention-tp2",
        "vit-dp2xtp2", "hf-bert-with-dropout-tp2", "indexed-writes-tp2", "complex-rotary-dp2xtp2",
        "evoformer-dp2xtp2", "stored-position-buffer-tp2",
        "stored-position-buffer-pp2", "super-forward-embedding-vocab-split-tp2",
        "layer-scale-factories-tp2", "layer-scale-factories-dp2xtp2"])
def test_other_styles_train_like_the_single_device_run(tmp_path, fixtures_dir, fixture, args):
    path = fixtures_dir / fixture
    if fixture in ENTRIES:
        path = tmp_path / "model.py"
        path.write_text(ENTRIES[fixture].lstrip("\n"))
    result = cli("verify", path, *args, "-o", tmp_path / "out", "--json")
    outcome = json.loads(result.stdout[result.stdout.find("{"):])
    assert result.returncode == 0 and outcome["passed"] is True, outcome
    assert max(outcome["loss_errors"]) <= 1e-4 and outcome["max_abs_error"] <= outcome["tolerance"]["param_atol"]
    assert outcome["dropout"].startswith("off")
