"""One file per distinct program (issue 11, item 1): which ranks share a program file, what it
is called, and what its header says about who runs it. The files themselves are checked in
test_rewrite_output.py (SPMD) and test_pipeline_equivalence.py (pipelines, verified on gloo)."""
from __future__ import annotations

from nnscaler_cst.emit.programs import program_of, programs
from nnscaler_cst.plan.ir import Plan
from nnscaler_cst.plan.pipeline import StagePlan


def mesh(tp: int = 1, dp: int = 1, pp: int = 1) -> Plan:
    return Plan("test", {"tp": tp, "dp": dp, "pp": pp})


def stage_plan(pp: int, virtual: int = 1) -> StagePlan:
    stages = pp * virtual
    return StagePlan(pp, virtual, None, [(s, s + 1) for s in range(stages)], {}, {s: [] for s in range(stages)})


def test_tensor_and_data_parallel_peers_share_one_program_named_model():
    plan = mesh(tp=8, dp=64)
    (only,) = programs(plan)
    assert only.file == "model.py" and only.ranks == tuple(range(512))
    assert only.describe(512) == "every rank of 512; each reads its tp/dp coordinates from _comm at run time"


def test_a_single_rank_program_names_no_peers():
    assert programs(mesh())[0].describe(1) == "every rank of 1"


def test_pipeline_stages_get_one_program_each_holding_their_tp_and_dp_peers():
    plan = mesh(tp=2, dp=2, pp=2)
    found = programs(plan, stage_plan(2))
    assert [p.file for p in found] == ["model_stage0.py", "model_stage1.py"]
    assert [p.ranks for p in found] == [(0, 1, 2, 3), (4, 5, 6, 7)]     # pp varies slowest
    assert found[1].describe(8) == ("pipeline stage 1: ranks 4-7 of 8; "
                                    "each reads its tp/dp coordinates from _comm at run time")


def test_a_pipeline_rank_running_several_interleaved_stages_is_named_after_all_of_them():
    plan = mesh(pp=2)
    found = programs(plan, stage_plan(2, virtual=2))
    assert [p.file for p in found] == ["model_stages0_2.py", "model_stages1_3.py"]
    assert found[0].describe(2) == "pipeline stages 0, 2: rank 0 of 2"


def test_every_rank_maps_to_the_program_of_its_pipeline_coordinate():
    plan = mesh(tp=2, pp=2)
    stages = stage_plan(2)
    assert [program_of(plan, stages, r).name for r in range(4)] == ["model_stage0"] * 2 + ["model_stage1"] * 2
    assert {program_of(mesh(tp=2, dp=2), None, r).name for r in range(4)} == {"model"}
