"""Activation recompute per block: where the checkpoint goes, and what it saves.

With --recompute every repeated block runs under torch.utils.checkpoint at the call in the loop
over its list: forward keeps only the block's inputs, backward runs the block's forward again to
rebuild the rest. That is the blocks pipelines cut into stages (plan/pipeline.py), and every other
list of repeated blocks a loop calls one by one (`other_lists`: AlphaFold2's extra-MSA stack beside
its Evoformer blocks), outside those blocks. The memory model reads `block_activations` for the
bytes one block holds from its forward to its backward either way (plan/auto.py prices the other
lists' blocks from `other_block_inputs` and what their ops save). Decides and measures; rewrites nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from ..errors import UserError
from ..graph.graph import Graph
from ..source.files import Span
from .batch import batch_statistics, buffers_written
from .cost import DeviceSpec, compute_time, node_flops
from .memory import saved_bytes
from .pipeline import _called_in_loop, cut_blocks, find_chain, find_trunk, node_blocks


@dataclass(frozen=True)
class BlockActivations:
    """Activation bytes of one repeated block, at the traced (global, unsplit) sizes."""

    container: str       # module path of the blocks' container: transformer.h
    blocks: int          # how many blocks it holds
    saved: int           # bytes a block keeps from forward to backward without recompute
    inputs: int          # bytes a block keeps with recompute: its tensor inputs only (the hidden state)
    rebuilt: int         # bytes its recompute holds at once in backward (one block's activations)
    shared_inputs: int = 0   # inputs the later blocks read too (an encoder's output every decoder
    #                          block cross-attends to): kept once, whatever the number of blocks
    shared_tensors: frozenset[int] = frozenset()     # ... their tensor ids

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
    decoder's, plan/pipeline.py find_chain), else the one trunk's; then each other list's."""
    chain = find_chain(graph)
    spans = [graph.trace.module_calls[trunk.blocks[0]][0] for trunk in chain] if chain else [recompute_site(graph)]
    spans += [blocks.span for blocks in other_lists(graph)]
    return tuple(dict.fromkeys(spans))          # T5: one loop serves both lists


def restored_buffers(graph: Graph, sites: tuple[Span, ...]) -> dict[Span, tuple[str, ...]]:
    """Per block call --recompute checkpoints, the buffers (named from the block) its blocks'
    forward writes: spectral norm's power iteration, a step counter, BatchNorm's running
    statistics. Backward's second forward would write them again; the output restores them
    around it (runtime/_comm.py buffers_kept_through_recompute), so that they change once a
    forward as without recompute."""
    tensors = graph.trace.tensors
    written = [name for names in buffers_written(graph).values() for name in names]
    written += [tensors[tid].buffer for node in batch_statistics(graph) for tid in node.inputs
                if tensors[tid].buffer is not None]
    calls = graph.trace.module_calls
    restored = {}
    for span in sites:
        blocks = [path for path, (at, _) in calls.items() if at == span]
        names = [name[len(block) + 1:] for block in blocks for name in written if name.startswith(block + ".")]
        restored[span] = tuple(dict.fromkeys(names))
    return restored


@dataclass(frozen=True)
class BlockList:
    """A list of repeated blocks the pipeline does not cut, which --recompute checkpoints too."""

    blocks: tuple[str, ...]     # module paths, in call order
    span: Span                  # the call of a block in the loop over them


