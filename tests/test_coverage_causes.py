"""Causes of failure found by the coverage benchmark (benchmarks/COVERAGE.md), each reduced to a
small model with the same shape of code, and the mechanism that fixed it:

- a list built in a loop and concatenated (`parts.append(h[:, i:j])` then `torch.cat(parts)`,
  LongT5's `_concatenate_3_blocks`): each loop iteration's call is an invocation of its own, so
  the gather a replicated `torch.cat` needs goes on the producer's expression inside the loop
  (was: one node with an output per iteration, and "cannot place gather ... not an argument
  written in the model's source"); instances of several ranks (a mask (B, N, L) and states
  (B, N, L, H, D) through one helper) agree on that gather with dims counted from the end;
- a dim that flattens the batch with the heads, built from no batched tensor (Bloom's alibi:
  `slopes ... .repeat(batch_size, 1, 1)`, then `baddbmm` with (batch heads) queries): split by
  heads, it is `batch` interleaved groups, and under data parallelism or micro-batches each
  device holds batch / slices of them. The collectives were written with the traced batch
  (`groups=4` where each device held 2): a WRONG rewrite at DP x TP that only verify caught;
- one layer class of the model's own files in several roles (Falcon's `FalconLinear`, an
  nn.Linear whose forward is `x @ self.weight.T`, as the fused qkv, the output and both MLP
  layers; BiT's weight-standardized conv as each conv of a bottleneck): traced into, every
  instance ran the one line of its forward, which takes one split, so the column and the row
  layers could not both split (Falcon's TP plan split 0% of its block parameters). Such a
  class is called as one op at each call site, its rule derived by the probe;
- a probe slicing a layer's weight while the layer's forward reads the size from its own
  attribute (`self.weight.reshape(1, self.out_channels, -1)`): the attribute now holds the
  slice's size, as in the rewrite, whose constructor argument is divided (BiT: 0%);
- sizes unpacked into names (`b, t, three_times_hidden_size = fused_qkv.shape`) kept every dim
  of the tensor whole when the first plan's dry run failed and the plan was solved again with
  every read size whole (Bloom's `_merge_heads` finds the batch by the full number of heads):
  a name the function never uses reads nothing, so Bloom's fused qkv splits by heads (74%).

Quick tests check the traced structure; the slow ones run verify on gloo.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from nnscaler_cst.analysis import analyze
from nnscaler_cst.graph import derive
from nnscaler_cst.plan.batch import batch_split_problem
from nnscaler_cst.rewrite import PlanRequest, build_plan, rewrite

LOOP_CAT = '''
import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(128, 64)

    def forward(self, x):
        h = self.up(x)
        parts = []
        for i in range(2):
            parts.append(h[:, i * 4:(i + 1) * 4])
        h = torch.cat(parts, dim=-1).softmax(dim=-1)
        B, T, C = x.shape
        return x + self.down(h).reshape(B, T, C)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(2)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


def build():
    return Model()


def example_inputs():
    return (torch.randn(4, 8, 32),)
'''


def _write(tmp_path, text: str):
    model = tmp_path / "model.py"
    model.write_text(text.lstrip())
    return model


def _line_of(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.lstrip().splitlines(), 1) if needle in line)


def _verify(tmp_path, text: str, *plan: str) -> tuple[subprocess.CompletedProcess, dict | None]:
    model = _write(tmp_path, text)
    result = subprocess.run([sys.executable, "-m", "nnscaler_cst.cli", "verify", str(model), *plan,
                             "-o", str(tmp_path / "out"), "--json"], capture_output=True, text=True, timeout=900)
    start = result.stdout.find("{")
    return result, json.loads(result.stdout[start:]) if start >= 0 else None


def test_a_loop_that_makes_one_call_per_iteration_gets_a_node_per_iteration(tmp_path):
    analysis = analyze(_write(tmp_path, LOOP_CAT))
    line = _line_of(LOOP_CAT, "parts.append(")
    slices = [n for n in analysis.graph.nodes if n.callee == "Tensor.__getitem__" and n.span.line == line]
    assert len(slices) == 4                                  # 2 blocks x 2 iterations
    assert all(len(n.outputs) == 1 for n in slices)
    cats = [n for n in analysis.graph.nodes if n.callee == "torch.cat"]
    produced = {t for n in slices for t in n.outputs}
    assert all(set(n.operands[0].value) <= produced for n in cats)


@pytest.mark.slow
def test_a_loop_built_list_concatenated_whole_trains_like_one_device(tmp_path):
    result, outcome = _verify(tmp_path, LOOP_CAT, "--tp", "2")
    assert result.returncode == 0 and outcome and outcome["passed"] is True, result.stdout + result.stderr
    text = (tmp_path / "out" / "model.py").read_text()
    assert "parts.append(tp_gather(h[:, i * 4:(i + 1) * 4], TP" in text


BATCH_HEADS = '''
import torch
import torch.nn as nn


class Attention(nn.Module):
    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, bias):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, self.heads, 3, C // self.heads).unbind(3)
        q = q.transpose(1, 2).reshape(B * self.heads, T, C // self.heads)
        k = k.transpose(1, 2).reshape(B * self.heads, T, C // self.heads)
        v = v.transpose(1, 2).reshape(B * self.heads, T, C // self.heads)
        scores = bias.baddbmm(q, k.transpose(1, 2), alpha=0.5)
        probs = scores.softmax(dim=-1)
        out = torch.bmm(probs, v).view(B, self.heads, T, C // self.heads).transpose(1, 2)
        return x + self.proj(out.reshape(B, T, C))


class Model(nn.Module):
    def __init__(self, heads=4):
        super().__init__()
        self.heads = heads
        self.blocks = nn.ModuleList([Attention(heads=heads) for _ in range(2)])

    def forward(self, x):
        batch_size, seq_length, _ = x.shape
        slopes = torch.arange(1, self.heads + 1, dtype=torch.float32) / self.heads
        bias = slopes[:, None, None] * torch.arange(seq_length)
        bias = bias.repeat(batch_size, 1, 1).to(x.dtype)      # (batch heads, 1, seq), as Bloom's alibi
        for block in self.blocks:
            x = block(x, bias)
        return x.pow(2).mean()


def build():
    return Model()


def example_inputs():
    return (torch.randn(4, 8, 32),)
'''


def _repeat_line(files: dict[str, str]) -> str:
    return next(line for name, text in sorted(files.items()) if name.startswith("model")
                for line in text.splitlines() if "bias.repeat(" in line)


@pytest.mark.parametrize("request_, groups", [({"tp": 2}, 4), ({"tp": 2, "dp": 2}, 2),
                                              ({"tp": 2, "pp": 2, "micro_batches": 2}, 2)],
                         ids=["tp2", "dp2xtp2", "pp2xtp2"])
def test_a_batch_flattened_with_heads_is_split_in_local_batch_groups(tmp_path, request_, groups):
    analysis = analyze(_write(tmp_path, BATCH_HEADS))
    line = _repeat_line(rewrite(analysis, PlanRequest(**request_)).files)
    assert f"dim=0, groups={groups})" in line, line


@pytest.mark.slow
def test_a_batch_flattened_with_heads_trains_like_one_device_under_dp_and_tp(tmp_path):
    result, outcome = _verify(tmp_path, BATCH_HEADS, "--dp", "2", "--tp", "2")
    assert result.returncode == 0 and outcome and outcome["passed"] is True, result.stdout + result.stderr


EMPTY_FILLED = '''
import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(32, 16)
        self.b = nn.Linear(32, 16)

    def forward(self, x):
        ha, hb = self.a(x), self.b(x)
        out = ha.new_empty(*ha.shape[:-1], 32)
        out[..., :16].copy_(ha)
        out[..., 16:].copy_(hb)
        return x + out


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(2)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


def build():
    return Model()


def example_inputs():
    return (torch.randn(4, 8, 32),)
'''


def test_a_tensor_made_empty_and_filled_by_copy_keeps_samples_apart(tmp_path):
    analysis = analyze(_write(tmp_path, EMPTY_FILLED))
    empty = next(n for n in analysis.graph.nodes if n.callee == "Tensor.new_empty")
    assert analysis.graph.dims[empty.index].shape_only == {"arg0"}
    assert batch_split_problem(analysis.graph, "data parallel (--dp 2)") is None


@pytest.mark.slow
def test_a_tensor_made_empty_and_filled_by_copy_trains_like_one_device_under_dp(tmp_path):
    result, outcome = _verify(tmp_path, EMPTY_FILLED, "--dp", "2")
    assert result.returncode == 0 and outcome and outcome["passed"] is True, result.stdout + result.stderr


# The whole factory family sized from a batched tensor's shape: the operand (or none, for
# torch.zeros/empty) gives dtype and device, the size its own `.shape`, which each rank reads
# from its slice (AXK1's `kv_nope.new_empty(*kv_nope.shape[:-1], n)` was refused as
# "Tensor.new_empty cannot split its operand arg0 on the batch dim" before 698bdb8).
FACTORIES = '''
import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(32, 16)

    def forward(self, x):
        h = self.a(x)
        b, t, _ = h.shape
        zeros = h.new_zeros(b, t, 16)
        ones = h.new_ones((b, t, 16))
        full = h.new_full(h.shape, 0.5)
        empty = h.new_empty(*h.shape[:-1], 16).fill_(0.25)
        z = torch.zeros(h.shape[0], t, 16, dtype=h.dtype)
        e = torch.empty(b, h.size(1), 16).fill_(2.0)
        out = torch.cat([h * ones + zeros + full + empty, z + e * h], dim=-1)
        return x + out


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(2)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


def build():
    return Model()


def example_inputs():
    return (torch.randn(4, 8, 32),)
'''


def test_factories_sized_from_a_batched_shape_keep_samples_apart(tmp_path):
    analysis = analyze(_write(tmp_path, FACTORIES))
    called = {n.callee for n in analysis.graph.nodes}
    assert {"Tensor.new_zeros", "Tensor.new_ones", "Tensor.new_full", "Tensor.new_empty",
            "torch.zeros", "torch.empty"} <= called
    for node in analysis.graph.nodes:
        if node.callee.startswith("Tensor.new_"):
            assert analysis.graph.dims[node.index].shape_only == {"arg0"}, node.callee
    assert batch_split_problem(analysis.graph, "data parallel (--dp 2)") is None
    assert batch_split_problem(analysis.graph, "micro-batches (--micro-batches 2)", across_ranks=False) is None


@pytest.mark.slow
def test_factories_sized_from_a_batched_shape_train_like_one_device_under_dp(tmp_path):
    result, outcome = _verify(tmp_path, FACTORIES, "--dp", "2")
    assert result.returncode == 0 and outcome and outcome["passed"] is True, result.stdout + result.stderr


CHUNKS = '''
import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(32, 32)

    def forward(self, x):
        h = self.proj(x)
        h = h.view(h.size(0), h.size(1) // 4, 4, h.size(2))
        size = list(h.size())
        size[1] = size[1] * 2 - 1
        stride = list(h.stride())
        stride[1] = stride[1] // 2
        chunks = h.as_strided(size=size, stride=stride)
        return x + chunks.mean(dim=1).repeat(1, 2, 1)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(2)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


def build():
    return Model()


def example_inputs():
    return (torch.randn(4, 8, 32),)
'''

# the same chunks, each starting half-way into the previous sample
CHUNKS_ACROSS_SAMPLES = CHUNKS.replace("        stride[1] = stride[1] // 2\n",
                                       "        stride[0] = stride[0] // 2\n        stride[1] = stride[1] // 2\n")


def test_a_call_on_sizes_read_from_its_operand_keeps_samples_apart(tmp_path):
    analysis = analyze(_write(tmp_path, CHUNKS))
    assert batch_split_problem(analysis.graph, "data parallel (--dp 2)") is None


def test_a_call_on_sizes_that_reach_into_the_next_sample_is_refused(tmp_path):
    assert CHUNKS_ACROSS_SAMPLES != CHUNKS
    analysis = analyze(_write(tmp_path, CHUNKS_ACROSS_SAMPLES))
    problem = batch_split_problem(analysis.graph, "data parallel (--dp 2)")
    assert problem is not None and "Tensor.as_strided" in str(problem)
    assert problem.location.line == _line_of(CHUNKS_ACROSS_SAMPLES, "h.as_strided(")


@pytest.mark.slow
def test_a_call_on_sizes_read_from_its_operand_trains_like_one_device_under_dp(tmp_path):
    result, outcome = _verify(tmp_path, CHUNKS, "--dp", "2")
    assert result.returncode == 0 and outcome and outcome["passed"] is True, result.stdout + result.stderr


# LED's sliding chunks: the states are (seq, batch, hidden) in memory (projected sequence-first),
# viewed batch-first, so `h.stride()` is not the contiguous strides of `h.size()` and as_strided
# reads the memory in that order. The probe of a call at half the batch gives its real tensors the
# traced strides (was: contiguous, so the chunks read other elements and DP was refused).
CHUNKS_SEQUENCE_FIRST = CHUNKS.replace(
    "        h = self.proj(x)\n",
    "        h = self.proj(x.transpose(0, 1)).transpose(0, 1)    # (batch, seq, hidden), seq-first in memory\n")


def test_sliding_chunks_over_a_sequence_first_layout_keep_samples_apart(tmp_path):
    assert CHUNKS_SEQUENCE_FIRST != CHUNKS
    analysis = analyze(_write(tmp_path, CHUNKS_SEQUENCE_FIRST))
    chunks = [n for n in analysis.graph.nodes if n.callee == "Tensor.as_strided"]
    assert chunks
    for node in chunks:
        (source,) = [o.tid for o in node.operands if o.tid is not None]
        whole = analysis.trace.tensors[source]
        assert whole.stride is not None and whole.stride[0] < whole.stride[1]   # seq-first memory
        assert analysis.graph.batch_kept_apart(node) == {node.outputs[0]: 0}
    assert batch_split_problem(analysis.graph, "data parallel (--dp 2)") is None


def test_sliding_chunks_of_each_half_batch_concatenate_to_the_whole():
    """The same call in plain torch: each rank's half of the batch, laid out sequence-first as
    the rank holds it and chunked with its own size() and stride(), gives its half of the whole."""
    def arguments(h):
        h = h.view(h.size(0), h.size(1) // 4, 4, h.size(2))
        size, stride = list(h.size()), list(h.stride())
        size[1], stride[1] = size[1] * 2 - 1, stride[1] // 2
        return h, size, stride

    def chunk(h):
        h, size, stride = arguments(h)
        return h.as_strided(size=size, stride=stride)

    seq_first = torch.randn(8, 6, 5)                       # (seq, batch, hidden)
    whole = chunk(seq_first.transpose(0, 1))
    halves = [chunk(seq_first[:, k * 3:(k + 1) * 3].contiguous().transpose(0, 1)) for k in (0, 1)]
    assert torch.equal(torch.cat(halves, dim=0), whole)
    # the traced arguments (sequence-first strides) on a batch-first copy read other elements:
    # what the probe saw when it made its real tensors contiguous
    _, size, stride = arguments(seq_first.transpose(0, 1))
    contiguous = seq_first.transpose(0, 1).contiguous().view(6, 2, 4, 5)
    assert not torch.equal(contiguous.as_strided(size=size, stride=stride), whole)


@pytest.mark.slow
def test_sliding_chunks_over_a_sequence_first_layout_train_like_one_device_under_dp(tmp_path):
    result, outcome = _verify(tmp_path, CHUNKS_SEQUENCE_FIRST, "--dp", "2")
    assert result.returncode == 0 and outcome and outcome["passed"] is True, result.stdout + result.stderr


# DeepSeek-V4's experts: a decorator swaps the forward for a library one (grouped matmul) that
# sorts all (token, expert) pairs by expert and calls back into the model's file
# (`self._apply_gate`). The trace cuts the module call in two parts around the callback; only the
# second holds the call's results and can be replayed (as the whole call, which keeps tokens
# apart). The first was refused: "has no split rule (... cannot be replayed ...)".
GROUPED_LIB = '''
import torch


def grouped(cls):
    def forward(self, hidden, top_k_index, top_k_weights):
        k = top_k_index.shape[1]
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)           # every token's pairs, by expert
        token = order // k
        picked = flat[order]
        h = torch.bmm(hidden[token].unsqueeze(1), self.gate_up[picked]).squeeze(1)
        h = self._apply_gate(h)
        y = torch.bmm(h.unsqueeze(1), self.down[picked]).squeeze(1) * top_k_weights.reshape(-1)[order, None]
        return torch.zeros_like(hidden).index_add_(0, token, y)

    cls.forward = forward
    return cls
'''

GROUPED_EXPERTS = '''
import torch
import torch.nn as nn
from grouped_lib import grouped


@grouped
class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_up = nn.Parameter(torch.randn(4, 32, 32) * 0.1)
        self.down = nn.Parameter(torch.randn(4, 16, 32) * 0.1)

    def _apply_gate(self, h):
        gate, up = h.chunk(2, dim=-1)
        return nn.functional.silu(gate) * up


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Linear(32, 4)
        self.experts = Experts()

    def forward(self, x):
        b, t, h = x.shape
        flat = x.view(-1, h)
        weights, index = self.router(flat).softmax(dim=-1).topk(2, dim=-1)
        return x + self.experts(flat, index, weights).view(b, t, h)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(2)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


def build():
    return Model()


def example_inputs():
    return (torch.randn(4, 8, 32),)
'''


def test_a_library_forward_calling_back_into_the_model_is_one_op_that_keeps_samples_apart(tmp_path):
    (tmp_path / "grouped_lib.py").write_text(GROUPED_LIB.lstrip())
    source = _write(tmp_path, GROUPED_EXPERTS)
    analysis = analyze(source)
    graph = analysis.graph
    [call] = [n for n in graph.nodes if n.callee.endswith(".Experts") and n.callee_path == "blocks.0.experts"]
    gate_lines = range(_line_of(GROUPED_EXPERTS, "def _apply_gate"), _line_of(GROUPED_EXPERTS, "class Block"))
    assert not [n for n in graph.nodes if n.span and n.span.line in gate_lines]   # the callback's lines: no sites
    whole = graph.dims[call.index]                           # the whole call, replayed: tokens apart
    assert whole.inputs["arg0"].dims[0] and whole.outputs[0].dims[0]
    assert whole.inputs["arg0"].dims[0][0].label == whole.outputs[0].dims[0][0].label
    assert batch_split_problem(graph, "data parallel (--dp 2)") is None
    assert batch_split_problem(graph, "micro-batches (--micro-batches 2)", across_ranks=False) is None


def test_a_value_computed_inside_a_call_and_read_after_it_refuses_the_batch_split(tmp_path):
    """The call's rule covers its results; a value it leaves behind for later code does not."""
    # another module name: the first test's grouped_lib stays imported in this process
    (tmp_path / "leaky_lib.py").write_text(GROUPED_LIB.replace(
        "        order = torch.argsort(flat, stable=True)",
        "        order = LAST['order'] = torch.argsort(flat, stable=True)").replace("import torch\n", "import torch\n\nLAST = {}\n").lstrip())
    leaked = GROUPED_EXPERTS.replace("from grouped_lib import grouped", "from leaky_lib import LAST, grouped").replace(
        "self.experts(flat, index, weights).view(b, t, h)",
        "self.experts(flat, index, weights).view(b, t, h) * LAST['order'].float().mean()")
    assert leaked != GROUPED_EXPERTS
    analysis = analyze(_write(tmp_path, leaked))
    problem = batch_split_problem(analysis.graph, "data parallel (--dp 2)")
    assert problem is not None and "Experts computes a value inside the call that the code after it reads" in str(problem)


