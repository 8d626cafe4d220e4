"""Tensor layouts along one mesh axis, and what a site's split choice implies for them.

R: every device holds the whole tensor. S(dim, groups): each device holds 1/n of `dim`;
with groups > 1 the dim is `groups` interleaved blocks each split (fused q|k|v). P: each
device holds a partial sum. (R/V/D in the nnScaler paper.)
"""
from __future__ import annotations

from dataclasses import dataclass

from ..graph.dims import OpDims

REPLICATE = "replicate"


@dataclass(frozen=True)
class Layout:
    kind: str                 # "R", "S" or "P"
    dim: int = -1
    groups: int = 1

    def __str__(self) -> str:
        if self.kind == "S":
            return f"S({self.dim})" if self.groups == 1 else f"S({self.dim}, groups={self.groups})"
        return self.kind


R = Layout("R")
P = Layout("P")


def shard(dim: int, groups: int = 1) -> Layout:
    return Layout("S", dim, groups)


@dataclass
class ChoiceLayouts:
    """Layouts a node needs for its inputs and gives for its outputs under one choice."""

    inputs: dict[str, Layout]
    outputs: list[Layout]
    split: bool                      # the node runs 1/n of the work on each device


def layouts_for(dims: OpDims | None, choice: str, operand_names: list[str],
                local: dict[str, int] | None = None) -> ChoiceLayouts:
    """`local`: labels each device sees divided (see TensorDims.where)."""
    if dims is None or choice == REPLICATE:
        return ChoiceLayouts({name: R for name in operand_names}, [R] * (len(dims.outputs) if dims else 0), False)
    inputs = {}
    for name in operand_names:
        where = dims.inputs[name].where(choice, local) if name in dims.inputs else None
        inputs[name] = shard(*where) if where else R
    outputs = []
    for tensor in dims.outputs:
        where = tensor.where(choice, local)
        if where:
            outputs.append(shard(*where))
        elif choice in dims.reduced:
            outputs.append(P)
        else:
            outputs.append(R)      # a split implementation (impl) returns the whole result
    return ChoiceLayouts(inputs, outputs, True)
