"""Activation recompute per block: where the checkpoint goes, and what it saves.

With --recompute every repeated block (the ones pipelines cut into stages, plan/pipeline.py)
runs under torch.utils.checkpoint at the call in the loop over the blocks: forward keeps only
the block's inputs, backward runs the block's forward again to rebuild the rest. The memory
model reads `block_activations` for the bytes one block holds from its forward to its backward
either way. Decides and measures; rewrites nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from ..errors import UserError
from ..graph.graph import Graph
from ..source.files import Span
from .cost import DeviceSpec, compute_time, node_flops
from .memory import saved_bytes
from .pipeline import find_chain, find_trunk, node_blocks


@dataclass(frozen=True)
class BlockActivations:
    """Activation bytes of one repeated block, at the traced (global, unsplit) sizes."""

    container: str       # module path of the blocks' container: transformer.h
    blocks: int          # how many blocks it holds
    saved: int           # bytes a block keeps from forward to backward without recompute
    inputs: int          # bytes a block keeps with recompute: its tensor inputs only
    rebuilt: int         # bytes its recompute holds at once in backward (one block's activations)

    def kept(self, recompute: bool) -> int:
        """Bytes one block holds between its forward and its backward."""
        return self.inputs if recompute else self.saved


def recompute_site(graph: Graph) -> Span:
    """The call of one block in the loop over the blocks: the call --recompute checkpoints."""
    try:
        trunk = find_trunk(graph)
    except UserError as exc:        # said for pipelines; the same blocks are what recompute needs
        raise UserError(f"--recompute checkpoints each repeated block, and finds none: {exc.message}",
                        exc.location, hint="drop --recompute, or build the model from a ModuleList of "
                        "blocks called in a `for` loop", related=exc.related) from None
    if trunk.statements is not None:
        raise UserError(f"--recompute checkpoints each repeated block, and finds none: the pipeline stages cut "
                        f"{trunk.container}, a chain of statements", trunk.function_span.start,
                        hint="drop --recompute, or build the model from a ModuleList of blocks called in a `for` loop")
    span = graph.trace.module_calls[trunk.blocks[0]][0]
    if span in graph.trace.containers:
        raise UserError(f"--recompute checkpoints each block where the model calls it, but the blocks of "
                        f"{trunk.container} run as one nn.Sequential call", span.start,
                        hint=f"loop over the blocks: `for block in self.{trunk.container}: x = block(x)`")
    return span


def recompute_sites(graph: Graph) -> tuple[Span, ...]:
    """The block calls --recompute checkpoints: one per block list of a chain (an encoder's and a
    decoder's, plan/pipeline.py find_chain), else the one trunk's."""
    chain = find_chain(graph)
    if not chain:
        return (recompute_site(graph),)
    spans = []
    for trunk in chain:
        span = graph.trace.module_calls[trunk.blocks[0]][0]
        if span not in spans:                   # T5: one loop serves both lists
            spans.append(span)
    return tuple(spans)


def block_activations(graph: Graph) -> BlockActivations:
    """What one block (the first; the others run the same code on the same sizes) keeps for
    backward: what autograd saved of the storages its ops made (plan/memory.py saved_bytes).
    With recompute it keeps only the tensors passed to it."""
    trunk = find_trunk(graph)
    block = trunk.blocks[0]
    trace = graph.trace
    inside = [n for n in graph.nodes if n.module_path == block or n.module_path.startswith(block + ".")]
    if trunk.blocks.count(block) > 1:       # one layer every iteration runs: its first run
        first = {index for index, b in node_blocks(graph, trunk.blocks).items() if b == 0}
        inside = [n for n in inside if n.index in first]
    saved = int(sum(saved_bytes(n, trace) for n in inside))
    mine = {n.index for n in inside}
    passed = {t for n in inside for t in n.inputs if trace.tensors[t].producer not in mine
              and trace.tensors[t].param is None and trace.tensors[t].buffer is None}
    # what the checkpoint keeps: the hidden state handed in (masks and position tables that need
    # no gradient are kept once for all blocks, not per block)
    inputs = sum(trace.tensors[t].nbytes for t in passed if trace.tensors[t].requires_grad)
    return BlockActivations(trunk.container, len(trunk.blocks), saved, inputs, saved)


def recompute_seconds(graph: Graph, split_ways: int, device: DeviceSpec) -> float:
    """The extra time recompute costs a step: every block's forward runs a second time."""
    trunk = find_trunk(graph)
    inside = [n for n in graph.nodes if any(n.module_path == b or n.module_path.startswith(b + ".")
                                            for b in trunk.blocks)]
    return sum(compute_time(node_flops(n, graph.dims.get(n.index), graph.trace), split_ways, device) / 3.0
               for n in inside)