@pytest.mark.slow
@pytest.mark.parametrize("plan", [("--dp", "2"), ("--pp", "2", "--micro-batches", "2"), ("--tp", "2")],
                         ids=["dp2", "pp2", "tp2"])
def test_a_library_forward_calling_back_into_the_model_trains_like_one_device(tmp_path, plan):
    (tmp_path / "grouped_lib.py").write_text(GROUPED_LIB.lstrip())
    result, outcome = _verify(tmp_path, GROUPED_EXPERTS, *plan)
    assert result.returncode == 0 and outcome and outcome["passed"] is True, result.stdout + result.stderr


PADDED = '''
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(512, 32, padding_idx=1)
        self.mlp = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        self.head = nn.Linear(32, 512, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids, labels):
        h = self.embed(ids)
        h = h + self.mlp(h)
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


def build():
    return Model()


def example_inputs():
    ids = torch.randint(0, 512, (4, 8))
    ids[:, 6:] = 1                  # padded with the padding id
    return ids, torch.randint(0, 512, (4, 8))
'''


def test_a_vocabulary_split_embedding_keeps_its_padding_row(tmp_path):
    text = rewrite(analyze(_write(tmp_path, PADDED)), PlanRequest(tp=2)).files["model.py"]
    assert "vocab_parallel_embedding(ids, self.embed.weight, TP, self.embed.padding_idx)" in text


