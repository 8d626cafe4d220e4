"""The plan IR: op_trans (how an op is split), op_assign (which device runs each piece),
op_order (what runs first on a device). The rewrite consumes plans in this form; plan.json
is its serialisation.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class OpTrans:
    site: str            # path:line:col of the call site
    callee: str
    axis: str            # mesh axis the split runs over
    algo: str            # the split label, "batch", or "replicate"
    n: int
    # the instances it holds for, where a block class's instances split unalike (plan/instances.py):
    # the module path naming their group; "" for every instance of the site
    group: str = ""


@dataclass(frozen=True)
class OpAssign:
    site: str
    axis: str
    piece: int           # index of the sub-op along the axis
    devices: tuple[int, ...]


@dataclass(frozen=True)
class OpOrder:
    before: str
    after: str
    device: int


@dataclass
class Plan:
    name: str
    mesh: dict[str, int]                     # axis -> size, fastest-varying first
    trans: list[OpTrans] = field(default_factory=list)
    assign: list[OpAssign] = field(default_factory=list)
    order: list[OpOrder] = field(default_factory=list)
    params: dict[str, dict[str, Any]] = field(default_factory=dict)   # name -> {axis: layout}
    estimated_step_seconds: float = 0.0
    warnings: list[str] = field(default_factory=list)                 # path:line:col: warning: ...
    # co-shard with --tp 1: the C-way choices whose layouts say which dims the pieces cut
    # (plan/coshard.py); op_trans holds the co-sharded ops, this only the rest of the stand-in
    coshard_stand_in: Any = field(default=None, repr=False, compare=False)
    # co-shard: bytes per device with the C chosen, the figure C was chosen by (plan/coshard.py)
    coshard_memory: float | None = field(default=None, repr=False, compare=False)
    # --plan auto: the search's choice and the configurations it priced (plan/auto.py AutoChoice)
    auto: Any = field(default=None, repr=False, compare=False)
    # gradient accumulation (--micro-batches M, no pipeline): BatchNorm normalises each micro-batch alone
    micro_statistics: bool = field(default=False, repr=False, compare=False)

    @property
    def world_size(self) -> int:
        size = 1
        for n in self.mesh.values():
            size *= n
        return size

    def coords(self, rank: int) -> dict[str, int]:
        out, stride = {}, 1
        for axis, n in self.mesh.items():
            out[axis] = rank // stride % n
            stride *= n
        return out

    def devices_of(self, axis: str, index: int) -> tuple[int, ...]:
        key = (tuple(self.mesh.items()), axis, index)     # asked per site and piece: thousands of ranks
        cache = self.__dict__.setdefault("_devices_of", {})
        if key not in cache:
            cache[key] = tuple(r for r in range(self.world_size) if self.coords(r)[axis] == index)
        return cache[key]

    def describe(self) -> str:
        return f"{self.name} " + " ".join(f"{a}={n}" for a, n in self.mesh.items())

    def to_json(self) -> dict[str, Any]:
        return {"plan": self.name, "mesh": self.mesh, "world_size": self.world_size,
                "estimated_step_seconds": self.estimated_step_seconds,
                "op_trans": [asdict(t) for t in self.trans],
                "op_assign": [asdict(a) for a in self.assign],
                "op_order": [asdict(o) for o in self.order],
                "params": self.params, "warnings": self.warnings}
