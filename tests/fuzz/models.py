"""Hypothesis strategies that draw a small model as Python source, from a grammar of ops.

A drawn model is an entry file in the form the tool reads (`build()`, `example_inputs()`, a
forward that returns the loss): an input layer (an embedding of token ids, or a linear of
features), one `Block` or a loop over an `nn.ModuleList` of them, a head and a loss. A block is
a run of sublayers on the residual stream `x` of shape (B, T, D), each drawn from the grammar
below and added back as a residual or replacing `x`. Sometimes `Block` lives in a second file
that the entry imports. Widths are small (8-32), mostly divisible by 2 and 4, sometimes not, so
that each example runs in seconds and the tool meets sizes it cannot split.

This module only writes source text; it never runs the tool (runner.py does).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import strategies as st

BATCH = 4           # divides by dp 2 and by pp 2's two micro-batches
WIDTHS = st.sampled_from([8, 16, 32, 12, 24, 8, 16, 10, 9, 15])   # most divisible by 4, a few not
SEQ_LENS = st.sampled_from([4, 6, 8, 5])
ACTIVATIONS = ["F.gelu", "F.relu", "torch.tanh", "F.silu"]


@dataclass
class Sublayer:
    init: list[str]                  # statements of Block.__init__ (after super().__init__())
    forward: list[str]               # statements of Block.forward: read x, assign h (B, T, D)
    needs_shape: bool = False        # reads B, T, C (bound once at the top of forward)


@dataclass
class DrawnModel:
    """Source files of one model: {file name: text}; the entry is `entry`."""
    files: dict[str, str]
    entry: str
    blocks_in_loop: int              # blocks in the nn.ModuleList loop; 0 when there is no loop
    kinds: list[str] = field(default_factory=list)

    def source(self) -> str:
        """All files, entry last, for a failure report."""
        return "\n".join(f"# ---- {name} ----\n{text}" for name, text in
                         sorted(self.files.items(), key=lambda kv: kv[0] == self.entry))


def _mlp(draw, i: int, d: int, t: int) -> Sublayer:
    hidden = draw(WIDTHS)
    act = draw(st.sampled_from(ACTIVATIONS))
    if draw(st.booleans()):
        return Sublayer([f"self.fc{i} = nn.Linear({d}, {hidden})", f"self.proj{i} = nn.Linear({hidden}, {d})"],
                        [f"h = self.proj{i}({act}(self.fc{i}(x)))"])
    return Sublayer([f"self.gate{i} = nn.Linear({d}, {hidden}, bias=False)",
                     f"self.up{i} = nn.Linear({d}, {hidden}, bias=False)",
                     f"self.down{i} = nn.Linear({hidden}, {d}, bias=False)"],
                    [f"h = {act}(self.gate{i}(x)) * self.up{i}(x)", f"h = self.down{i}(h)"])


def _layer_norm(draw, i, d, t) -> Sublayer:
    return Sublayer([f"self.norm{i} = nn.LayerNorm({d})"], [f"h = self.norm{i}(x)"])


def _rms_norm(draw, i, d, t) -> Sublayer:
    return Sublayer([f"self.rms{i} = nn.Parameter(torch.ones({d}))"],
                    [f"h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.rms{i}"])


def _attention(draw, i, d, t) -> Sublayer:
    heads = draw(st.sampled_from([n for n in (1, 2, 4) if d % n == 0]))
    init, fwd = [], []
    if draw(st.booleans()):
        init.append(f"self.qkv{i} = nn.Linear({d}, 3 * {d})")
        fwd.append(f"q, k, v = self.qkv{i}(x).split(C, dim=2)")
    else:
        init += [f"self.{n}{i} = nn.Linear({d}, {d}, bias=False)" for n in "qkv"]
        fwd.append(f"q, k, v = self.q{i}(x), self.k{i}(x), self.v{i}(x)")
    init.append(f"self.out{i} = nn.Linear({d}, {d})")
    fwd += [f"q = q.view(B, T, {heads}, C // {heads}).transpose(1, 2)  # (B, nh, T, hs)",
            f"k = k.view(B, T, {heads}, C // {heads}).transpose(1, 2)",
            f"v = v.view(B, T, {heads}, C // {heads}).transpose(1, 2)"]
    einsum = draw(st.booleans())
    if einsum:
        fwd.append(f"att = torch.einsum('bhtd,bhsd->bhts', q, k) * (1.0 / (C // {heads}) ** 0.5)")
    else:
        fwd.append(f"att = (q @ k.transpose(-2, -1)) * (1.0 / (C // {heads}) ** 0.5)")
    if draw(st.booleans()):
        fwd.append("att = att.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float('-inf'))")
    fwd.append("att = F.softmax(att, dim=-1)")
    fwd.append("y = torch.einsum('bhts,bhsd->bhtd', att, v)" if einsum else "y = att @ v")
    fwd.append(f"h = self.out{i}(y.transpose(1, 2).reshape(B, T, C))")
    return Sublayer(init, fwd, needs_shape=True)


def _scale_shift(draw, i, d, t) -> Sublayer:
    return Sublayer([f"self.gain{i} = nn.Parameter(torch.ones({d}))", f"self.shift{i} = nn.Parameter(torch.zeros({d}))"],
                    [f"h = x * self.gain{i} + self.shift{i}"])


def _weight_matmul(draw, i, d, t) -> Sublayer:
    out = draw(st.sampled_from(["x @ self.w{i}", "torch.matmul(x, self.w{i})",
                                "torch.einsum('btd,de->bte', x, self.w{i})"])).format(i=i)
    return Sublayer([f"self.w{i} = nn.Parameter(torch.randn({d}, {d}) / {d} ** 0.5)"], [f"h = {out}"])


def _split_cat(draw, i, d, t) -> Sublayer:
    if d % 2 == 0 and draw(st.booleans()):
        split = "a, b = x.chunk(2, dim=-1)"
    else:
        s = draw(st.integers(1, d - 1))
        split = f"a, b = x.split([{s}, {d - s}], dim=-1)"
    return Sublayer([], [split, "h = torch.cat([torch.tanh(a), b * 2], dim=-1)"])


def _reshape_mix(draw, i, d, t) -> Sublayer:
    groups = draw(st.sampled_from([g for g in (2, 4) if d % g == 0] or [1]))
    return Sublayer([], [f"h = x.reshape(B, T, {groups}, C // {groups}).transpose(2, 3).reshape(B, T, C)"],
                    needs_shape=True)


def _token_mix(draw, i, d, t) -> Sublayer:
    return Sublayer([f"self.mix{i} = nn.Linear({t}, {t})"], [f"h = self.mix{i}(x.transpose(1, 2)).transpose(1, 2)"])


def _reduction(draw, i, d, t) -> Sublayer:
    return Sublayer([], [draw(st.sampled_from([
        "h = x - x.mean(dim=1, keepdim=True)",
        "h = x * torch.sigmoid(x.sum(-1, keepdim=True))",
        "h = x / (x.abs().amax(dim=-1, keepdim=True) + 1)",
        "h = x + x.var(dim=-1, keepdim=True)",
    ]))])


def _softmax(draw, i, d, t) -> Sublayer:
    return Sublayer([], [draw(st.sampled_from(["h = x * F.softmax(x, dim=-1)", "h = x * F.softmax(x, dim=1)"]))])


def _index_read(draw, i, d, t) -> Sublayer:
    k = draw(st.integers(1, d - 1))
    return Sublayer([], [draw(st.sampled_from([
        "h = torch.cat([x[:, :1] * 2, x[:, 1:]], dim=1)",
        "h = x * x[:, :1]",
        f"h = torch.cat([x[..., :{k}], x[..., {k}:] * 0.5], dim=-1)",
    ]))])


def _index_write(draw, i, d, t) -> Sublayer:
    k = draw(st.integers(1, d - 1))
    choice = draw(st.sampled_from(["first", "prefix", "param"]))
    if choice == "param":
        return Sublayer([f"self.tok{i} = nn.Parameter(torch.zeros({d}))"],
                        ["h = x.clone()", f"h[:, 1] += self.tok{i}"])
    write = "h[:, 0] = h[:, 0] * 2" if choice == "first" else f"h[..., :{k}] = 0"
    return Sublayer([], ["h = x.clone()", write])


GRAMMAR = {
    "mlp": _mlp, "layer_norm": _layer_norm, "rms_norm": _rms_norm, "attention": _attention,
    "scale_shift": _scale_shift, "weight_matmul": _weight_matmul, "split_cat": _split_cat,
    "reshape_mix": _reshape_mix, "token_mix": _token_mix, "reduction": _reduction, "softmax": _softmax,
    "index_read": _index_read, "index_write": _index_write,
}

HEADER = "import torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n"


def _indent(lines: list[str], depth: int) -> str:
    return "".join("    " * depth + line + "\n" for line in lines)


def _block_class(sublayers: list[tuple[Sublayer, bool]], d: int) -> str:
    init = [s for sub, _ in sublayers for s in sub.init]
    fwd = ["B, T, C = x.shape"] if any(sub.needs_shape for sub, _ in sublayers) else []
    for sub, residual in sublayers:
        fwd += sub.forward
        fwd.append("x = x + h" if residual else "x = h")
    fwd.append("return x")
    return ("class Block(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
            + _indent(init or ["pass"], 2) + "\n    def forward(self, x):\n" + _indent(fwd, 2))


@st.composite
def models(draw) -> DrawnModel:
    """One model: the block's sublayers, the input and loss, the loop, maybe a second file."""
    d, t = draw(WIDTHS), draw(SEQ_LENS)
    kinds = draw(st.lists(st.sampled_from(sorted(GRAMMAR)), min_size=1, max_size=4))
    sublayers = [(GRAMMAR[kind](draw, i, d, t), draw(st.booleans())) for i, kind in enumerate(kinds)]
    blocks = draw(st.sampled_from([0, 2, 1, 3]))          # 0: one Block, called without a loop
    embedding = draw(st.booleans())
    classify = draw(st.booleans())
    out = draw(WIDTHS)
    two_files = draw(st.sampled_from([False, False, False, True]))   # a quarter: Block in a second file
    name = "fz_" + "_".join(k[:3] for k in kinds)     # the runner makes file names unique

    init = [f"self.embed = nn.Embedding({out if classify else 16}, {d})" if embedding
            else f"self.embed = nn.Linear({out if classify else 8}, {d})"]
    init.append(f"self.blocks = nn.ModuleList([Block() for _ in range({blocks})])" if blocks else "self.block = Block()")
    if draw(st.booleans()):
        init.append(f"self.norm = nn.LayerNorm({d})")
    init.append(f"self.head = nn.Linear({d}, {out})")
    fwd = ["x = self.embed(inputs)"]
    fwd += ["for block in self.blocks:", "    x = block(x)"] if blocks else ["x = self.block(x)"]
    if any(line.startswith("self.norm =") for line in init):
        fwd.append("x = self.norm(x)")
    fwd.append("logits = self.head(x)")
    fwd.append(f"return F.cross_entropy(logits.reshape(-1, {out}), targets.reshape(-1))" if classify
               else "return F.mse_loss(logits, targets)")
    vocab = out if classify else 16
    inputs = (f"torch.randint(0, {vocab}, ({BATCH}, {t}))" if embedding
              else f"torch.randn({BATCH}, {t}, {out if classify else 8})")
    targets = f"torch.randint(0, {out}, ({BATCH}, {t}))" if classify else f"torch.randn({BATCH}, {t}, {out})"
    model = ("class Model(nn.Module):\n    def __init__(self):\n        super().__init__()\n" + _indent(init, 2)
             + "\n    def forward(self, inputs, targets):\n" + _indent(fwd, 2))
    entry_tail = (f"\n\n{model}\n\ndef build():\n    return Model()\n\n\n"
                  f"def example_inputs():\n    return ({inputs}, {targets})\n")
    block = _block_class(sublayers, d)
    doc = f'"""Drawn by tests/fuzz: {", ".join(kinds)}; {blocks or "one"} block(s)."""\n'
    if two_files:
        files = {f"{name}_blocks.py": doc + HEADER + "\n\n" + block,
                 f"{name}.py": doc + HEADER + f"\nfrom {name}_blocks import Block\n" + entry_tail}
    else:
        files = {f"{name}.py": doc + HEADER + "\n\n" + block + entry_tail}
    return DrawnModel(files, f"{name}.py", blocks, kinds)
