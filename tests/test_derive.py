"""Derived op semantics (graph/derive.py): calls no rule in rules/ops describes get their
split labels from a numeric probe of torch itself.

Each case is an op whose splits follow from its mathematics: the test says which dims may
split and which must stay whole, and then checks every derived label against real torch on
fresh random tensors cut in four (the probe itself cuts in two).
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.utils._pytree import tree_flatten

from nnscaler_cst.analysis import analyze
from nnscaler_cst.emit.beside import beside_warning, modules_beside
from nnscaler_cst.graph.derive import _real
from nnscaler_cst.rewrite import PlanRequest, rewrite
from nnscaler_cst.trace.replay import substitute

HELPERS = '''
import torch


def shift_right(ids, pad):
    ids = ids.clone()          # rebinds its argument before anything else: replay must see the call's own
    out = ids.new_zeros(ids.shape)
    out[:, 1:] = ids[:, :-1]
    out[:, 0] = pad
    return out


def causal_mask(x):
    b, t = x.shape[:2]
    return torch.ones(t, t, dtype=torch.bool).tril().expand(b, 1, t, t)


def contract(a, b):
    return torch.einsum("bik,bkj->bij", a, b)
'''

MODEL = '''
import torch
import torch.nn.functional as F
from probe_helpers import causal_mask, contract, shift_right


class Probe(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Linear(6, 6)

    def forward(self, x, ids, heads, img):
        s = self.w(x)
        top = torch.topk(s, 2, dim=-1).values
        rep = heads.repeat_interleave(2, dim=1)
        zeros = x.new_zeros(x.shape)
        run = torch.logcumsumexp(s, dim=-1)
        pad = F.pad(s, (1, 1))
        rolled = torch.roll(s, 1, dims=1)
        shifted = shift_right(ids, 0)
        mask = causal_mask(x)
        both = contract(s, s.transpose(1, 2))
        chosen = torch.zeros_like(s)
        chosen.scatter_(-1, torch.topk(s, 2, dim=-1).indices, 1.0)
        return (top.sum() + rep.sum() + zeros.sum() + run.sum() + pad.sum() + rolled.sum()
                + shifted.float().sum() + mask.float().sum() + both.sum() + (chosen * s).sum())


def build():
    return Probe()


def example_inputs():
    return (torch.randn(4, 8, 6), torch.randint(0, 8, (4, 8)), torch.randn(4, 4, 8, 6), torch.randn(4, 6, 4, 4))
'''


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    folder = tmp_path_factory.mktemp("derive")
    (folder / "probe_helpers.py").write_text(textwrap.dedent(HELPERS))
    (folder / "probe_model.py").write_text(textwrap.dedent(MODEL))
    import sys
    sys.path.insert(0, str(folder))
    try:
        analysis = analyze(folder / "probe_model.py")
    finally:
        sys.path.remove(str(folder))
    return analysis


def _site(analysis, callee: str):
    nodes = [n for n in analysis.trace.nodes if n.callee.endswith(callee)]
    assert nodes, f"no call of {callee} traced"
    node = nodes[0]
    dims = analysis.graph.dims.get(node.index)
    assert dims is not None, analysis.graph.problems.get(node.index)
    assert analysis.graph.node_rule[node.index].name == "derived"
    return node, dims


def _split_dims(dims, operand: str) -> set[int]:
    return {d for d, factors in enumerate(dims.inputs[operand].dims) if factors}


@pytest.mark.parametrize("callee, operand, split, whole", [
    ("torch.topk", "arg0", {0, 1}, {2}),                  # k largest along the last dim: rows are apart
    ("Tensor.repeat_interleave", "arg0", {0, 1, 2, 3}, set()),   # a head repeated stays with its head
    ("torch.logcumsumexp", "arg0", {0, 1}, {2}),                # a running sum mixes along its dim
    ("torch.nn.functional.pad", "arg0", {0, 1}, {2}),     # padding both ends of the last dim
    ("torch.roll", "arg0", {0, 2}, {1}),                  # rolled along dim 1
    ("probe_helpers.shift_right", "ids", {0}, {1}),        # samples apart, positions shifted
])
def test_derived_split_dims(probed, callee, operand, split, whole):
    _, dims = _site(probed, callee)
    found = _split_dims(dims, operand)
    assert split <= found and not (whole & found), f"{callee}: derived splits {sorted(found)}"


def test_shape_only_operands_are_no_data(probed):
    """`x.new_zeros(x.shape)` and a mask built from `x.shape` never read x's values."""
    for callee, operand in [("Tensor.new_zeros", "arg0"), ("probe_helpers.causal_mask", "x")]:
        _, dims = _site(probed, callee)
        assert operand in dims.shape_only, callee


