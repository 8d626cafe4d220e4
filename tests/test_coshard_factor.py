"""Co-shard on any device count (issue 10, item 4): `--plan coshard --tp 1` runs the attention
core in C pieces on one device, one after another, each recomputed in backward; the table's
`n = "C*|tp|"` leaves C to the memory model: the smallest C whose memory fits --memory-budget.

Memory is measured as tests/test_pipeline_memory.py does: a saved_tensors_hooks pair counts
the bytes of every storage autograd keeps for backward (parameters and the batch excluded)
while it is alive. The generated package runs in this process (one device, no process group).
"""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

from conftest import import_output
from nnscaler_cst.errors import Location
from nnscaler_cst.plan.tables import pieces_per_device

REPO = Path(__file__).resolve().parents[1]
GPT = REPO / "fixtures" / "gpt.py"


def cli(*args, cwd: Path = REPO) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200", "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "nnscaler_cst.cli", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


def test_the_letter_c_leaves_the_pieces_to_the_memory_model():
    where = Location("t.toml", 1)
    assert [pieces_per_device(n, "tp", where) for n in ("C*|tp|", "C·|tp|", "|tp|*C", "4*|tp|")] == [0, 0, 0, 4]


# ---- C chosen by the memory model -------------------------------------------------------------
@pytest.fixture(scope="module")
def gpt_analysis():
    from nnscaler_cst.analysis import analyze
    return analyze(GPT)


def _plan(analysis, tp: int, budget: float | None = None):
    from nnscaler_cst.rewrite import PlanRequest, build_plan
    return build_plan(analysis, PlanRequest(plan="coshard", tp=tp, memory_budget=budget))[0]