@pytest.mark.slow
def test_a_vocabulary_split_embedding_with_padding_trains_like_one_device(tmp_path):
    result, outcome = _verify(tmp_path, PADDED, "--tp", "2")
    assert result.returncode == 0 and outcome and outcome["passed"] is True, result.stdout + result.stderr


ONE_STACK_CLASS = '''
import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 32)

    def forward(self, h, bias):
        return h + torch.tanh(self.fc(h)) + bias, bias


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block() for _ in range(2)])
        self.norm = nn.LayerNorm(32)

    def forward(self, x, memory=None):
        h = self.norm(x if memory is None else x + memory)
        bias = None
        for layer in self.layers:
            h, bias = layer(h, h.mean(dim=-1, keepdim=True) if bias is None else bias)
        return self.norm(h)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = Stack()
        self.decoder = Stack()
        self.head = nn.Linear(32, 8)

    def forward(self, x, y):
        memory = self.encoder(x)
        return self.head(self.decoder(y, memory)).pow(2).mean()


def build():
    return Model()


def example_inputs():
    return torch.randn(4, 8, 32), torch.randn(4, 8, 32)
'''


# the decoder's one layer is no list of blocks: only the encoder's call of the shared method is cut
ONE_STACK_CLASS_ONE_TRUNK = ONE_STACK_CLASS.replace("self.decoder = Stack()", "self.decoder = Stack(1)").replace(
    "def __init__(self):\n        super().__init__()\n        self.layers = nn.ModuleList([Block() for _ in range(2)])",
    "def __init__(self, n=2):\n        super().__init__()\n        self.layers = nn.ModuleList([Block() for _ in range(n)])")


def test_one_stack_class_for_two_block_lists_cuts_only_the_trunks_call(tmp_path):
    assert ONE_STACK_CLASS_ONE_TRUNK.count("Stack(1)") == 1 and "range(n)" in ONE_STACK_CLASS_ONE_TRUNK
    files = rewrite(analyze(_write(tmp_path, ONE_STACK_CLASS_ONE_TRUNK)), PlanRequest(pp=2, micro_batches=2)).files
    for stage in ("model_stage0.py", "model_stage1.py"):
        text = files[stage]
        assert "if pp_first_stage() or not pp_cuts(self):" in text and "    if pp_cuts(self):" in text
        assert 'PIPELINE_CUT_OWNER = "encoder"' in text


def test_two_block_lists_run_one_after_the_other_are_cut_as_one_chain(tmp_path):
    """The encoder's two blocks on stage 0, the decoder's on stage 1: the stage past the encoder
    returns what it returned there (handed on), and receives inside the decoder's loop."""
    files = rewrite(analyze(_write(tmp_path, ONE_STACK_CLASS)), PlanRequest(pp=2, micro_batches=2)).files
    first, second = files["model_stage0.py"], files["model_stage1.py"]
    assert "STAGE_BLOCKS = {0: {'encoder.layers': (0, 2), 'decoder.layers': (0, 0)}}" in first
    assert "STAGE_TRUNKS = {1: {'encoder': ('skip', 0, 0, False), 'decoder': ('receive', 0, 2, False)}}" in second
    for text in (first, second):       # one method serves both lists: its guards ask `self`
        assert "if pp_skips(self):" in text and "return pp_returns(self, self.norm(h))" in text
        assert "pp_hand_on(self, h, bias)" in text and "PIPELINE_CUT_OWNER" not in text


@pytest.mark.slow
def test_one_stack_class_for_two_block_lists_trains_like_one_device_under_pp(tmp_path):
    """(The two lists cut as a chain are verified in test_chained_trunks.py.)"""
    result, outcome = _verify(tmp_path, ONE_STACK_CLASS_ONE_TRUNK, "--pp", "2", "--micro-batches", "2")
    assert result.returncode == 0 and outcome and outcome["passed"] is True, result.stdout + result.stderr


from test_unseen_models import MIXTRAL  # noqa: E402  (the same tiny Mixtral entry)


