"""Spec of ZeRO (`--zero 1|2|3`): data-parallel state sharded over the data-parallel ranks, written
out as named calls in the training API (__init__.py), training exactly like the single-device run, holding the bytes
plan/zero.py says it holds, and refused where it cannot apply.

Quick: the emitted step for each stage, the byte arithmetic, bad input. Slow (gloo processes):
verify against one process, and the bytes one rank really holds after a step.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import RANK_SET_UP
from nnscaler_cst import cli
from nnscaler_cst.plan.zero import state_bytes_per_device, units_in_flight

REPO = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------------------------
# The emitted step
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mlp_analysis():
    from nnscaler_cst.analysis import analyze
    return analyze(REPO / "fixtures" / "mlp.py")   # small, and it splits under --tp


def train_source(analysis, **request) -> str:
    from nnscaler_cst.rewrite import PlanRequest, rewrite
    return rewrite(analysis, PlanRequest(**request)).files["__init__.py"]


def step_body(train: str) -> str:
    """The pieces of a step, in the order a loop calls them: forward_backward .. optimizer_step."""
    return train[train.index("def forward_backward("):train.index("def train_step(")]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_step_reduce_scatters_gradients_and_gathers_parameters_by_name(mlp_analysis, stage):
    train = train_source(mlp_analysis, dp=2, zero=stage)
    step = step_body(train)
    assert f"ZERO_STAGE = {stage}  # ZeRO-{stage}:" in train
    assert "_comm.zero_shards(model, _comm.DP, stage=ZERO_STAGE, average=AVERAGE_SHARES,\n" \
           "                                          overlap=True, partial=tp_partial_params(model)" in train
    assert "return model.zero_shards.chunks" in train          # the optimizer steps the shard only
    assert "_comm.sync_grads(list(model.parameters()), _comm.DP" not in step   # no all-reduce of gradients
    assert "grad_buckets(model)" not in step
    reduce_at = step.index("_comm.reduce_scatter_grads(model.zero_shards, _comm.DP, average=AVERAGE_SHARES")
    step_at = step.index("optimizer.step()")
    assert reduce_at < step_at
    gather_at = step.index("_comm.all_gather_params(model.zero_shards, _comm.DP")
    if stage == 3:     # the root unit gathered before the forward (the blocks by their hooks), all dropped after
        assert gather_at < step.index("output = model(") and step.count("all_gather_params") == 1
        assert '_comm.all_gather_params(model.zero_shards, _comm.DP, units="root")' in step
        assert reduce_at < step.index("_comm.free_params(model.zero_shards)") < step_at
    else:              # the updated shards gathered after the step
        assert step_at < gather_at and "free_params" not in step
    assert ("model.zero_grad(set_to_none=True)" in step) == (stage == 1)   # ZeRO-1's full gradients


def test_without_zero_the_gradient_buckets_are_all_reduced_from_the_backward_and_waited_for(mlp_analysis):
    train = train_source(mlp_analysis, dp=2)
    step = step_body(train)
    hooked_at = step.index("    grad_buckets(model)  # data parallel: each gradient bucket all-reduced")
    assert hooked_at < step.index("output = model(")
    assert step.index("_comm.wait_grad_buckets(grad_buckets(model), reduce_dtype=reduce_dtype)") < step.index("optimizer.step()")
    assert "_comm.overlap_grads(model, _comm.DP, average=AVERAGE_SHARES, partial=tp_partial_params(model)" in train
    assert "ZERO_STAGE" not in train and "zero_shards" not in step


def test_a_pipeline_reduces_the_gradients_after_its_schedule(gpt_analysis):
    """Several backwards a step (micro-batches): the reduction waits for all of them."""
    step = step_body(train_source(gpt_analysis, dp=2, pp=2, micro_batches=2))
    assert "_comm.sync_grads(list(model.parameters()), _comm.DP, average=AVERAGE_SHARES," in step
    assert "grad_buckets" not in step


def test_zero_composes_with_tensor_parallel_over_the_data_parallel_axis(mlp_analysis):
    step = step_body(train_source(mlp_analysis, tp=2, dp=2, zero=1))
    assert step.index("_comm.TP, average=False)") < step.index("_comm.reduce_scatter_grads(model.zero_shards, _comm.DP")


# --------------------------------------------------------------------------------------------
# Bytes per device
# --------------------------------------------------------------------------------------------

def test_state_bytes_follow_the_zero_paper_plus_the_shard_the_optimizer_steps():
    """Ψ = 1000 fp32 parameters over 4 ranks: 4Ψ weights, 4Ψ gradients, 8Ψ AdamW state, the
    optimizer state sharded from stage 1, the gradients from 2, the weights from 3. The optimizer
    steps a shard of its own (the units' chunks end to end), Ψ/4 more weights at stages 1 and 2."""
    per = {stage: state_bytes_per_device(1000, stage, 4) for stage in range(4)}
    assert (per[0].params, per[0].grads, per[0].optimizer) == (4000, 4000, 8000)
    assert (per[1].params, per[1].grads, per[1].optimizer) == (5000, 4000, 2000)
    assert (per[2].params, per[2].grads, per[2].optimizer) == (5000, 1000, 2000)
    assert (per[3].params, per[3].grads, per[3].optimizer) == (1000, 1000, 2000)
    assert per[3].total == 4000


def test_a_count_that_does_not_divide_is_padded_to_the_flat_buffer():
    held = state_bytes_per_device(10, 3, 4)          # 10 parameters -> 12 in the buffer, 3 per rank
    assert (held.params, held.grads, held.optimizer) == (12, 12, 24)
    assert state_bytes_per_device(10, 1, 4).params == 48 + 12


def test_what_is_whole_for_a_moment_is_the_root_unit_and_two_blocks():
    """ZeRO-2: the gradients of the root unit (whole until the backward ends) and two blocks; ZeRO-3
    their parameters too; ZeRO-1 reduces after the backward, whole gradients counted already."""
    assert units_in_flight(1, 100, 10) == (0, 0)
    assert units_in_flight(2, 100, 10) == (0, 120 * 4)
    assert units_in_flight(3, 100, 10) == (120 * 4, 120 * 4)


@pytest.fixture(scope="module")
def gpt_analysis():
    from nnscaler_cst.analysis import analyze
    return analyze(REPO / "fixtures" / "gpt.py")   # has blocks to cut into stages


@pytest.mark.parametrize("stage", [1, 3])
def test_with_pipeline_stages_the_schedule_is_followed_by_the_same_zero_calls_on_the_stages(gpt_analysis, stage):
    train = train_source(gpt_analysis, dp=2, pp=2, micro_batches=2, zero=stage)
    step = step_body(train)
    assert "overlap=False" in train        # several backwards a step: the reduce-scatters wait for them
    schedule_at = step.index("for i, (kind, stage, m, cycle, call) in enumerate(actions):")
    tied_at = step.index("_comm.sync_grads(tied, _comm.PP_ENDS, average=False)")
    reduce_at = step.index("_comm.reduce_scatter_grads(model.zero_shards, _comm.DP, average=AVERAGE_SHARES")
    assert schedule_at < tied_at < reduce_at < step.index("optimizer.step()")
    assert "_comm.sync_grads(list(model.parameters()), _comm.DP" not in step
    gathers = [k for k in range(len(step)) if step.startswith("_comm.all_gather_params(model.zero_shards", k)]
    assert len(gathers) == 1 and (gathers[0] < schedule_at) == (stage == 3)


# --------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, says", [
    ("--dp 2 --zero 4", "ZeRO has stages 1, 2 and 3"),
    ("--zero 1", "no data parallelism"),
    ("--tp 2 --zero 2", "no data parallelism"),
    ("--dp 2 --pp 2 --schedule chimera --micro-batches 2 --zero 1", "replicated pipelines"),
])
def test_zero_where_it_cannot_apply_is_refused_with_a_hint_and_nothing_written(args, says, tmp_path, monkeypatch,
                                                                               capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        cli.main([str(REPO / "fixtures" / "gpt.py"), *args.split(), "-o", "out"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err
    assert err.startswith("error: --zero ") and says in " ".join(err.split()), err
    assert "hint: " in err
    assert not (tmp_path / "out").exists()


def test_a_bad_zero_in_pyproject_is_an_error_at_its_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "pyproject.toml").write_text("[tool.nnscaler-rewrite]\ndp = 2\nzero = 5\n")
    (tmp_path / "model.py").write_text((REPO / "fixtures" / "mlp.py").read_text())
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["model.py", "-o", "out"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err
    assert err.startswith("pyproject.toml:3:1: error: `zero = 5`") and "ZeRO stage" in err, err
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------------------------
# Slow: gloo runs
# --------------------------------------------------------------------------------------------

def verify(*args) -> tuple[subprocess.CompletedProcess, dict]:
    env = {**os.environ, "COLUMNS": "200", "PYTHONWARNINGS": "ignore"}
    result = subprocess.run([sys.executable, "-m", "nnscaler_cst.cli", "verify", *map(str, args), "--json"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    start = result.stdout.find("{")
    assert start >= 0, f"no JSON report; exit {result.returncode}\n{result.stdout}\n{result.stderr[-3000:]}"
    return result, json.loads(result.stdout[start:])


@pytest.mark.slow
@pytest.mark.parametrize("entry, tp, stage", [
    ("gpt.py", 1, 1), ("gpt.py", 1, 2),
    ("hf_llama.py", 1, 3),      # stages 1 and 2 shard the same flat buffers as on gpt.py: one library model suffices
    ("gpt.py", 2, 3),           # (gpt.py at tp 1: as at tp 2; a model of blocks at dp 2 x M 2: the unused parameter's test)
])
def test_zero_trains_like_the_single_device_run(entry, tp, stage, tmp_path):
    result, outcome = verify(f"fixtures/{entry}", "--tp", tp, "--dp", 2, "--zero", stage, "-o", tmp_path / "out")
    assert result.returncode == 0 and outcome["passed"] is True, outcome
    assert outcome["world_size"] == 2 * tp and f"zero{stage}" in outcome.get("plan", f"zero{stage}")
    assert outcome["max_abs_error"] <= outcome["tolerance"]["param_atol"]
    train = (tmp_path / "out" / "__init__.py").read_text()
    assert "_comm.reduce_scatter_grads(model.zero_shards, _comm.DP, average=AVERAGE_SHARES" in train


@pytest.mark.slow
@pytest.mark.parametrize("entry, args", [
    ("gpt.py", "--pp 2 --dp 2 --zero 3 --micro-batches 2"),
    ("hf_llama.py", "--pp 2 --tp 2 --dp 2 --zero 1 --recompute --micro-batches 2"),     # 8 processes
], ids=["gpt-pp2xdp2-zero3", "llama-pp2xtp2xdp2-zero1-recompute"])
def test_zero_with_pipeline_stages_trains_like_the_single_device_run(entry, args, tmp_path):
    result, outcome = verify(f"fixtures/{entry}", *args.split(), "-o", tmp_path / "out")
    assert result.returncode == 0 and outcome["passed"] is True, outcome
    assert outcome["max_abs_error"] <= outcome["tolerance"]["param_atol"]
    stage = (tmp_path / "out" / "__init__.py").read_text()
    assert "_comm.reduce_scatter_grads(model.zero_shards, _comm.DP" in stage


MEASURE = textwrap.dedent('''
    """One rank: build the output's model, take one train_step, and count the bytes of parameters,
    gradients and optimizer state it holds right after the optimizer steps (storages counted once;
    the gradients: the more of then and the end of the backward)."""
''') + RANK_SET_UP + textwrap.dedent('''
    count = sum(p.numel() for p in model.parameters() if p.requires_grad)
    optimizer = torch.optim.AdamW(package.optimizer_params(model), lr=1e-3)
    measured = {}

    def storage_bytes(tensors):
        seen = {}
        for t in tensors:
            if t is not None:
                storage = t.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
        return sum(seen.values())

    def held():
        stepped = [p for group in optimizer.param_groups for p in group["params"]]
        params = storage_bytes([p.data for p in model.parameters()] + [p.data for p in stepped])
        grads = storage_bytes([p.grad for p in model.parameters()] + [p.grad for p in stepped])
        state = storage_bytes([v for s in optimizer.state.values() for k, v in s.items()
                               if k != "step" and isinstance(v, torch.Tensor)])   # a counter per tensor
        return {"params": params, "grads": grads, "optimizer": state}

    original = optimizer.step
    def step_and_measure(*a, **k):
        result = original(*a, **k)
        at_step = held()
        measured.update(at_step, grads=max(at_step["grads"], measured["grads"]))
        return result
    optimizer.step = step_and_measure
    finish = package.finish_backward
    def measure_and_finish(*a, **k):       # the backward's end: ZeRO-1's whole gradients
        measured["grads"] = held()["grads"]
        return finish(*a, **k)
    package.finish_backward = measure_and_finish
    torch.manual_seed(1)
    package.train_step(model, optimizer, module.example_inputs())
    print(json.dumps({"rank": rank, "count": count, **measured}), flush=True)
    comm.teardown()
''')


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_bytes_one_rank_holds_after_a_step_are_what_the_memory_model_says(stage, tmp_path):
    out = tmp_path / "zero_out"
    args = ["--dp", "2"] + (["--zero", str(stage)] if stage else [])
    subprocess.run([sys.executable, "-m", "nnscaler_cst.cli", str(REPO / "fixtures" / "gpt.py"), *args, "-o", out],
                   cwd=tmp_path, check=True, capture_output=True, timeout=600)
    script = tmp_path / "measure.py"
    script.write_text(MEASURE)
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29600 + stage),
           "PYTHONWARNINGS": "ignore"}
    procs = [subprocess.Popen([sys.executable, str(script), str(out)], env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    lines = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-3000:]
        lines.append(json.loads(stdout.strip().splitlines()[-1]))
    for measured in lines:
        expected = state_bytes_per_device(measured["count"], stage, 2)
        assert (measured["params"], measured["grads"], measured["optimizer"]) == \
            (expected.params, expected.grads, expected.optimizer), (stage, measured, expected)


@pytest.mark.slow
def test_a_step_without_the_gather_of_the_updated_shards_fails_the_check(tmp_path):
    """Negative control: ZeRO-2 with its all_gather_params line deleted leaves every rank with
    only its own shard updated; the collectives still pair up, so the run completes, wrong."""
    out = tmp_path / "out"
    result, outcome = verify("fixtures/gpt.py", "--dp", 2, "--zero", 2, "-o", out)
    assert result.returncode == 0 and outcome["passed"] is True, outcome
    train = out / "__init__.py"
    text = train.read_text()
    line = next(l for l in text.splitlines(keepends=True) if "_comm.all_gather_params(model.zero_shards" in l)
    train.write_text(text.replace(line, "", 1))
    result, outcome = verify("fixtures/gpt.py", "-o", out)         # verified as it is: no rewrite
    assert result.returncode == 1 and outcome["passed"] is False, outcome
    assert outcome["float64"]["passed"] is False, outcome     # ZeRO's shards in float64 too
    assert "all_gather_params(model.zero_shards" not in train.read_text()


def test_zero_with_a_searched_plan_keeps_the_stage_and_searches_a_data_parallel_mesh(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    cli.main(["plan", str(REPO / "fixtures" / "mlp.py"), "--plan", "auto", "--devices", "2", "--zero", "1",
              "--cluster", "cpu-gloo", "--json"])
    out = json.loads(capsys.readouterr().out)    # without --zero the search picks tp=2 for the MLP on this box
    assert out["mesh"]["dp"] == 2 and out["search"]["chosen"]["zero"] == 1, out["search"]["chosen"]


BATCH_MEAN_MODEL = """
import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        return (h - h.mean(dim=0)).pow(2).mean()     # a mean over the batch used again: cannot be sliced


def build():
    return Net()


def example_inputs():
    return (torch.randn(4, 8),)
"""


def test_zero_with_a_searched_plan_on_a_batch_that_cannot_be_sliced_is_refused(tmp_path, monkeypatch, capsys):
    model = tmp_path / "model.py"
    model.write_text(BATCH_MEAN_MODEL.lstrip("\n"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["plan", str(model), "--plan", "auto", "--devices", "2", "--zero", "1"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "no plan on 2 devices" in err and "--zero 1" in err, err


UNITS = textwrap.dedent('''
    """One rank of --dp 2 --zero 3 on the GPT fixture: while each block runs forward, how many
    blocks are whole (their flat buffer's storage allocated); after the step, how many units."""
''') + RANK_SET_UP + textwrap.dedent('''
    optimizer = torch.optim.AdamW(package.optimizer_params(model), lr=1e-3)
    shards = model.zero_shards
    blocks = [u for u in shards.units if u is not shards.root]
    whole = lambda units: sum(u.flat.untyped_storage().nbytes() > 0 for u in units)
    during, root = [], []

    def probe(m, a):            # after the unit's own pre-hook (registered first): it is gathered
        during.append(whole(blocks))
        root.append(shards.root.whole)

    for u in blocks:
        dict(model.named_modules())[u.name].register_forward_pre_hook(probe)
    for step in range(2):
        torch.manual_seed(step)
        package.train_step(model, optimizer, module.example_inputs())
    print(json.dumps({"units": [u.name for u in shards.units], "during": during, "after": whole(shards.units),
                      "gathers": comm.COUNTERS["all_gather"], "root": root}), flush=True)
    comm.teardown()
''')


@pytest.mark.slow
def test_zero_3_gathers_one_block_at_a_time_and_frees_it(tmp_path):
    """Each block of the GPT fixture is a unit: while a block runs, at most it and the next one
    (prefetched) are whole; after the step every unit is freed; every block is gathered twice a
    step (forward, backward). The root unit is gathered once in the first step (which finds that
    no block reads it), and from the second on freed while the blocks run and gathered again for
    the head (issued as the last block starts): twice."""
    out = tmp_path / "zero3"
    subprocess.run([sys.executable, "-m", "nnscaler_cst.cli", str(REPO / "fixtures" / "gpt.py"), "--dp", "2",
                    "--zero", "3", "-o", out], cwd=tmp_path, check=True, capture_output=True, timeout=600)
    script = tmp_path / "units.py"
    script.write_text(UNITS)
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29611",
           "PYTHONWARNINGS": "ignore"}
    procs = [subprocess.Popen([sys.executable, str(script), str(out)], env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-3000:]
        seen = json.loads(stdout.strip().splitlines()[-1])
        blocks = len(seen["units"]) - 1
        assert seen["units"][0] == "(root)" and seen["units"][1:] == [f"transformer.h.{i}" for i in range(blocks)]
        assert blocks >= 3 and len(seen["during"]) == 2 * blocks
        assert max(seen["during"]) <= 2 and min(seen["during"]) >= 1, seen
        assert seen["after"] == 0
        assert seen["gathers"] == 2 * 2 * blocks + 1 + 2, seen
        assert seen["root"] == [True] * blocks + [False] * blocks, seen     # the last: its gather in flight


def _pipeline_step_measured(tmp_path: Path, stage: int, micro: int, port: int) -> list[dict]:
    """MEASURE on each of 4 gloo ranks of the GPT fixture at pp 2 x dp 2 under ZeRO `stage`, with the
    step's all-gathers and the rank's units too."""
    out = tmp_path / f"zero{stage}_m{micro}"
    subprocess.run([sys.executable, "-m", "nnscaler_cst.cli", str(REPO / "fixtures" / "gpt.py"), "--pp", "2", "--dp", "2",
                    "--micro-batches", str(micro), "--zero", str(stage), "-o", out],
                   cwd=tmp_path, check=True, capture_output=True, timeout=600)
    script = tmp_path / "measure.py"
    script.write_text(MEASURE.replace(
        'comm.setup(rank, world, tp=package.TP_SIZE, dp=package.DP_SIZE, pp=package.PP_SIZE, backend="gloo")',
        'package.setup("gloo")').replace(
        '"count": count,', '"count": count, "gathers": comm.COUNTERS["all_gather"], '
        '"units": len(model.zero_shards.units),'))
    env = {**os.environ, "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "PYTHONWARNINGS": "ignore"}
    procs = [subprocess.Popen([sys.executable, str(script), str(out)], env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(4)]
    measured = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-3000:]
        measured.append(json.loads(stdout.strip().splitlines()[-1]))
    return measured


@pytest.mark.slow
def test_a_pipelines_zero_2_holds_whole_gradients_until_the_schedule_ends(tmp_path):
    """A pipeline's gradients add up over its micro-batches whole, and finish_backward reduce-
    scatters them once (ZeroShards with overlap=False): measured on each of 4 ranks (pp 2 x dp 2),
    the gradients are the stage's whole ones at the backward's end, so the planner prices them
    whole at pp > 1 (plan/auto.py _stage_state), not as ZeRO-2's shard (ZeRO-3: below)."""
    for measured in _pipeline_step_measured(tmp_path, 2, 2, 29612):
        whole = state_bytes_per_device(measured["count"], 1, 2).grads
        assert measured["grads"] >= whole > state_bytes_per_device(measured["count"], 2, 2).grads, measured


@pytest.mark.slow
def test_a_pipelines_zero_3_gathers_every_micro_batch_and_the_estimate_counts_each_gather(tmp_path):
    """Under a pipeline, ZeRO-3 holds whole gradients until the schedule ends (as ZeRO-2, above) and
    frees a stage's units after each forward and backward, so every micro-batch gathers each block
    unit twice: measured on 4 gloo ranks (pp 2 x dp 2) at 2 micro-batches, a step's all-gathers are
    at least 2 per block unit per micro-batch (plus the stage's own unit's), where gathering once a
    step would be 2 per unit. The planner (plan/auto.py) prices M x (passes + 1) gathers of a
    stage's parameters, not one."""
    from nnscaler_cst.analysis import analyze
    from nnscaler_cst.plan.auto import Config, estimate_config
    from nnscaler_cst.plan.cost import load_cluster
    micro = 2
    for measured in _pipeline_step_measured(tmp_path, 3, micro, 29622):
        whole = state_bytes_per_device(measured["count"], 1, 2).grads      # as ZeRO-2's, above
        assert measured["grads"] >= whole > state_bytes_per_device(measured["count"], 3, 2).grads, measured
        units = measured["units"]
        assert units >= 2 and measured["gathers"] >= micro * (1 + 2 * (units - 1)) > 2 * units, measured
    graph = analyze(REPO / "fixtures" / "gpt.py").graph
    cluster = load_cluster("dgx2-v100x32")
    sync = {(micro, zero): estimate_config(graph, Config(1, 2, 2, micro, zero), cluster, []).sync_seconds
            for micro in (2, 4) for zero in (2, 3)}
    assert sync[(4, 2)] == pytest.approx(sync[(2, 2)])           # ZeRO-2: one reduce-scatter, one gather
    assert sync[(4, 3)] > sync[(2, 3)] > sync[(2, 2)]


UNUSED_IN_A_BLOCK = '''
import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)
        self.unused = nn.Linear(d, d)        # built, never called

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Model(nn.Module):
    def __init__(self, d=16, n=3):
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.out = nn.Linear(d, 1)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x).pow(2).mean()


def build():
    torch.manual_seed(0)
    return Model()


def example_inputs():
    return (torch.randn(8, 8, generator=torch.Generator().manual_seed(1)),)
'''


@pytest.mark.slow
def test_zero_3_with_several_backwards_a_step_and_an_unused_parameter_trains_like_one_device(tmp_path):
    """A block unit counts its gradients to know when its backward is done (then it is freed);
    a parameter the forward never uses gets none, and the count it left short carried over into
    the next micro-batch's backward, which freed the unit before its own backward had run
    ("setStorage: ... out of bounds for storage of size 0"). Each backward now counts afresh."""
    (tmp_path / "model.py").write_text(UNUSED_IN_A_BLOCK)
    result = subprocess.run([sys.executable, "-m", "nnscaler_cst.cli", "verify", "model.py", "--dp", "2", "--zero", "3",
                             "--micro-batches", "2", "-o", "out"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0 and "PASSED" in result.stdout, result.stdout + result.stderr