def test_indices_read_as_a_set_are_data(probed):
    """`mask.scatter_(-1, topk_indices, 1)`: each row of indices holds k distinct columns, so
    shifting every index within the range leaves the row's set, and the result, unchanged; the
    indices are still data, split with the rows they index."""
    _, dims = _site(probed, "Tensor.scatter_")
    assert "arg2" not in dims.shape_only
    assert _split_dims(dims, "arg2") == _split_dims(dims, "arg0") == {0, 1}


def test_contraction_is_a_partial_sum(probed):
    _, dims = _site(probed, "probe_helpers.contract")
    a, b = dims.inputs["a"].dims, dims.inputs["b"].dims
    k = a[2][0].label
    assert k in dims.reduced and b[1][0].label == k          # k summed: halves add up
    assert a[0][0].label == b[0][0].label not in dims.reduced  # b kept apart


def _four_way_holds(analysis, node, dims, label: str) -> bool:
    """Cut every operand dim carrying `label` in four, run real torch on fresh values: the
    pieces concatenated (or summed) equal the whole result."""
    replay = analysis.trace.replays[node.index]
    tensors = analysis.trace.tensors
    generator = torch.Generator().manual_seed(1234)
    base = {tid: _real(tensors[tid].shape, tensors[tid].dtype, generator) for tid in
            {t.tid for t in dims.inputs.values()} | set(replay.state.values())}

    def run(values):
        args, kwargs = substitute(replay.args, values), substitute(replay.kwargs, values)
        with torch.no_grad():
            if replay.module is not None:
                state = {name: values[tid] for name, tid in replay.state.items()}
                return torch.func.functional_call(replay.module, state, args, kwargs)
            return replay.fn(*args, **kwargs)

    def first(result):
        return tree_flatten(result)[0][0]

    whole = first(run(base))
    pieces = []
    for k in range(4):
        values = dict(base)
        for tensor in dims.inputs.values():
            where = tensor.where(label)
            if where is not None:
                size = tensors[tensor.tid].shape[where[0]] // 4
                values[tensor.tid] = base[tensor.tid].narrow(where[0], k * size, size)
        pieces.append(first(run(values)))
    out = dims.outputs[0]
    if label in dims.reduced:
        return torch.allclose(sum(pieces), whole, atol=1e-5)
    where = out.where(label)
    if where is None:
        return all(torch.equal(p, whole) for p in pieces)
    return torch.allclose(torch.cat(pieces, where[0]), whole, atol=1e-5)


@pytest.mark.parametrize("callee", ["torch.topk", "Tensor.repeat_interleave", "torch.logcumsumexp",
                                    "torch.nn.functional.pad", "torch.roll", "probe_helpers.contract",
                                    "Tensor.scatter_"])
def test_derived_labels_hold_four_ways(probed, callee):
    node, dims = _site(probed, callee)
    labels = [l for l in dims.splittable() if all(
        s % 4 == 0 for t in dims.inputs.values() for d, s in enumerate(probed.trace.tensors[t.tid].shape)
        if t.where(l) and t.where(l)[0] == d)]
    assert labels
    for label in labels:
        assert _four_way_holds(probed, node, dims, label), f"{callee}: label {label} fails split in four"


NO_RULE_MODEL = '''
import torch
import torch.nn as nn
import torch.nn.functional as F


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 64)
        self.fc2 = nn.Linear(64, 8)

    def forward(self, x, y):
        h = self.fc1(x)
        h = torch.fliplr(h) + torch.cumprod(h.sigmoid(), dim=-1)
        return F.mse_loss(self.fc2(h), y)


def build():
    return Net()


def example_inputs():
    return (torch.randn(4, 16), torch.randn(4, 8))
'''


@pytest.mark.slow
@pytest.mark.parametrize("plan", [("--tp", "2"), ("--dp", "2")], ids=["tp2", "dp2"])
def test_ops_without_rules_on_a_split_path_train_like_one_device(tmp_path, plan):
    """fliplr and cumprod have no rule: derived, they run split where they can (rows apart)
    and whole, between a gather and a scatter, where they cannot; never refused."""
    model = tmp_path / "model.py"
    model.write_text(NO_RULE_MODEL.lstrip())
    result = subprocess.run([sys.executable, "-m", "nnscaler_cst.cli", "verify", str(model), *plan,
                             "-o", str(tmp_path / "out"), "--json"], capture_output=True, text=True, timeout=600)
    outcome = json.loads(result.stdout[result.stdout.find("{"):])
    assert result.returncode == 0 and outcome["passed"] is True, result.stdout + result.stderr


