"""The analytical cost model: compute time per op and time per collective on one mesh axis.

Times are seconds; the search scales them to integer nanoseconds for z3.
"""
from __future__ import annotations

import re
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
    from ..errors import Location, UserError, display_path, toml_error
    from ..rules_path import find_rules_file, rules_files
    path = find_rules_file("devices", name)
    if path is None:
        known = ", ".join(p.stem for p in rules_files("devices"))
        raise UserError(f"unknown cluster {name!r}", hint=f"clusters: {known} (devices/NAME.toml in a rules folder)")
    text = path.read_text()
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise toml_error(exc, path, text) from None
    if "device" not in data or "cluster" not in data:
        missing = "[device]" if "device" not in data else "[cluster]"
        raise UserError(f"device spec {name!r} has no {missing} table", Location(display_path(path)),
                        hint="a device spec has [device] flops, memory and [cluster] devices_per_node, "
                        "intra_bandwidth, inter_bandwidth, latency (see rules/devices/cpu-gloo.toml)")
    lines = text.splitlines()

    def number(section: str, key: str, kind=float, required: bool = True):
        value = data[section].get(key)
        if value is None and not required:
            return None
        line = next((i + 1 for i, l in enumerate(lines) if re.match(rf"\s*{key}\s*=", l)), 1)
        if value is None:
            raise UserError(f"device spec {name!r} has no `{key}` in [{section}]", Location(display_path(path), line),
                            hint="see rules/devices/cpu-gloo.toml for the keys a device spec needs")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0 \
                or (kind is int and value != int(value)):
            raise UserError(f"`{key} = {value!r}` in [{section}]: expected a positive "
                            f"{'integer' if kind is int else 'number'}", Location(display_path(path), line),
                            hint="write a number, e.g. flops = 5e10 (FLOP/s), memory = 8e9 (bytes)")
        return kind(value)

    return ClusterSpec(name, number("device", "flops"), number("device", "memory"),
                       number("cluster", "devices_per_node", int), number("cluster", "intra_bandwidth"),
                       number("cluster", "inter_bandwidth"), number("cluster", "latency"),
                       number("cluster", "devices", int, required=False))


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
