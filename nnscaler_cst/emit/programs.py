"""Which program each rank runs, and the file it lives in.

Ranks that run the same code share one file: tensor- and data-parallel peers differ only in
their coordinates, which the generated code reads from `_comm`'s process groups at run time
(`TP.rank`, `DP.rank`), so an SPMD plan is one program, `model.py`. Pipeline ranks hold
different stages and schedules: one program per pipeline rank, named after the stages it runs
(`model_stage0.py`; `model_stages0_2.py` when interleaving gives it several).

Names and rank sets only; what goes into a program's file is rewrite.py's business.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..plan.ir import Plan
from ..plan.pipeline import StagePlan

SPMD_PROGRAM = "model"


@dataclass(frozen=True)
class Program:
    """One program: its module name in the output package and the ranks that run it."""

    name: str
    ranks: tuple[int, ...]
    pp_rank: int | None = None      # the pipeline rank it belongs to (None: not a pipeline)
    stages: tuple[int, ...] = ()    # the pipeline stages it runs

    @property
    def file(self) -> str:
        return f"{self.name}.py"

    def describe(self, world: int) -> str:
        """What the header line says about who runs the file."""
        what = ("every rank" if len(self.ranks) == world else
                f"rank {self.ranks[0]}" if len(self.ranks) == 1 else f"ranks {_span(self.ranks)}")
        if self.stages:
            label = "stage" if len(self.stages) == 1 else "stages"
            what = f"pipeline {label} {', '.join(map(str, self.stages))}: {what}"
        peers = "; each reads its tp/dp coordinates from _comm at run time" if len(self.ranks) > 1 else ""
        return f"{what} of {world}{peers}"


def programs(plan: Plan, stages: StagePlan | None = None) -> list[Program]:
    """The distinct programs of a plan, in pipeline-rank order (a single one without pipelines)."""
    world = plan.world_size
    if stages is None:
        return [Program(SPMD_PROGRAM, tuple(range(world)))]
    found = []
    for pp_rank in range(plan.mesh.get("pp", 1)):
        held = tuple(stages.stages_of(pp_rank))
        name = f"model_stage{held[0]}" if len(held) == 1 else "model_stages" + "_".join(map(str, held))
        found.append(Program(name, tuple(r for r in range(world) if plan.coords(r)["pp"] == pp_rank),
                             pp_rank, held))
    return found


def program_of(plan: Plan, stages: StagePlan | None, rank: int) -> Program:
    """The program `rank` runs."""
    return next(p for p in programs(plan, stages) if rank in p.ranks)


def _span(ranks: tuple[int, ...]) -> str:
    """`0-3` for a run of consecutive ranks, else the ranks listed."""
    if len(ranks) > 2 and list(ranks) == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks))
