"""The analytical cost model: compute time per op and time per collective on one mesh axis.

Times are seconds; the search scales them to integer nanoseconds for z3.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..graph.dims import OpDims
from ..trace.records import Node, Trace


@dataclass(frozen=True)
class DeviceSpec:
    name: str = "cpu-gloo"
    flops: float = 5e10              # sustained FLOP/s of one device
    memory: float = 16e9             # bytes per device
    bandwidth: float = 2e9           # bytes/s of the link an axis communicates over
    latency: float = 3e-5            # seconds per collective call


def node_flops(node: Node, dims: OpDims | None, trace: Trace) -> float:
    """Forward FLOPs: 2·(product of all dim sizes) for contractions, else elements touched."""
    if dims is not None and dims.reduced:
        total = 2.0
        for size in dims.sizes().values():
            total *= size
        return total
    sizes = [trace.tensors[t].nbytes / 4 for t in node.outputs] or [0.0]
    return max(sizes)


def compute_time(flops: float, split_ways: int, device: DeviceSpec) -> float:
    return 3.0 * flops / split_ways / device.flops        # forward + backward (about 2x forward)


def all_reduce_time(nbytes: float, n: int, device: DeviceSpec) -> float:
    return device.latency + 2.0 * (n - 1) / n * nbytes / device.bandwidth


def all_gather_time(full_nbytes: float, n: int, device: DeviceSpec) -> float:
    return device.latency + (n - 1) / n * full_nbytes / device.bandwidth