STEP_HELPERS = '''
import torch


class Steps:
    """Holds a counter, as transformers' caches do: made in forward, scalars only."""

    def __init__(self):
        self.seen = torch.zeros((), dtype=torch.long)
        self.scale = torch.ones(())
'''

TUPLE_EINSUM_MODEL = '''
import torch
import torch.nn as nn
from step_helpers import Steps


class Mixer(nn.Module):
    def __init__(self, width=16, heads=4):
        super().__init__()
        self.heads = heads
        self.qk = nn.Linear(width, 2 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x):
        steps = Steps()
        q, k = self.qk(x).chunk(2, dim=-1)
        b, t, c = q.shape
        q = q.view(b, t, self.heads, c // self.heads)
        k = k.view(b, t, self.heads, c // self.heads)
        scores = torch.einsum("bthd,bshd->bhts", (q, k)).softmax(-1)     # the operands as one tuple
        mixed = torch.einsum("bhts,bshd->bthd", (scores, k)).reshape(b, t, c)
        return self.out(mixed) * steps.scale


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Mixer() for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x.pow(2).mean()


def build():
    return Net()


def example_inputs():
    return (torch.randn(4, 8, 16),)
'''


@pytest.fixture(scope="module")
def tuple_einsum(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tuple_einsum")
    (folder / "step_helpers.py").write_text(STEP_HELPERS.lstrip())
    (folder / "tuple_einsum.py").write_text(TUPLE_EINSUM_MODEL.lstrip())
    sys.path.insert(0, str(folder))
    try:
        return folder / "tuple_einsum.py", analyze(folder / "tuple_einsum.py")
    finally:
        sys.path.remove(str(folder))


def test_einsum_with_its_operands_in_one_tuple_has_the_equations_labels(tuple_einsum):
    """`torch.einsum(eq, (a, b))`, the older calling form (Longformer, LED): the equation's
    letters label the tuple's tensors; d is summed, the heads h split both."""
    _, analysis = tuple_einsum
    node = next(n for n in analysis.trace.nodes if n.callee.endswith("einsum"))
    dims = analysis.graph.dims.get(node.index)
    assert dims is not None, analysis.graph.problems.get(node.index)
    q, k = (dims.inputs[name].dims for name in sorted(dims.inputs))
    assert q[3][0].label == k[3][0].label == "d" and "d" in dims.reduced
    assert q[2][0].label == k[2][0].label == "h" and "h" not in dims.reduced


def test_a_call_with_scalars_only_runs_whole_without_a_probe(tuple_einsum):
    """A helper object's constructor that makes scalar tensors (a cache's counters) has no dim
    to split: it is annotated, with nothing splittable, instead of left without a rule."""
    _, analysis = tuple_einsum
    node = next(n for n in analysis.trace.nodes if n.callee.endswith("Steps.__init__"))
    dims = analysis.graph.dims.get(node.index)
    assert dims is not None, analysis.graph.problems.get(node.index)
    assert dims.splittable() == []
    assert analysis.graph.summary()["unannotated_sites"] == 0


def test_a_helper_module_beside_the_model_is_named_when_the_output_goes_elsewhere(tuple_einsum, tmp_path):
    """The programs keep `from step_helpers import Steps`; the output does not hold
    step_helpers, so written away from the model's folder it needs that folder on the path."""
    path, analysis = tuple_einsum
    files = rewrite(analysis, PlanRequest(tp=2)).files
    assert modules_beside(files, path.parent) == ["step_helpers"]
    assert beside_warning(files, path, path.parent / "parallel") is None
    warning = beside_warning(files, path, tmp_path / "out")
    assert "step_helpers" in warning and f"PYTHONPATH={path.parent}" in warning


@pytest.mark.slow
def test_tuple_einsum_heads_split_trains_like_one_device(tmp_path, tuple_einsum):
    """Written away from the model's folder: verify's ranks find step_helpers on their path,
    as the warning tells a user to run them."""
    path, _ = tuple_einsum
    result = subprocess.run([sys.executable, "-m", "nnscaler_cst.cli", "verify", str(path), "--tp", "2",
                             "-o", str(tmp_path / "out"), "--json"], capture_output=True, text=True, timeout=600)
    outcome = json.loads(result.stdout[result.stdout.find("{"):])
    assert result.returncode == 0 and outcome["passed"] is True, result.stdout + result.stderr
    assert "warning: the programs import step_helpers" in result.stderr


# wav2vec2's positional conv: a grouped conv under weight norm over its kernel dim, before
# transformer blocks. Its weight is two parameters, `original0` (g, 1 x 1 x K) and `original1`
# (v, C x C/4 x K); torch's CPU weight-norm kernel does not check that they agree.
WEIGHT_NORM_MODEL = '''
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.parametrizations import weight_norm

C, H, K, V = 16, 4, 32, 32


class ConvPosition(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = weight_norm(nn.Conv1d(C, C, K, padding=K // 2, groups=4), name="weight", dim=2)

    def forward(self, x):
        return x + F.gelu(self.conv(x.transpose(1, 2))[:, :, :-1]).transpose(1, 2)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(C)
        self.qkv = nn.Linear(C, 3 * C)
        self.proj = nn.Linear(C, C)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, t, 3, H, C // H).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return x + self.proj(y.transpose(1, 2).reshape(b, t, C))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, C)
        self.position = ConvPosition()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(C, V)

    def forward(self, idx, targets):
        x = self.position(self.embed(idx))
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def build():
    return Net()


def example_inputs():
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, V, (4, 8), generator=g), torch.randint(0, V, (4, 8), generator=g))
'''


@pytest.fixture(scope="module")
def weight_norm_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("weight_norm") / "weight_norm.py"
    path.write_text(WEIGHT_NORM_MODEL.lstrip())
    return path


def test_a_weight_normed_conv_is_probed_without_aborting(weight_norm_model):
    """Halving `original0` on the kernel dim alone, the probe once fed the weight-norm kernel a g
    half as long as v's norms: it wrote past its buffer and every command aborted (exit 134,
    no message). Sliced shapes run on fake tensors first, which check them. No split of the
    conv rebuilds its result (the norm runs over its channels), so it stays whole, said where."""
    result = subprocess.run([sys.executable, "-m", "nnscaler_cst.cli", "plan", str(weight_norm_model), "--tp", "2"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"{weight_norm_model}:15:27: warning: torch.nn.utils.parametrize.ParametrizedConv1d is replicated " \
           "on every tensor-parallel rank" in result.stderr.replace("\n", " ")


@pytest.mark.slow
def test_a_weight_normed_conv_pipelines_like_one_device(weight_norm_model, tmp_path):
    """The stage calling the conv holds the parametrization module inside it (`original0`,
    `original1`): it was dropped from stage 0 as a module no op calls, and the conv's forward
    raised KeyError: 'weight'."""
    result = subprocess.run([sys.executable, "-m", "nnscaler_cst.cli", "verify", str(weight_norm_model), "--pp", "2",
                             "--micro-batches", "2", "-o", str(tmp_path / "out"), "--json"],
                            capture_output=True, text=True, timeout=600)
    outcome = json.loads(result.stdout[result.stdout.find("{"):])
    assert result.returncode == 0 and outcome["passed"] is True, result.stdout + result.stderr



ONEDNN_MODEL = '''
import torch
from torch import nn

SEEN = []      # (layer, whether oneDNN was on) each time a layer ran


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.rnn = nn.LSTM(8, 16, batch_first=True, proj_size=8)    # projected: no rule splits it, the probe runs

    def forward(self, x):
        y = self.conv(x).flatten(2).transpose(1, 2)
        return self.rnn(y)[0].sum()


def build():
    net = Net()
    for name in ("conv", "rnn"):
        getattr(net, name).register_forward_pre_hook(
            lambda module, args, name=name: SEEN.append((name, torch.backends.mkldnn.enabled)))
    return net


def example_inputs():
    return (torch.randn(4, 8, 4, 4),)
'''


def test_the_probe_runs_convs_on_onednn_and_recurrent_layers_on_torchs_own_kernels(tmp_path):
    """oneDNN's depthwise convolutions are many times faster than torch's own (a third of a
    ConvNeXt's rewrite went into its probes), while its inference LSTM takes seconds per call
    on some CPUs: only a call running a recurrent layer turns oneDNN off."""
    path = tmp_path / "onednn.py"
    path.write_text(ONEDNN_MODEL.lstrip())
    seen = analyze(path).entry.module.SEEN
    conv = [on for name, on in seen if name == "conv"]
    rnn = [on for name, on in seen if name == "rnn"]
    assert len(conv) > 3 and len(rnn) > 3         # the trace's calls, then the probes'
    assert all(conv) and not any(rnn[1:])       # the first: the trace
