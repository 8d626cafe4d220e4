"""The analytical cost model: compute time per op and time per collective on one mesh axis.

Times are seconds; the search scales them to integer nanoseconds for z3.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..graph.dims import OpDims
from ..trace.records import Node, Trace


@dataclass(frozen=True)
class DeviceSpec:
    """One device, and the link one mesh axis communicates over."""

    name: str = "cpu-gloo"
    flops: float = 5e10              # sustained FLOP/s of one device
    memory: float = 8e9              # bytes per device
    bandwidth: float = 2e9           # bytes/s of the link an axis communicates over
    latency: float = 3e-5            # seconds per collective call


@dataclass(frozen=True)
class ClusterSpec:
    """Devices of one kind in nodes; rules/devices/NAME.toml."""

    name: str
    flops: float
    memory: float
    devices_per_node: int
    intra_bandwidth: float
    inter_bandwidth: float
    latency: float
    devices: int | None = None

    def axis(self, stride: int, size: int) -> DeviceSpec:
        """The link an axis of `size` ranks, `stride` apart, talks over: inside a node or not."""
        inside = stride * size <= self.devices_per_node
        return DeviceSpec(self.name, self.flops, self.memory,
                          self.intra_bandwidth if inside else self.inter_bandwidth, self.latency)


def load_cluster(name: str) -> ClusterSpec:
    import tomllib
    from ..errors import UserError
    from ..graph.oprules import RULES_DIR
    path = RULES_DIR / "devices" / f"{name}.toml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in (RULES_DIR / "devices").glob("*.toml")))
        raise UserError(f"unknown cluster {name!r}", hint=f"clusters: {known}")
    data = tomllib.loads(path.read_text())
    device, cluster = data["device"], data["cluster"]
    return ClusterSpec(name, float(device["flops"]), float(device["memory"]), int(cluster["devices_per_node"]),
                       float(cluster["intra_bandwidth"]), float(cluster["inter_bandwidth"]),
                       float(cluster["latency"]), cluster.get("devices"))


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