@pytest.mark.slow
def test_the_plan_reports_the_memory_its_c_was_chosen_by(gpt_analysis, tmp_path):
    """`plan`'s per-device memory under co-shard is the figure C was chosen by (less than the
    same split without co-shard), the one benchmarks/bench_memory.py compares with a run."""
    from nnscaler_cst.plan import coshard
    from nnscaler_cst.rewrite import PlanRequest, build_plan

    chosen = []
    real = coshard.choose_chunks

    def spy(*args, **kwargs):
        chosen.append(real(*args, **kwargs))
        return chosen[-1]

    coshard.choose_chunks = spy
    try:
        plan = _plan(gpt_analysis, 2)
    finally:
        coshard.choose_chunks = real
    plain, split = build_plan(gpt_analysis, PlanRequest(plan="megatron", tp=2))
    assert plan.coshard_memory == chosen[0].memory < split.memory and plain.coshard_memory is None
    out = cli("plan", GPT, "--plan", "coshard", "--tp", "2", "--json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    ranks = json.loads(out.stdout)["devices"]
    assert [r["memory_bytes"] for r in ranks] == [chosen[0].memory] * 2, ranks


def test_coshard_frees_the_probabilities_and_the_mask_not_the_scores_or_its_inputs(gpt_analysis):
    """What the regions free is what autograd keeps of the storages their statements make: each
    block's softmax output and causal mask (masked_fill keeps it), and the copies the scores'
    and `att @ v`'s matmuls take of q, k, v; the scaled and masked scores autograd never kept.
    The pieces' checkpoints keep q, k, v instead: views of c_attn's output, which nothing kept
    before, as large as those copies. Before, every output needing a gradient was counted
    freed (the scores twice more), and the checkpoints' inputs not at all."""
    from nnscaler_cst.plan import coshard

    chosen = []
    real = coshard.choose_chunks

    def spy(*args, **kwargs):
        chosen.append(real(*args, **kwargs))
        return chosen[-1]

    coshard.choose_chunks = spy
    try:
        _plan(gpt_analysis, 2)
    finally:
        coshard.choose_chunks = real
    trace = gpt_analysis.trace
    softmax = [n for n in gpt_analysis.graph.nodes if n.callee.endswith(".softmax")]
    layers = len(softmax)
    probs = trace.tensors[softmax[0].outputs[0]].nbytes                    # (B, H, T, T) float
    mask = trace.tensors[next(t for n in gpt_analysis.graph.nodes if n.module_path == softmax[0].module_path
                              for t in n.outputs if trace.tensors[t].dtype == "torch.bool")].nbytes
    assert layers == 4 and probs == 8 * 4 * 16 * 16 * 4 and mask == 16 * 16
    assert chosen[0].saved == layers * (probs + mask) / 2                   # split over --tp 2


@pytest.mark.slow
def test_without_a_budget_c_is_2_and_with_a_tighter_one_the_smallest_c_that_fits(gpt_analysis):
    from nnscaler_cst.plan import coshard
    from nnscaler_cst.rewrite import PlanRequest, _choose_coshard, build_plan   # noqa: F401

    seen = {}
    real = coshard.choose_chunks

    def spy(graph, n, base, budget, regions_for, fixed=None):
        for c in (2, 4):
            saved, peak = coshard.region_bytes(graph, regions_for(c), n)
            seen[c] = base - saved + peak / c
        return real(graph, n, base, budget, regions_for, fixed)

    coshard.choose_chunks = spy
    try:
        plan = _plan(gpt_analysis, 1)
    finally:
        coshard.choose_chunks = real
    assert plan.name.startswith("coshard(C=2)") and [t.n for t in plan.trans] == [2]
    assert seen[4] < seen[2]                           # one piece of 4 holds half what one of 2 holds
    between = (seen[2] + seen[4]) / 2
    plan = _plan(gpt_analysis, 1, between)
    assert plan.name.startswith("coshard(C=4)") and [t.n for t in plan.trans] == [4]
    # every piece on the one device, one after another
    assert [(a.piece, a.devices) for a in plan.assign] == [(i, (0,)) for i in range(4)]
    assert [(o.before[-2:], o.after[-2:]) for o in plan.order] == [("#0", "#1"), ("#1", "#2"), ("#2", "#3")]


@pytest.mark.slow
def test_no_c_fitting_the_budget_is_an_error_naming_each_c(tmp_path):
    result = cli("rewrite", GPT, "--plan", "coshard", "--tp", "1", "--memory-budget", "1MiB", "-o", tmp_path / "out")
    assert result.returncode == 2, result.stderr
    assert "no co-shard factor fits the memory budget of 1 MiB per device" in result.stderr and "C=2:" in result.stderr \
        and "C=4:" in result.stderr, result.stderr
    assert not (tmp_path / "out").exists()


# ---- proven on gloo -----------------------------------------------------------------------------
def _eight_heads(tmp_path: Path) -> Path:
    """The GPT fixture with 8 heads: 4 per device at --tp 2, so that C = 4 divides them."""
    model = tmp_path / "gpt8.py"
    text = GPT.read_text()
    assert "n_head: int = 4" in text
    model.write_text(text.replace("n_head: int = 4", "n_head: int = 8"))
    return model


def _annotated(tmp_path: Path, source: Path, chunks: int) -> Path:
    model = tmp_path / f"{source.stem}_c{chunks}.py"
    lines = source.read_text().splitlines()
    at = [i for i, line in enumerate(lines) if "F.softmax(" in line]
    assert len(at) == 1
    lines[at[0]] += f"  # nnscaler: coshard={chunks}"
    model.write_text("\n".join(lines) + "\n")
    return model


@pytest.mark.slow
@pytest.mark.parametrize("tp, chunks", [(1, 2), (1, 4), (2, 4)])
def test_coshard_on_any_device_count_trains_like_the_single_device_run(tmp_path, tp, chunks):
    source = GPT if tp == 1 else _eight_heads(tmp_path)
    model = source if chunks == 2 else _annotated(tmp_path, source, chunks)
    out = tmp_path / "out"
    result = cli("verify", model, "--plan", "coshard", "--tp", tp, "-o", out, "--json", cwd=tmp_path)
    outcome = json.loads(result.stdout[result.stdout.find("{"):])
    assert result.returncode == 0 and outcome["passed"] is True, (outcome, result.stderr[-2000:])
    source_out = (out / "model.py").read_text()
    assert f"y = coshard(_y_in_pieces, {chunks}, in_dims=(1, 1, 1), out_dims=1)(k, q, v)" in source_out
    if tp == 1:       # nothing but the region changes: no collective, no local size
        assert "tp_" not in source_out.replace("_comm import coshard", "")
        assert json.loads((out / "plan.json").read_text())["mesh"]["tp"] == 1


# ---- measured: activation memory at --tp 1 ---------------------------------------------------------
def _saved_bytes(folder: Path) -> dict:
    """Bytes autograd keeps from the forward to the backward of one step of the generated
    package's model, and the peak over forward and backward (recompute included)."""
    package = import_output(folder)
    torch.manual_seed(0)
    model = package.build(0)
    model.train()
    module = package.rank_module(0)
    torch.manual_seed(0)
    batch = module.example_inputs()
    ignore = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *batch]}
    meter = {"alive": 0, "peak": 0}
    tracked = set()

    def freed(key, nbytes):
        tracked.discard(key)
        meter["alive"] -= nbytes

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() in ignore or id(storage) in tracked:
            return t
        tracked.add(id(storage))
        meter["alive"] += storage.nbytes()
        meter["peak"] = max(meter["peak"], meter["alive"])
        weakref.finalize(storage, freed, id(storage), storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = package.loss_of(module, model(*batch))
        kept = meter["alive"]
        loss.backward()
    return {"kept": kept, "peak": meter["peak"], "loss": loss.item()}


def _long_sequences(tmp_path: Path) -> Path:
    """The GPT fixture on 128 tokens (batch 2): each block's 4 x 128 x 128 scores outweigh its
    other activations, as in the long-sequence models co-shard is for."""
    model = tmp_path / "gpt_long.py"
    text = GPT.read_text()
    for old, new in [("block_size: int = 32", "block_size: int = 128"), ("(8, 16)", "(2, 128)")]:
        assert old in text
        text = text.replace(old, new)
    model.write_text(text)
    return model


@pytest.mark.slow
def test_coshard_on_one_device_keeps_less_than_the_plain_model_measured(tmp_path):
    """The plain model keeps every block's attention probabilities for backward; co-shard keeps
    the region's inputs only and recomputes one piece at a time; --recompute keeps each block's
    input and reruns whole blocks. C does not change what is kept: it divides what one piece's
    recompute holds in backward, which checkpoint saves under its own hooks (not seen here) and
    which never tops the end of the forward in this model."""
    long = _long_sequences(tmp_path)
    runs = {"plain": (long, []), "recompute": (long, ["--recompute"]),
            "coshard_c2": (long, ["--plan", "coshard", "--tp", "1"]),
            "coshard_c4": (_annotated(tmp_path, long, 4), ["--plan", "coshard", "--tp", "1"])}
    measured = {}
    for name, (model, flags) in runs.items():
        folder = tmp_path / f"gpt_{name}"
        result = cli("rewrite", model, *flags, "-o", folder, cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        measured[name] = _saved_bytes(folder)
    losses = {round(m["loss"], 5) for m in measured.values()}
    assert len(losses) == 1, measured                     # the same model, the same loss
    plain, recompute = measured["plain"], measured["recompute"]
    c2, c4 = measured["coshard_c2"], measured["coshard_c4"]
    print("\n" + json.dumps({k: {**v, "kept/plain": round(v["kept"] / plain["kept"], 3),
                                 "peak/plain": round(v["peak"] / plain["peak"], 3)} for k, v in measured.items()}))
    assert c2["kept"] < 0.75 * plain["kept"]              # no block's probabilities kept
    assert abs(c4["kept"] - c2["kept"]) <= 0.01 * c2["kept"]
    assert recompute["kept"] < c2["kept"]                 # recompute keeps less still: the blocks' inputs
    assert c2["peak"] < plain["peak"] and c4["peak"] <= c2["peak"]


# ---- grouped-query attention: C among the factors that fit (issue 26, item 6) -------------------
# 6 query heads, 2 kv heads widened to 6 by `repeat_interleave`: at --tp 2 each device holds 3
# query heads and 1 kv head. C = 3 pieces fit the query heads; the region starts after the kv heads
# are widened, as the 1 kv head before cannot be cut in 3 (before: refused, "cannot co-shard into
# 2x64 pieces: `k` has 1 along dim 1", C = 64 being the last C tried).
GQA = """import torch
import torch.nn as nn
import torch.nn.functional as F


class Attention(nn.Module):
    def __init__(self, width=48, heads=6, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, width // heads
        self.q = nn.Linear(width, heads * self.head_dim, bias=False)
        self.k = nn.Linear(width, kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(width, kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(heads * self.head_dim, width, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
        v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        scores = (q @ k.transpose(-2, -1)) / self.head_dim ** 0.5
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        att = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, -1)
        return self.o(y)


class Block(nn.Module):
    def __init__(self, width=48):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = Attention(width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Decoder(nn.Module):
    def __init__(self, vocab=32, width=48, depth=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, vocab)

    def forward(self, idx, targets):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def build():
    torch.manual_seed(0)
    return Decoder()


def example_inputs():
    return torch.randint(0, 32, (2, 8)), torch.randint(0, 32, (2, 8))
"""

# The same attention through torch's own grouped-query SDPA: it reads the 3 query heads and the
# 1 kv head of a device together, and no C cuts both.
GQA_SDPA = GQA.replace("""        k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
        v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        scores = (q @ k.transpose(-2, -1)) / self.head_dim ** 0.5
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        att = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, -1)
""", """        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        y = y.transpose(1, 2).reshape(b, t, -1)
""")


def _analyzed(tmp_path: Path, text: str):
    from nnscaler_cst.analysis import analyze
    (tmp_path / "gqa.py").write_text(text)
    return analyze(tmp_path / "gqa.py")


def test_gqa_co_shards_the_query_heads_in_3_after_the_kv_heads_are_widened(tmp_path):
    from nnscaler_cst.rewrite import PlanRequest, rewrite
    model = rewrite(_analyzed(tmp_path, GQA), PlanRequest(plan="coshard", tp=2)).files["model.py"]
    assert ("        v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)\n"
            "        def _y_in_pieces(k, q, v):  # coshard: 3 pieces per device, one after another, recomputed in "
            "backward\n"
            "            scores = (q @ k.transpose(-2, -1)) / self.head_dim ** 0.5\n") in model
    assert "        y = coshard(_y_in_pieces, 3, in_dims=(1, 1, 1), out_dims=2)(k, q, v)\n" in model


def test_when_no_c_cuts_the_pieces_the_smallest_cs_reason_is_the_error_and_the_others_notes(tmp_path):
    from nnscaler_cst.errors import UserError
    from nnscaler_cst.rewrite import PlanRequest, build_plan
    analysis = _analyzed(tmp_path, GQA_SDPA)
    with pytest.raises(UserError) as refused:
        build_plan(analysis, PlanRequest(plan="coshard", tp=2))
    line = GQA_SDPA.splitlines().index("        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, "
                                       "enable_gqa=True)") + 1
    assert refused.value.message == "cannot co-shard into 2x2 pieces: `q` has 3 along dim 1 on each device"
    assert refused.value.location.line == line
    assert [text for _, text in refused.value.related] == [
        "C=3: cannot co-shard into 2x3 pieces: `k` has 1 along dim 1 on each device"]


@pytest.mark.slow
def test_gqa_co_shard_at_tp_2_trains_like_the_single_device_run(tmp_path):
    (tmp_path / "gqa.py").write_text(GQA)
    out = tmp_path / "out"
    result = cli("verify", tmp_path / "gqa.py", "--plan", "coshard", "--tp", 2, "-o", out, cwd=tmp_path)
    assert result.returncode == 0 and "PASSED" in result.stdout, result.stdout + result.stderr[-2000:]
    assert "y = coshard(_y_in_pieces, 3, in_dims=(1, 1, 1), out_dims=2)(k, q, v)" in (out / "model.py").read_text()


def test_co_shard_prices_the_forward_of_every_statement_its_backward_recomputes(gpt_analysis):
    # backward reruns the whole region piece by piece (scores' matmul, mask, softmax, att @ v),
    # not only the co-sharded softmax
    from nnscaler_cst.plan.cost import load_cluster, node_time
    from nnscaler_cst.rewrite import PlanRequest, build_plan

    coshard = build_plan(gpt_analysis, PlanRequest(plan="coshard", tp=2))[0]
    megatron = build_plan(gpt_analysis, PlanRequest(plan="megatron", tp=2))[0]
    graph = gpt_analysis.graph
    device = load_cluster("cpu-gloo").axis(1, 2)

    def forward(callee_part: str) -> float:
        return sum(node_time(n, graph.dims.get(n.index), graph.trace, device, 2, dims_of=graph.dims.get,
                             forward_only=True) for n in graph.nodes if callee_part in n.callee
                   and ".attn" in n.module_path)

    matmuls, softmax = forward("matmul"), forward("softmax")
    assert matmuls > 0 and softmax > 0
    extra = coshard.estimated_step_seconds - megatron.estimated_step_seconds
    assert extra >= 0.99 * (matmuls + softmax), (extra, matmuls, softmax)
