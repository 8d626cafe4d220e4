"""Repeated blocks traced once (trace/replicate.py): the copied records equal a full trace's, op
for op, and a block whose forward reads a per-layer attribute is traced per value."""
from __future__ import annotations

import textwrap

import pytest
import torch

from nnscaler_cst.graph.oprules import load_rules
from nnscaler_cst.source.entry import load_entry
from nnscaler_cst.source.files import SourceSet
from nnscaler_cst.trace import tracer as tracer_module
from nnscaler_cst.trace.replay import TensorRef

BLOCKS = '''
import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d, layer_idx, gelu_every):
        super().__init__()
        self.layer_idx = layer_idx                    # never read by forward: copies still fit
        self.gelu = gelu_every and layer_idx % gelu_every == 0
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x, scale: float):
        h = self.up(self.norm(x))
        h = F.gelu(h) if self.gelu else torch.relu(h)   # a per-layer branch on an attribute
        return x + self.down(h) * scale


class Model(nn.Module):
    def __init__(self, gelu_every):
        super().__init__()
        self.blocks = nn.ModuleList(Block(8, i, gelu_every) for i in range(4))
        self.head = nn.Linear(8, 3)

    def forward(self, x, y):
        for block in self.blocks:
            x = block(x, 0.5)
        return F.cross_entropy(self.head(x).flatten(0, 1), y.flatten())


def build():
    return Model(GELU_EVERY)


def example_inputs():
    return {"x": torch.randn(2, 5, 8), "y": torch.randint(0, 3, (2, 5))}
'''


def _value(v):
    if isinstance(v, TensorRef):
        return f"T{v.tid}"
    if isinstance(v, torch.nn.Module):
        return type(v).__name__
    if isinstance(v, (tuple, list)):
        return [_value(x) for x in v]
    if isinstance(v, dict):
        return {k: _value(x) for k, x in v.items()}
    return getattr(v, "__qualname__", repr(v))


def _records(trace) -> list:
    """Everything the trace recorded, storages numbered by first appearance."""
    storages: dict = {}
    number = lambda s: None if s is None else (storages.setdefault(s[0], len(storages)), s[1])  # noqa: E731
    out = [(t, i.shape, i.dtype, i.requires_grad, i.producer, i.param, i.buffer, i.input_name, i.stride,
            number(i.storage)) for t, i in sorted(trace.tensors.items())]
    out += [(n.index, n.span, n.callee, n.callee_kind, n.module_path, n.callee_path, n.ops, n.outputs, n.produced,
             n.mapped, [(o.name, o.path, o.tid, repr(o.value)) for o in n.operands]) for n in trace.nodes]
    out += [repr(op) for op in trace.ops]
    out += [(k, _value(r.fn), _value(r.args), _value(r.kwargs), r.state, r.outputs)
            for replays in (trace.replays, trace.module_replays) for k, r in sorted(replays.items())]
    out += [repr(getattr(trace, name)) for name in (
        "size_queries", "module_calls", "containers", "module_runs", "state_writes", "saved", "mixed_containers")]
    out.append(sorted(number((s, 0))[0] for s in trace.kept_storages))
    return out


def _trace(path, replicate: bool):
    rules, sources = load_rules(), SourceSet()
    entry = load_entry(path, sources)
    copies = []
    original = tracer_module.Tracer.run

    def run(self, *args, **kwargs):
        trace = original(self, *args, **kwargs)
        copies.append(self.replicator.copies if self.replicator else 0)
        return trace
    tracer_module.Tracer.run = run
    try:
        trace = tracer_module.trace_model(entry, sources, library_modules=rules.library_modules,
                                          traced_modules=rules.traced_modules, replicate=replicate)
    finally:
        tracer_module.Tracer.run = original
    return trace, copies[-1]


@pytest.mark.parametrize("gelu_every, copies", [(0, 2), (2, 1)])
def test_copied_blocks_record_what_tracing_them_records(tmp_path, gelu_every, copies):
    path = tmp_path / "blocks.py"
    path.write_text(textwrap.dedent(BLOCKS).replace("GELU_EVERY", str(gelu_every)))
    full, none = _trace(path, replicate=False)
    copied, made = _trace(path, replicate=True)
    # block 0 takes the model's input (a leaf), the others a block's output: blocks 2 and 3 copy
    # block 1, unless gelu every 2nd layer, where block 2 (gelu) is traced and block 3 copies block 1
    assert none == 0 and made == copies
    assert _records(copied) == _records(full)
    callees = [n.callee for n in copied.nodes if n.module_path.startswith("blocks.")]
    assert callees.count("torch.nn.functional.gelu") == (2 if gelu_every else 0)


def test_the_evoformer_trunk_copies_its_blocks(fixtures_dir):
    full, _ = _trace(fixtures_dir / "evoformer.py", replicate=False)
    copied, made = _trace(fixtures_dir / "evoformer.py", replicate=True)
    assert made == 4            # 2 blocks x 3 recycles: one template with and one without grad
    assert _records(copied) == _records(full)


SUBCLASS_BLOCKS = '''
import torch
import torch.nn as nn


class RowConv(nn.Conv2d):           # a library's subclass fixing only the constructor's arguments
    def __init__(self, c):
        super().__init__(c, c, (1, 3), padding=(0, 1), bias=False)


class FullConv(nn.Conv2d):
    def __init__(self, c):
        super().__init__(c, c, 3, padding=1, bias=False)


class Block(nn.Module):
    def __init__(self, c, conv):
        super().__init__()
        self.conv = nn.Sequential(conv(c), nn.GroupNorm(2, c))

    def forward(self, x):
        return torch.relu(self.conv(x) + x)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(4, FullConv), Block(4, FullConv), Block(4, RowConv), Block(4, RowConv)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.mean()


def build():
    return Model()


def example_inputs():
    return (torch.randn(2, 4, 5, 5),)
'''


def test_a_traced_template_sees_its_layer_subclasses_as_their_torch_layers(tmp_path):
    """The line calling a block's Sequential of a conv subclass (nn.Conv2d's forward) and a norm
    runs the same layers in every block, templates and copies alike: no mixed container."""
    path = tmp_path / "subclass_blocks.py"
    path.write_text(SUBCLASS_BLOCKS)
    full, _ = _trace(path, replicate=False)
    copied, made = _trace(path, replicate=True)
    assert made == 1 and not full.mixed_containers      # block 3 copies block 2 (block 1 takes the input)
    assert _records(copied) == _records(full)