def other_lists(graph: Graph) -> list[BlockList]:
    """The lists of repeated blocks (graph.blocks) besides the ones the pipeline cuts whose blocks
    one call in a `for` or `while` loop runs (`for block in self.extra_blocks: e, z = block(e, z)`),
    neither inside a cut block nor holding one, nor inside a block of another such list (the
    outermost list is checkpointed), in the order the trace first called them. [] when the model
    has no cut blocks (--recompute refuses it)."""
    if "_other_lists" in graph.__dict__:
        return graph.__dict__["_other_lists"]
    try:
        cut = cut_blocks(graph)
    except UserError:
        cut = []
    trace = graph.trace
    calls = trace.module_calls

    def nested(path: str, outer) -> bool:
        return any(path.startswith(b + ".") for b in outer)

    found = []
    for group in graph.blocks.values() if cut else []:
        if set(group) & set(cut) or any(nested(p, cut) for p in group) or any(nested(b, group) for b in cut) or \
                not all(p in calls for p in group):
            continue
        spans = {calls[p][0] for p in group}
        span = next(iter(spans))
        if len(spans) != 1 or span in trace.containers or not _called_in_loop(graph, span):
            continue
        found.append(BlockList(tuple(sorted(group, key=lambda p: calls[p][1])), span))
    found = [f for f in found if not any(o is not f and nested(f.blocks[0], o.blocks) for o in found)]
    graph.__dict__["_other_lists"] = sorted(found, key=lambda f: calls[f.blocks[0]][1])
    return graph.__dict__["_other_lists"]


def block_of_other_lists(graph: Graph) -> dict[int, tuple[int, int]]:
    """Each op run inside a block of `other_lists`: (its list, the block's position in it)."""
    where = {b: (k, j) for k, found in enumerate(other_lists(graph)) for j, b in enumerate(found.blocks)}
    if not where:
        return {}
    out = {}
    for node in graph.nodes:
        path = node.module_path or ""
        while path:
            if path in where:
                out[node.index] = where[path]
                break
            path = path.rpartition(".")[0]
    return out


def other_block_inputs(graph: Graph) -> dict[tuple[int, int], int]:
    """What each block of `other_lists` keeps with recompute: the tensors handed into it that need
    a gradient (a pass without gradient keeps nothing), as `block_activations` counts a cut block's."""
    trace = graph.trace
    inside: dict[tuple[int, int], set[int]] = {}
    for index, key in block_of_other_lists(graph).items():
        inside.setdefault(key, set()).add(index)
    kept = {}
    for key, mine in inside.items():
        passed = {t for i in mine for t in graph.nodes[i].inputs if trace.tensors[t].producer not in mine
                  and trace.tensors[t].param is None and trace.tensors[t].buffer is None}
        kept[key] = sum(trace.tensors[t].nbytes for t in passed if trace.tensors[t].requires_grad)
    return kept


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
              and trace.tensors[t].param is None and trace.tensors[t].buffer is None
              and trace.tensors[t].requires_grad}
    # what the checkpoint keeps: the hidden state handed in (masks and position tables that need
    # no gradient are kept once for all blocks, not per block); a tensor the next block reads too
    # is one tensor kept for all of them
    later = _read_by_later_blocks(graph, trunk.blocks, passed)
    inputs = sum(trace.tensors[t].nbytes for t in passed - later)
    shared = sum(trace.tensors[t].nbytes for t in later)
    return BlockActivations(trunk.container, len(trunk.blocks), saved, inputs, saved, shared, frozenset(later))


def _read_by_later_blocks(graph: Graph, blocks: list[str], tensors: set[int]) -> set[int]:
    """Those of `tensors` that an op of another block of the list reads."""
    block_of = node_blocks(graph, blocks)
    first = min(block_of.values(), default=0)
    return {t for node in graph.nodes if block_of.get(node.index, first) != first
            for t in node.inputs if t in tensors}


def recompute_seconds(graph: Graph, split_ways: int, device: DeviceSpec) -> float:
    """The extra time recompute costs a step: every block's forward runs a second time (the other
    lists' blocks: where they run with gradient)."""
    trunk = find_trunk(graph)
    others = block_of_other_lists(graph)
    inside = [n for n in graph.nodes if any(n.module_path == b or n.module_path.startswith(b + ".")
                                            for b in trunk.blocks) or (n.index in others and any(
                                                graph.trace.tensors[t].requires_grad for t in n.outputs))]
    return sum(compute_time(node_flops(n, graph.dims.get(n.index), graph.trace), split_ways, device) / 3.0
               for n in inside)