def test_expert_banks_are_split_by_their_intermediate_dim(tmp_path):
    plan, _ = build_plan(analyze(_write(tmp_path, MIXTRAL)), PlanRequest(tp=2))
    layouts = {name.rsplit(".", 1)[-1]: info["tp"] for name, info in plan.params.items() if ".experts." in name}
    assert layouts == {"gate_up_proj": "S(1, groups=2)", "down_proj": "S(2)"}


@pytest.mark.slow
def test_expert_banks_split_train_like_one_device(tmp_path):
    result, outcome = _verify(tmp_path, MIXTRAL, "--tp", "2")
    assert result.returncode == 0 and outcome and outcome["passed"] is True, result.stdout + result.stderr


BATCH_NORM = '''
import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm = nn.BatchNorm2d(channels)

    def forward(self, x):
        return x + torch.relu(self.norm(self.conv(x)))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.blocks = nn.ModuleList([Block(16) for _ in range(2)])
        self.head = nn.Linear(16, 10)

    def forward(self, images, labels):
        x = self.stem(images)
        for block in self.blocks:
            x = block(x)
        return nn.functional.cross_entropy(self.head(x.mean(dim=(2, 3))), labels)


def build():
    return Model()


def example_inputs():
    return torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,))
'''


def test_batch_norm_under_data_parallelism_sums_its_statistics_over_the_ranks(tmp_path):
    analysis = analyze(_write(tmp_path, BATCH_NORM))
    text = rewrite(analysis, PlanRequest(dp=2)).files["model.py"]
    assert "torch.relu(dp_batch_norm(self.conv(x), self.norm, DP))" in text
    assert "from ._comm import DP, dp_batch_norm" in text
    problem = batch_split_problem(analysis.graph, "2 micro-batches", across_ranks=False)
    assert problem is not None and "BatchNorm2d" in str(problem) and "--micro-batches 1" in problem.hint


@pytest.mark.slow
@pytest.mark.parametrize("plan", [("--dp", "2"), ("--dp", "2", "--tp", "2")], ids=["dp2", "dp2xtp2"])
def test_batch_norm_under_data_parallelism_trains_like_one_device(tmp_path, plan):
    result, outcome = _verify(tmp_path, BATCH_NORM, *plan)
    assert result.returncode == 0 and outcome and outcome["passed"] is True, result.stdout + result.stderr


# A loop that counts its blocks (`enumerate(self.layers)`) and reads a per-block setting by that
# count (BEiT/Beam-style `self.config.layer_types[i]`): each pipeline stage holds only its blocks,
# numbered from 0, so the count must start at the stage's first block in the whole model.
COUNTED_BLOCKS = '''
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(32, 32) for _ in range(4)])
        self.kinds = ["tanh", "relu", "sigmoid", "gelu"]

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            x = getattr(torch.nn.functional, self.kinds[i])(block(x)) + x
        return x.pow(2).mean()


def build():
    return Model()


def example_inputs():
    return (torch.randn(4, 8, 32),)
'''


def test_a_stage_counts_its_blocks_from_its_first_block_in_the_whole_model(tmp_path):
    model = _write(tmp_path, COUNTED_BLOCKS)
    result = subprocess.run([sys.executable, "-m", "nnscaler_cst.cli", "rewrite", str(model), "--pp", "2",
                             "--micro-batches", "2", "-o", str(tmp_path / "out")], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    stages = sorted((tmp_path / "out").glob("model_stage*.py"))
    assert stages
    for stage in stages:
        assert "enumerate(self.blocks, pp_first_block(STAGE_BLOCKS))" in stage.read_text()
    from nnscaler_cst.runtime import _comm
    stage = _comm.PIPE.stage
    try:
        _comm.PIPE.stage = 1
        assert _comm.pp_first_block({1: (2, 4)}) == 2 and _comm.pp_first_block({0: (0, 2)}) == 0
    finally:
        _comm.PIPE.stage = stage


@pytest.mark.slow
def test_a_stage_that_counts_its_blocks_trains_like_one_device_under_pp(tmp_path):
    result, outcome = _verify(tmp_path, COUNTED_BLOCKS, "--pp", "2", "--micro-batches", "2")
    assert result.returncode == 0 and outcome and outcome["passed"] is True, result.stdout + result.stderr


# A helper outside the model's files that reads a tensor for its shape only (transformers'
# `create_causal_mask(config, inputs_embeds, ...)`: the batch size, not the hidden size), called
# from two lambdas one after the other (Beam's `mask_creation_functions[layer_type]()`).
MASK_HELPER = '''
import torch


def make_mask(x, window):
    b, s = x.shape[0], x.shape[1]
    rows = torch.arange(s).unsqueeze(1)
    cols = torch.arange(s).unsqueeze(0)
    allowed = (cols <= rows) & (rows - cols < window)
    return torch.zeros(b, 1, s, s).masked_fill(~allowed, float("-inf"))
'''

MASKED_BY_HELPER = '''
import torch
import torch.nn as nn

from mask_helper import make_mask


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, 32)

    def forward(self, x):
        h = self.up(x)
        makers = {
            "full": lambda: make_mask(h, 8),
            "sliding": lambda: make_mask(h, 3),
        }
        masks = {kind: maker() for kind, maker in makers.items()}
        scores = (x @ x.transpose(1, 2)).unsqueeze(1)
        weights = (scores + masks["full"]).softmax(-1) + (scores + masks["sliding"]).softmax(-1)
        return (weights.squeeze(1) @ self.down(h.relu())).pow(2).mean()


def build():
    return Model()


def example_inputs():
    return (torch.randn(4, 8, 32),)
'''


def _with_helper(tmp_path):
    (tmp_path / "mask_helper.py").write_text(MASK_HELPER.lstrip())
    return _write(tmp_path, MASKED_BY_HELPER)


def test_helpers_called_from_two_lambdas_one_after_the_other_are_two_invocations(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    analysis = analyze(_with_helper(tmp_path))
    calls = [n for n in analysis.graph.nodes if n.callee.endswith("make_mask")]
    assert len(calls) == 2 and len({n.span for n in calls}) == 2
    assert all(len(n.outputs) == 1 for n in calls)


def test_a_tensor_read_for_its_batch_size_may_arrive_split_on_its_hidden_dim(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    analysis = analyze(_with_helper(tmp_path))
    for node in (n for n in analysis.graph.nodes if n.callee.endswith("make_mask")):
        dims = analysis.graph.dims[node.index]
        assert dims.shape_only == {"x"} and dims.free == {"x": {2}}   # batch and length set the mask's shape


@pytest.mark.slow
def test_a_tensor_read_for_its_batch_size_trains_like_one_device_under_tp(tmp_path):
    (tmp_path / "mask_helper.py").write_text(MASK_HELPER.lstrip())
    result, outcome = _verify(tmp_path, MASKED_BY_HELPER, "--tp", "2")
    assert result.returncode == 0 and outcome and outcome["passed"] is True, result.stdout + result.stderr


def test_producers_of_one_argument_keep_the_steps_before_those_they_all_end_with():
    # bailing_hybrid: `hidden_states = residual + hidden_states` after `self.mlp(...)`, a dense MLP
    # in layer 0 (partial sums: reduce, then scatter) and an MoE block in layer 1 (whole: scatter).
    # One line, one conversion: the reduce stays on the dense MLP's result, the scatter goes on
    # the argument (was: "instances of Tensor.add need different conversions").
    from types import SimpleNamespace

    from nnscaler_cst.materialize.conversions import Step
    from nnscaler_cst.materialize.edits import _producer_prefixes

    dense, moe, add = (SimpleNamespace(span=f"line {k}") for k in (197, 828, 885))
    tensors = {0: SimpleNamespace(shape=(4, 16, 64), producer=0), 1: SimpleNamespace(shape=(4, 16, 64), producer=1)}
    graph = SimpleNamespace(trace=SimpleNamespace(tensors=tensors), nodes=[dense, moe],
                            result_wrappable=lambda node: True)
    reduce, scatter = Step("reduce"), Step("scatter", 2)
    by_output = {("line 197", "torch.nn.Linear", 0): [(0, add, ("pos", 0), [reduce, scatter]),
                                                       (0, SimpleNamespace(span="line 830"), ("pos", 0), [reduce])],
                 ("line 828", "Tensor.add", 0): [(1, add, ("pos", 0), [scatter])]}
    prefixes = _producer_prefixes(graph, by_output)
    assert prefixes == {("line 197", "torch.nn.Linear", 0): [reduce], ("line 828", "Tensor.add", 0): []}


# An expert bank larger than the op probe's old size limit (BailingHybrid's 512 experts at a tiny
# hidden size: gate_up 512 x 256 x 64 = 8.4M elements, over the 4M elements the probe ran on):
# the call reading the bank (transformers' Experts module; here `self.gate_up_proj[expert]`) was
# not probed, had no split rule, and the bank stayed whole on every device (3% of the block
# parameters split at TP=2). Routed experts stored as 3D parameters (144 x 512 x 64 = 4.7M
# elements), a Python loop over the hit experts, a shared expert beside them behind a sigmoid gate.
MANY_EXPERTS = '''
import torch
import torch.nn as nn
import torch.nn.functional as F

HIDDEN, INTER, EXPERTS, TOP_K = 64, 256, {experts}, 2


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_experts = EXPERTS
        self.gate_up_proj = nn.Parameter(torch.randn(EXPERTS, 2 * INTER, HIDDEN) * 0.1)
        self.down_proj = nn.Parameter(torch.randn(EXPERTS, HIDDEN, INTER) * 0.1)

    def forward(self, hidden, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden)
        with torch.no_grad():
            mask = F.one_hot(top_k_index, num_classes=self.num_experts).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert in hit:
            expert = expert[0]
            pos, token = torch.where(mask[expert])
            gate, up = F.linear(hidden[token], self.gate_up_proj[expert]).chunk(2, dim=-1)
            h = F.linear(F.silu(gate) * up, self.down_proj[expert]) * top_k_weights[token, pos, None]
            out.index_add_(0, token, h.to(out.dtype))
        return out


class Shared(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(HIDDEN, INTER, bias=False)
        self.down = nn.Linear(INTER, HIDDEN, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.up(x)))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.router = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.experts = Experts()
        self.shared = Shared()
        self.shared_gate = nn.Linear(HIDDEN, 1, bias=False)

    def forward(self, x):
        b, t, h = x.shape
        flat = self.norm(x).view(-1, h)
        probs = F.softmax(self.router(flat), dim=-1, dtype=torch.float)
        weights, index = torch.topk(probs, TOP_K, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(flat.dtype)
        routed = self.experts(flat, index, weights)
        shared = torch.sigmoid(self.shared_gate(flat)) * self.shared(flat)
        return x + (routed + shared).view(b, t, h)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, HIDDEN)
        self.blocks = nn.ModuleList([Block() for _ in range(2)])
        self.head = nn.Linear(HIDDEN, 64)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), ids.flatten())


def build():
    return Model()


def example_inputs():
    return (torch.randint(0, 64, (2, 8)),)
'''


def _block_split_share(params: dict) -> float:
    block = {name: info for name, info in params.items() if name.startswith("blocks.")}
    total = sum(torch.Size(info["shape"]).numel() for info in block.values())
    return sum(torch.Size(info["shape"]).numel() for info in block.values() if info["tp"].startswith("S")) / total


@pytest.mark.slow         # 20-30 s: the probe runs the 144-expert bank
def test_a_bank_of_many_experts_is_split_by_its_intermediate_dim(tmp_path):
    plan, _ = build_plan(analyze(_write(tmp_path, MANY_EXPERTS.format(experts=144))), PlanRequest(tp=2))
    layouts = {name.rsplit(".", 1)[-1]: info["tp"] for name, info in plan.params.items() if ".experts." in name}
    assert layouts == {"gate_up_proj": "S(1, groups=2)", "down_proj": "S(2)"}
    assert _block_split_share(plan.params) >= 0.75


@pytest.mark.slow
def test_a_bank_of_many_experts_split_trains_like_one_device(tmp_path):
    result, outcome = _verify(tmp_path, MANY_EXPERTS.format(experts=144), "--tp", "2")
    assert result.returncode == 0 and outcome and outcome["passed"] is True, result.stdout + result.stderr
    params = json.loads((tmp_path / "out" / "plan.json").read_text())["params"]
    assert _block_split_share(params) >= 0.75



ROLE_LINEAR = '''import torch
import torch.nn as nn
import torch.nn.functional as F


class Projection(nn.Linear):
    """A linear layer written as a matmul (falcon's FalconLinear): one class, two roles."""

    def forward(self, x):
        return x @ self.weight.T


class Block(nn.Module):
    def __init__(self, dim=64):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = Projection(dim, 4 * dim, bias=False)
        self.down = Projection(4 * dim, dim, bias=False)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(2)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


def build():
    return Model()


def example_inputs():
    return (torch.randn(4, 16, 64),)
'''


def test_a_layer_class_in_two_roles_is_one_op_at_each_call_site(tmp_path):
    analysis = analyze(_write(tmp_path, ROLE_LINEAR))
    calls = [n for n in analysis.graph.nodes if n.callee.endswith(".Projection")]
    lines = {_line_of(ROLE_LINEAR, "self.down(F.gelu(")}
    assert len(calls) == 4 and {n.span.line for n in calls} == lines      # 2 blocks x (up, down), one line
    assert len({n.span for n in calls}) == 2                               # two sites: up and down
    assert not any(n.callee == "Tensor.matmul" for n in analysis.graph.nodes)
    params = rewrite(analysis, PlanRequest(tp=2)).plan.params
    assert params["blocks.0.up.weight"]["tp"] == "S(0)" and params["blocks.0.down.weight"]["tp"] == "S(1)"


@pytest.mark.slow
def test_a_layer_class_in_two_roles_trains_like_one_device_under_tp(tmp_path):
    result, outcome = _verify(tmp_path, ROLE_LINEAR, "--tp", "2")
    assert result.returncode == 0 and outcome and outcome["passed"] is True, result.stdout + result.stderr
    text = (tmp_path / "out" / "model.py").read_text()
    assert "self.up = Projection(dim, 4 * dim // 2, bias=False)" in text
    assert "self.down = Projection(4 * dim // 2, dim, bias=False)" in text


STANDARDIZED_CONV = '''import torch
import torch.nn as nn
import torch.nn.functional as F


class StandardizedConv(nn.Conv2d):
    """A convolution with weight standardization (BiT's WeightStandardizedConv2d): statistics
    of each output channel's weights, read with the layer's own `self.out_channels`."""

    def forward(self, x):
        weight = F.batch_norm(self.weight.reshape(1, self.out_channels, -1), None, None, training=True,
                              momentum=0.0, eps=1e-6).reshape_as(self.weight)
        return F.conv2d(x, weight, self.bias, self.stride, self.padding)


class Block(nn.Module):
    def __init__(self, channels=32):
        super().__init__()
        self.conv1 = StandardizedConv(channels, 2 * channels, 1, bias=False)
        self.conv2 = StandardizedConv(2 * channels, channels, 3, padding=1, bias=False)

    def forward(self, x):
        return x + self.conv2(F.relu(self.conv1(x)))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(2)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


def build():
    return Model()


def example_inputs():
    return (torch.randn(4, 32, 8, 8),)
'''


def test_a_probed_layer_reads_its_sliced_size_from_its_own_attribute(tmp_path):
    analysis = analyze(_write(tmp_path, STANDARDIZED_CONV))
    calls = [n for n in analysis.graph.nodes if n.callee.endswith(".StandardizedConv")]
    assert len(calls) == 4
    for node in calls:          # the output channels split: the weight's dim 0 with the result's dim 1
        dims = analysis.graph.dims[node.index]
        label = dims.inputs["self.weight"].dims[0]
        assert label and dims.outputs[0].dims[1] == label
    params = rewrite(analysis, PlanRequest(tp=2)).plan.params
    assert params["blocks.0.conv1.weight"]["tp"] == "S(0)" and params["blocks.0.conv2.weight"]["tp"] == "S(0)"


@pytest.mark.slow
def test_a_weight_standardized_conv_split_on_its_outputs_trains_like_one_device_under_tp(tmp_path):
    result, outcome = _verify(tmp_path, STANDARDIZED_CONV, "--tp", "2")
    assert result.returncode == 0 and outcome and outcome["passed"] is True, result.stdout + result.stderr


MERGED_HEADS = '''import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class Attention(nn.Module):
    """Bloom's attention: a fused q|k|v split per head, (batch heads) flattened for bmm, and the
    batch found again from the flattened dim by the full number of heads."""

    def __init__(self, dim=64, heads=4):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def _merge_heads(self, x):
        batch_and_heads, length, _ = x.shape
        batch = batch_and_heads // self.heads
        x = x.view(batch, self.heads, length, self.head_dim).permute(0, 2, 1, 3)
        return x.reshape(batch, length, self.heads * self.head_dim)

    def forward(self, h):
        batch, length, _ = h.shape
        fused = self.qkv(h)
        b, t, three_times_dim = fused.shape
        fused = fused.view(b, t, self.heads, 3, self.head_dim)
        q = fused[..., 0, :].transpose(1, 2).reshape(batch * self.heads, length, self.head_dim)
        k = fused[..., 1, :].transpose(1, 2).reshape(batch * self.heads, length, self.head_dim)
        v = fused[..., 2, :].transpose(1, 2).reshape(batch * self.heads, length, self.head_dim)
        scores = torch.bmm(q, k.transpose(1, 2)) / math.sqrt(self.head_dim)
        context = torch.bmm(F.softmax(scores, dim=-1), v)
        return self.out(self._merge_heads(context))


class Block(nn.Module):
    def __init__(self, dim=64):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(2)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


def build():
    return Model()


def example_inputs():
    return (torch.randn(4, 16, 64),)
'''


def test_a_size_unpacked_into_an_unused_name_is_not_read(tmp_path):
    from nnscaler_cst.plan.whole_sizes import dims_read_whole

    analysis = analyze(_write(tmp_path, MERGED_HEADS))
    qkv = next(n for n in analysis.graph.nodes if n.callee == "torch.nn.Linear" and n.span.line ==
               _line_of(MERGED_HEADS, "fused = self.qkv(h)"))
    read = dims_read_whole(analysis.graph, every_read=True)
    assert read[qkv.outputs[0]] == {0, 1}                # b, t used; three_times_dim never
    hidden = next(op.tid for op in qkv.operands if op.name == "arg0")
    assert read[hidden] == {0, 1}                        # batch, length = h.shape; `_` unused
    params = rewrite(analysis, PlanRequest(tp=2)).plan.params
    assert params["blocks.0.attn.qkv.weight"]["tp"] == "S(0)" and params["blocks.0.attn.out.weight"]["tp"] == "S(1)"


@pytest.mark.slow
def test_heads_merged_by_the_full_head_count_train_like_one_device_under_tp(tmp_path):
    result, outcome = _verify(tmp_path, MERGED_HEADS, "--tp", "2")
    assert result.returncode == 0 and outcome and outcome["passed"] is True, result.stdout + result.stderr



# ConvBERT's separable convolution: a pointwise nn.Conv1d (kernel 1) between linear layers. No
# [[ctor]] rule says how nn.Conv1d sizes its weight, so the rewrite cannot build it at a local
# size; the search offered that split anyway and the rewrite refused the model ('no [[ctor]]
# rule says how torch.nn.Conv1d sizes weight'). Such a weight then stayed whole, with a warning;
# now the layer is built whole and cut to each rank's share after build() (SPLIT_AFTER_BUILD),
# so it splits with the rest of the block. nn.Conv1d has a [[ctor]] rule now (a depthwise conv
# splits by channels); nn.ConvTranspose1d, of the same shape here, has none.
POINTWISE_CONV1D = '''
import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.pointwise = nn.ConvTranspose1d(32, 32, kernel_size=1)
        self.down = nn.Linear(32, 16)

    def forward(self, x):
        h = self.up(x).relu()
        h = self.pointwise(h.transpose(1, 2)).transpose(1, 2)
        return x + self.down(h)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(2)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def build():
    return Model()


def example_inputs():
    return {"x": torch.randn(4, 8, 16)}
'''


def test_a_layer_without_a_ctor_rule_is_built_whole_and_cut_after_build(tmp_path):
    analysis = analyze(_write(tmp_path, POINTWISE_CONV1D))
    assert analysis.graph.rules.ctor_for("torch.nn.ConvTranspose1d") is None     # else this tests nothing
    done = rewrite(analysis, PlanRequest(tp=2))     # the dry run of the ranks included
    params = done.plan.params
    assert params["blocks.0.pointwise.weight"]["tp"].startswith("S")
    assert params["blocks.0.up.weight"]["tp"].startswith("S")
    code = done.files["model.py"]
    assert "self.pointwise = nn.ConvTranspose1d(32, 32, kernel_size=1)\n" in code      # as written
    table = code.split("SPLIT_AFTER_BUILD = {")[1]
    assert "'blocks.0.pointwise.weight'" in table and "'blocks.0.up.weight'" not in table


# DeepSeek-V4's cache: `self.lazy_initialization(key_states, value_states)` on a library class,
# called with one tensor twice. The trace took the method's `self` for the call's first written
# argument, so value_states sat at ("kw", "value_states") in a call that passes it by position,
# and the TP rewrite stopped at "cannot insert gather on this argument".
KV_HELPER = '''
import torch.nn.functional as F


class KeyValueStore:
    def combine(self, key, value):
        return F.normalize(key, dim=-1) * value.softmax(-1)
'''

KV_BY_METHOD = '''
import torch
import torch.nn as nn

from kv_helper import KeyValueStore


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, 32)
        self.back = nn.Linear(64, 32)
        self.store = KeyValueStore()

    def forward(self, x):
        kv = self.up(x)
        mixed = self.store.combine(kv, kv)
        return (self.down(kv.relu()) + self.back(mixed)).pow(2).mean()


def build():
    return Model()


def example_inputs():
    return (torch.randn(4, 8, 32),)
'''


def test_a_library_method_called_on_an_object_takes_its_arguments_by_their_written_position(tmp_path, monkeypatch):
    (tmp_path / "kv_helper.py").write_text(KV_HELPER.lstrip())
    monkeypatch.syspath_prepend(str(tmp_path))
    analysis = analyze(_write(tmp_path, KV_BY_METHOD))
    [call] = [n for n in analysis.graph.nodes if n.callee.endswith("KeyValueStore.combine")]
    assert {o.name: o.path for o in call.operands} == {"self": None, "key": ("pos", 0), "value": ("pos", 1)}


@pytest.mark.slow
def test_a_library_method_fed_one_tensor_twice_trains_like_one_device_under_tp(tmp_path):
    (tmp_path / "kv_helper.py").write_text(KV_HELPER.lstrip())
    result, outcome = _verify(tmp_path, KV_BY_METHOD, "--tp", "2")
    assert result.returncode == 0 and outcome and outcome["passed"] is True, result.stdout + result.stderr
    assert "combine(tp_gather(kv, TP, dim=2), tp_gather(kv, TP, dim=2))" in (tmp_path / "out" / "model.py").read_text()


# DeepSeek-V4's compressors hold an RMSNorm whose branch runs only on longer sequences: the
# example inputs never reach it, so no op gave its weight a layout, while the norm class's
# `nn.Parameter(torch.ones(hidden_size))` was divided for the instances that are split. The rank
# built it at half size and its state-dict share was whole: the dry run stopped the rewrite.
UNREACHED_INSTANCE = '''
import torch
import torch.nn as nn


class Scale(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x):
        return x * self.weight


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.scale = Scale(64)
        self.long_scale = Scale(64)
        self.down = nn.Linear(64, 32)

    def forward(self, x):
        h = self.up(x).relu()
        h = self.long_scale(h) if x.shape[1] > 1024 else self.scale(h)
        return self.down(h).pow(2).mean()


def build():
    return Model()


def example_inputs():
    return (torch.randn(4, 8, 32),)
'''


def test_a_parameter_no_op_reads_takes_the_split_of_its_constructors_other_instances(tmp_path):
    from nnscaler_cst.plan.layouts import Layout
    from nnscaler_cst.rewrite import PlanRequest, build_plan
    analysis = analyze(_write(tmp_path, UNREACHED_INSTANCE))
    _, tp_plan = build_plan(analysis, PlanRequest("megatron", 2, 1, None, "cpu-gloo", None))
    assert tp_plan.param_layout["scale.weight"] == Layout("S", 0)
    assert tp_plan.param_layout["long_scale.weight"] == Layout("S", 0)


@pytest.mark.slow
def test_a_module_the_inputs_do_not_reach_trains_like_one_device_under_tp(tmp_path):
    result, outcome = _verify(tmp_path, UNREACHED_INSTANCE, "--tp", "2")
    assert result.returncode == 0 and outcome and outcome["passed"] is True, result.stdout + result.stderr


# MoE layers that sort the tokens of the whole batch by expert and put each result back in its
# token's place (GLM-4-MoE's group mask `scatter_`, JetMoE's `sort`, Llama 4's `repeat` by
# expert, Nemotron-H): ops inside mix the samples' rows, the layer as a whole keeps them apart.
# The batch check was refused at the first such op; it now calls the enclosing module as a
# whole on each half of the batch (graph/batch_probe.py: module_kept_apart). A capacity that
# drops the tokens past a share of the whole batch does mix them, and stays refused.
SORTED_MOE = '''
import torch
import torch.nn as nn


class MoE(nn.Module):
    def __init__(self, d=32, experts=4, capacity=CAPACITY):
        super().__init__()
        self.gate = nn.Linear(d, experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(experts, d, 64) * 0.1)
        self.w_out = nn.Parameter(torch.randn(experts, 64, d) * 0.1)
        self.capacity = capacity          # share of all tokens one expert takes at most

    def forward(self, x):
        b, t, d = x.shape
        tokens = x.reshape(-1, d)
        weight, expert = self.gate(tokens).softmax(-1).max(-1)
        order = expert.argsort(stable=True)
        counts = torch.bincount(expert, minlength=self.w_in.shape[0]).tolist()
        out = torch.zeros_like(tokens)
        start = 0
        for e, n in enumerate(counts):
            idx = order[start:start + n]
            start += n
            if self.capacity is not None:
                idx = idx[:int(self.capacity * tokens.shape[0])]
            h = torch.relu(tokens[idx] @ self.w_in[e]) @ self.w_out[e]
            out = out.index_add(0, idx, h * weight[idx, None])
        return out.reshape(b, t, d)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(32)
        self.moe = MoE()

    def forward(self, x):
        return x + self.moe(self.norm(x))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(2)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


def build():
    return Model()


def example_inputs():
    return (torch.randn(4, 8, 32),)
'''


def test_a_moe_layer_sorting_the_whole_batch_keeps_samples_apart(tmp_path):
    analysis = analyze(_write(tmp_path, SORTED_MOE.replace("CAPACITY", "None")))
    graph = analysis.graph
    sort = next(n for n in graph.nodes if n.callee == "Tensor.argsort")
    assert graph.batch_kept_apart(sort) is None          # the op alone mixes the rows: else this tests nothing
    assert batch_split_problem(graph, "data parallel (--dp 2)") is None
    assert batch_split_problem(graph, "micro-batches (--micro-batches 2)", across_ranks=False) is None


def test_a_module_too_large_to_probe_is_not_called_for_real(tmp_path, monkeypatch):
    # at production shapes (Llama-7B's decoder layer: GBs) the whole-module probe claims nothing
    # rather than allocating its tensors; it stopped `plan --plan auto` of a 7B model by OOM
    graph = analyze(_write(tmp_path, SORTED_MOE.replace("CAPACITY", "None"))).graph
    assert graph.module_kept_apart("blocks.0.moe") is not None
    graph._kept.clear()
    monkeypatch.setattr(derive, "MAX_PROBE_ELEMENTS", 64)
    assert graph.module_kept_apart("blocks.0.moe") is None


CACHING_LAYER = '''
import torch
import torch.nn as nn


class Centering(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x):
        if not hasattr(self, "scale"):
            self.scale = torch.ones(16)          # cached on the first call
        h = self.proj(x) * self.scale
        return h - h.mean(0, keepdim=True)       # mixes the samples


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = Centering()

    def forward(self, x):
        return self.layer(x).pow(2).mean()


def build():
    return Model()


def example_inputs():
    return (torch.randn(4, 16),)
'''


def test_a_module_holding_a_tensor_of_the_fake_trace_is_refused_not_crashed(tmp_path):
    # T5-3B under transformers 5.24: the whole-module probe called a layer that kept a tensor
    # made during the fake-tensor trace; its result was fake, and comparing it raised torch's
    # DataDependentOutputException out of the planner. Such a call cannot be told: refused.
    analysis = analyze(_write(tmp_path, CACHING_LAYER), trace_mode="fake")
    assert analysis.trace.mode == "fake"
    assert analysis.graph.module_kept_apart("layer") is None
    problem = batch_split_problem(analysis.graph, "data parallel (--dp 2)")
    assert problem is not None and problem.location.line == _line_of(CACHING_LAYER, "h.mean(0")


def test_a_moe_layer_whose_capacity_is_a_share_of_the_whole_batch_mixes_samples(tmp_path):
    text = SORTED_MOE.replace("CAPACITY", "0.1")
    problem = batch_split_problem(analyze(_write(tmp_path, text)).graph, "data parallel (--dp 2)")
    # refused where the first op mixing the rows sits: the sort of all tokens by expert (the max over
    # experts before it keeps each token's row, its indices included)
    assert problem is not None and problem.location.line == _line_of(text, "order = expert.argsort"), problem


# transformers 5.24 put `create_causal_mask` (and the decoders' forwards) under
# `deprecate_kwarg`, whose wrapper is named `wrapped_func`: the trace took the wrapper for the
# helper, could not replay it, and every decoder lost data parallelism ("has no split rule").
# A decorator's closure holding the function it calls is a wrapper, whatever its name.
DECORATED_LIBRARY = '''
import functools

import torch


def renamed_kwarg(old, new):
    def wrapper(fn):
        @functools.wraps(fn)
        def wrapped_func(*args, **kwargs):
            if old in kwargs:
                kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)
        return wrapped_func
    return wrapper


@renamed_kwarg("inputs", "x")
def causal_bias(x):
    t = x.shape[1]
    return torch.full((t, t), float("-inf"), dtype=x.dtype).triu(1)
'''

DECORATED_MODEL = '''
import torch
import torch.nn as nn

from _decorated_masks import causal_bias


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x):
        scores = self.proj(x) @ x.transpose(1, 2) + causal_bias(inputs=x)
        return scores.softmax(-1).pow(2).mean()


def build():
    return Model()


def example_inputs():
    return (torch.randn(4, 8, 16),)
'''


def test_a_library_helper_under_a_decorator_is_traced_as_the_helper(tmp_path):
    (tmp_path / "_decorated_masks.py").write_text(DECORATED_LIBRARY.lstrip())
    graph = analyze(_write(tmp_path, DECORATED_MODEL)).graph
    assert "_decorated_masks.causal_bias" in {n.callee for n in graph.nodes}
    assert batch_split_problem(graph, "data parallel (--dp 2)") is None


@pytest.mark.slow
def test_a_moe_layer_sorting_the_whole_batch_trains_like_one_device_under_dp(tmp_path):
    result, outcome = _verify(tmp_path, SORTED_MOE.replace("CAPACITY", "None"), "--dp", "2")
    assert result.returncode == 0 and outcome and outcome["passed"] is True, result.stdout + result.stderr


# RoFormer's rotary embedding: `torch.stack([-q[..., 1::2], q[..., ::2]], -1).reshape_as(q)`.
# reshape_as takes its result's shape from its other tensor, which the rule left out: the plan
# gathered q whole for it while the stack held one rank's heads, and the dry run stopped the TP
# rewrite ("shape '[4, 4, 16, 16]' is invalid for input of size 2048"). The other tensor is now
# split as the result is.
RESHAPE_AS = '''
import torch
import torch.nn as nn


class Attention(nn.Module):
    def __init__(self, d=32, heads=4):
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.v = nn.Linear(d, d)
        self.o = nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (proj(x).view(b, t, self.heads, -1).transpose(1, 2) for proj in (self.q, self.k, self.v))
        q = q + torch.stack([-q[..., 1::2], q[..., ::2]], dim=-1).reshape_as(q)
        k = k + torch.stack([-k[..., 1::2], k[..., ::2]], dim=-1).reshape_as(k)
        h = torch.softmax(q @ k.transpose(-1, -2) / 4.0, dim=-1) @ v
        return self.o(h.transpose(1, 2).reshape(b, t, d))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Attention() for _ in range(2)])

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x.pow(2).mean()


def build():
    return Model()


def example_inputs():
    return (torch.randn(2, 8, 32),)
'''


def test_reshape_as_splits_its_other_tensor_as_its_result(tmp_path):
    analysis = analyze(_write(tmp_path, RESHAPE_AS))
    params = rewrite(analysis, PlanRequest(tp=2)).plan.params     # the dry run of the ranks included
    assert params["blocks.0.q.weight"]["tp"].startswith("S") and params["blocks.0.k.weight"]["tp"].startswith("S")


@pytest.mark.slow
def test_reshape_as_of_split_heads_trains_like_one_device_under_tp(tmp_path):
    result, outcome = _verify(tmp_path, RESHAPE_AS, "--tp", "2")
    assert result.returncode == 0 and outcome and outcome["passed"] is True, result.stdout + result.stderr


# MobileBERT: construction-time library code (transformers' weight tying pads a tied output
# bias to its weight's whole vocabulary) builds a parameter at another size than the plan's
# split; the dry run stopped the TP rewrite ("state dict mismatch: cls.predictions.bias has
# shape [128] in the rank's model but [64]"). The rewrite now plans again, once, with the
# parameters the dry run found misshapen kept whole.
RESIZED_AT_BUILD = '''
import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self, width=64):
        super().__init__()
        self.width = width
        self.up = nn.Linear(32, width)
        self.down = nn.Linear(width, 32)
        self.gain = nn.Parameter(torch.ones(width))
        self.gain.data = torch.full((self.width,), 0.5)     # built again from a size attribute

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)) * self.gain)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(2)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


def build():
    return Model()


def example_inputs():
    return (torch.randn(2, 8, 32),)
'''


def test_a_parameter_built_whole_at_construction_is_planned_whole(tmp_path):
    analysis = analyze(_write(tmp_path, RESIZED_AT_BUILD))
    params = rewrite(analysis, PlanRequest(tp=2)).plan.params     # the dry run of the ranks included
    assert params["blocks.0.gain"]["tp"] == "R"
    assert params["blocks.0.up.weight"]["tp"].startswith("S") and params["blocks.0.down.weight"]["tp"].startswith("S")


@pytest.mark.slow
def test_a_parameter_built_whole_at_construction_trains_like_one_device_under_tp(tmp_path):
    result, outcome = _verify(tmp_path, RESIZED_AT_BUILD, "--tp", "2")
    assert result.returncode == 0 and outcome and outcome["passed"] is True, result.stdout + result.stderr


# One constructor call building layers the plan splits unalike (JetMoE's experts class, built
# for the MLP's input and output and the attention's: the input split by its output size, the
# output by its input size). The rewrite divides a size in that one call for every instance,
# so it was refused ("instances of this constructor split weight differently"), then planned
# again with those parameters whole; that call is now left as written, its layers built whole
# and cut to each rank's share after build(), so the pair splits as Megatron's MLP does.
ONE_CTOR_TWO_ROLES = '''
import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.pair = nn.ModuleList([nn.Linear(32, 32) for _ in range(2)])
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, 32)

    def forward(self, x):
        x = x + self.pair[1](torch.relu(self.pair[0](x)))
        return x + self.down(torch.relu(self.up(x)))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(2)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


def build():
    return Model()


def example_inputs():
    return (torch.randn(2, 8, 32),)
'''


def test_one_constructor_call_split_unalike_is_built_whole_and_cut_after_build(tmp_path):
    analysis = analyze(_write(tmp_path, ONE_CTOR_TWO_ROLES))
    done = rewrite(analysis, PlanRequest(tp=2))
    plan = done.plan
    for b in (0, 1):
        assert (plan.params[f"blocks.{b}.pair.0.weight"]["tp"], plan.params[f"blocks.{b}.pair.1.weight"]["tp"]) \
            == ("S(0)", "S(1)")
    assert plan.params["blocks.0.up.weight"]["tp"].startswith("S")         # the rest still splits
    assert not any("stays whole" in w for w in plan.warnings), plan.warnings
    code = done.files["model.py"]
    assert "self.pair = nn.ModuleList([nn.Linear(32, 32) for _ in range(2)])\n" in code      # as written
    assert "self.up = nn.Linear(32, 64 // 2)" in code                       # divided where it is built
    assert "    'blocks.0.pair.1.weight': (1, 1, ['in_features']),\n" in code
    assert "'blocks.0.up.weight'" not in code.split("SPLIT_AFTER_BUILD")[1]


# Falcon-Mamba and Nemotron-H initialize `dt_proj.bias` in their constructor from a value
# computed at the whole size (`init.copy_(self.dt_proj.bias, inv_dt)` with `torch.rand(self.
# intermediate_size)`): the ranks' build() raised in the dry run. The parameters the failing
# line names (by the class of the module it reaches them through, `self.` or `module.`, and the
# attribute path), with the others their constructor call builds, are now kept whole in a plan
# solved again; Nemotron-H's second initializer (`init.copy_(module.dt_bias, ...)` in
# `_init_weights`) fails only in that plan, and a third plan keeps both whole.
INITIALIZED_WHOLE = '''
import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self, width=64):
        super().__init__()
        self.width = width
        self.up = nn.Linear(32, width)
        self.gate = nn.Linear(32, width)
        self.down = nn.Linear(width, 32)
        with torch.no_grad():
            self.up.bias.copy_(torch.linspace(-1, 1, self.width))    # initialized at the whole size

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)) * torch.sigmoid(self.gate(x)))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(2)])
        for block in self.blocks:
            self._init_weights(block)

    @torch.no_grad()
    def _init_weights(self, module):
        module.gate.bias.copy_(torch.full((module.width,), 0.1))   # the next one, through another name

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


def build():
    return Model()


def example_inputs():
    return (torch.randn(2, 8, 32),)
'''


def test_a_parameter_initialized_at_the_whole_size_is_planned_whole(tmp_path):
    plan = rewrite(analyze(_write(tmp_path, INITIALIZED_WHOLE)), PlanRequest(tp=2)).plan
    assert {plan.params[f"blocks.{b}.{layer}.{p}"]["tp"] for b in (0, 1) for layer in ("up", "gate")
            for p in ("weight", "bias")} == {"R"}
    line = _line_of(INITIALIZED_WHOLE, "self.up.bias.copy_(")
    assert any(f"model.py:{line}:" in w and "stays whole" in w for w in plan.warnings), plan.warnings


# A MoE layer: tokens dispatched to experts by `torch.where` (indices no rule relates to the
# batch), and a load-balancing loss that multiplies two means over every token of the batch.
MOE_BALANCE_LOSS = '''
import torch
import torch.nn as nn
import torch.nn.functional as F

C, E = 8, 4


class MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Linear(C, E)
        self.experts = nn.ModuleList(nn.Linear(C, C) for _ in range(E))

    def forward(self, x):
        tokens = x.reshape(-1, C)
        probs = self.router(tokens).softmax(-1)
        top = probs.argmax(-1)
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            idx = torch.where(top == e)[0]
            out = out.index_add(0, idx, expert(tokens[idx]) * probs[idx, e, None])
        counts = F.one_hot(top, E)
        aux = (probs.mean(0) * counts.float().mean(0)).sum()
        return out.reshape(x.shape), aux


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.moe = MoE()
        self.head = nn.Linear(C, 1)

    def forward(self, x):
        h, aux = self.moe(x)
        return self.head(h).pow(2).mean() + 0.01 * aux


def build():
    return Net()


def example_inputs():
    return (torch.randn(4, 6, C),)
'''


def test_a_moe_balance_loss_is_refused_at_the_mean_that_mixes_the_samples(tmp_path):
    """Rightly refused under data parallelism, but the error named the dispatch's `torch.where`
    a few lines earlier (whose rule cannot say how it treats the batch, though it keeps the
    tokens apart), not the mean over every token that the loss multiplies by another."""
    analysis = analyze(_write(tmp_path, MOE_BALANCE_LOSS))
    error = batch_split_problem(analysis.graph, "data parallel (--dp 2)")
    assert error is not None and error.location.line == _line_of(MOE_BALANCE_LOSS, "aux = ")
    assert error.location.col == MOE_BALANCE_LOSS.lstrip().splitlines()[error.location.line - 1].index("probs.mean")
    assert "Tensor.mean needs the whole batch" in error.message


PRODUCT_OF_MEANS = '''
import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        return h.pow(2).mean() * h.abs().mean()


def build():
    return Net()


def example_inputs():
    return (torch.randn(4, 8),)
'''


def test_a_product_of_two_batch_means_is_refused_at_the_product(tmp_path):
    """Each rank's product of its own slice's means, averaged, is not the product of the
    batch's means: it was written, and verify found it wrong (gradients off by 5e-2)."""
    analysis = analyze(_write(tmp_path, PRODUCT_OF_MEANS))
    error = batch_split_problem(analysis.graph, "data parallel (--dp 2)")
    assert error is not None and error.location.line == _line_of(PRODUCT_OF_MEANS, "h.pow(2).mean() *")
    assert "Tensor.mul multiplies values each reduced over the whole batch" in error.message
