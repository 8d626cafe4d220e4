"""Spec of training with the output: mixed precision written into the program, gradient clipping
by the single-device model's norm, sharded checkpoints that load under another plan, and the
training API (__init__.py) a user's own loop calls, of which train.py is one user.

Quick: the emitted autocast and API (golden strings), torch.distributed.checkpoint's view of a
rank's pieces (one process), bad input. Slow (gloo processes): verify --precision bf16, verify
--max-grad-norm with a negative control, and a run saved under one plan and resumed under
another against the uninterrupted single-device run.
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nnscaler_cst import cli

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gpt():
    from nnscaler_cst.analysis import analyze
    return analyze(REPO / "fixtures" / "gpt.py")     # fused q|k|v, a tied embedding, blocks to cut


def api_source(analysis, **request) -> str:
    from nnscaler_cst.rewrite import PlanRequest, rewrite
    return rewrite(analysis, PlanRequest(**request)).files["__init__.py"]


def function(source: str, name: str) -> str:
    """The text of one top-level function of `source`."""
    start = source.index(f"\ndef {name}(")
    end = source.find("\ndef ", start + 1)
    return source[start:end if end > 0 else None]


# --------------------------------------------------------------------------------------------
# Mixed precision in the program
# --------------------------------------------------------------------------------------------

def test_bf16_runs_the_forward_and_the_loss_under_autocast_and_the_backward_outside(gpt):
    source = api_source(gpt, tp=2, precision="bf16")
    assert "\nPRECISION = torch.bfloat16\n" in source
    assert "return torch.autocast(device_type, dtype=PRECISION, enabled=PRECISION is not None)" in source
    step = function(source, "forward_backward")
    assert ("    with autocast(device_type_of(model)):\n"
            "        output = model(**inputs) if isinstance(inputs, dict) else model(*inputs)\n"
            "        loss = loss_of(module, output)\n"
            "    scaled(loss).backward()\n") in step       # fp16 scales the loss; others leave it


def test_a_pipeline_runs_each_stage_forward_under_autocast(gpt):
    source = api_source(gpt, pp=2, precision="bf16")
    schedule = function(source, "pipeline_forward_backward")
    assert ("                with autocast(device_type):\n"
            "                    output = stages[local[stage]](**inputs)") in schedule


@pytest.mark.parametrize("precision", [None, "fp32", "tf32"])
def test_float32_precisions_write_no_autocast(gpt, precision):
    assert re.search(r"\nPRECISION = None\b", api_source(gpt, tp=2, precision=precision))


def test_fp16_skips_a_step_whose_gradients_overflowed_and_halves_the_loss_scale(gpt, tmp_path, monkeypatch):
    """The output in one plain process (every axis of size 1): a loss scale past float32's range
    makes every gradient infinite; the step leaves the parameters as they were and halves the
    scale; the next step, at a scale that fits, trains."""
    from nnscaler_cst.rewrite import PlanRequest, rewrite
    out = tmp_path / "fp16_output"
    out.mkdir()
    for name, text in rewrite(gpt, PlanRequest(dp=2, precision="fp16")).files.items():
        (out / name).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    package = importlib.import_module("fp16_output")
    model = package.build(0)
    optimizer = torch.optim.AdamW(package.optimizer_params(model), lr=1e-3)
    batch = package.rank_module(0).example_inputs()
    before = {key: t.clone() for key, t in model.state_dict().items()}
    package.LOSS_SCALE["scale"] = 2.0 ** 127           # the scaled loss (about 5 x 2**127) is inf
    for _ in range(2):
        package.forward_backward(model, batch)
        package.finish_backward(model)
        package.optimizer_step(model, optimizer)
        if _ == 0:
            assert all(torch.equal(t, before[key]) for key, t in model.state_dict().items())
            assert package.LOSS_SCALE["scale"] == 2.0 ** 126
            package.LOSS_SCALE["scale"] = 2.0 ** 8
    assert not torch.equal(model.state_dict()["lm_head.weight"], before["lm_head.weight"])
    assert package.LOSS_SCALE == {"scale": 2.0 ** 8, "good_steps": 1, "skip": False}


def test_the_gradients_are_reduced_in_float32_unless_the_loop_asks_for_another_dtype(gpt):
    finish = function(api_source(gpt, tp=2, dp=2, precision="bf16"), "finish_backward")
    assert "def finish_backward(model, reduce_dtype=None):" in finish
    assert "_comm.wait_grad_buckets(grad_buckets(model), reduce_dtype=reduce_dtype)" in finish


def test_a_bfloat16_reduction_sends_half_the_bytes_and_returns_float32_gradients():
    """sync_grads on an axis of one rank reduces nothing; on a world of one over gloo it runs
    the all-reduce: the bytes counted are bfloat16's, the gradient stays float32."""
    from nnscaler_cst.runtime import _comm
    from nnscaler_cst.verify.launch import free_port
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        axis = _comm.Axis("dp", size=1, rank=0, group=dist.group.WORLD)
        axis.size = 2           # counted as two ranks: the all-reduce runs (on one) and averages by 2
        param = torch.nn.Parameter(torch.zeros(4))
        param.grad = torch.tensor([1.0, 2.0, 3.0, 1 + 2 ** -10])
        _comm.reset_counters()
        _comm.sync_grads([param], axis, average=True, reduce_dtype=torch.bfloat16)
        assert param.grad.dtype == torch.float32 and _comm.COUNTERS["bytes"] == 4 * 2
        assert param.grad.tolist() == [0.5, 1.0, 1.5, 0.5]    # 1 + 2**-10 is 1 in bfloat16
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# The training API and train.py
# --------------------------------------------------------------------------------------------

def test_the_api_holds_every_step_of_a_loop_and_train_py_calls_it(gpt):
    from nnscaler_cst.rewrite import PlanRequest, rewrite
    files = rewrite(gpt, PlanRequest(tp=2, dp=2)).files
    for name in ("setup", "build", "optimizer_params", "batch_share", "forward_backward", "finish_backward",
                 "clip_grad_norm", "optimizer_step", "save_checkpoint", "load_checkpoint", "merged_state_dict"):
        assert f"\ndef {name}(" in files["__init__.py"], name
    loop = function(files["train.py"], "main")
    calls = ["forward_backward(model, batch)", "finish_backward(model)", "clip_grad_norm(model, args.max_grad_norm)",
             "optimizer_step(model, optimizer)"]
    assert [loop.index(c) for c in calls] == sorted(loop.index(c) for c in calls)
    for flag in ("--precision", "--max-grad-norm", "--save", "--resume", "--data"):
        assert f'parser.add_argument("{flag}"' in loop, flag


def test_checkpoint_pieces_load_into_other_pieces_by_their_offsets(tmp_path):
    """A (6, 4) tensor written as three row blocks (as the q|k|v blocks of a split fused weight
    lie) loads into a piece of columns and a piece of rows, whatever blocks wrote them."""
    from nnscaler_cst.runtime._comm import CheckpointChunks
    from nnscaler_cst.verify.launch import free_port
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        whole = torch.arange(24.0).view(6, 4)
        written = CheckpointChunks(whole.shape, [((0, 0), whole[0:1].clone()), ((1, 0), whole[1:3].clone()),
                                                 ((3, 0), whole[3:6].clone())])
        dcp.save({"w": written, "extra": {"step": 4}}, checkpoint_id=str(tmp_path / "ckpt"))
        columns, row = torch.zeros(2, 2), torch.zeros(1, 4)
        extra = {"step": 0}
        dcp.load({"w": CheckpointChunks(whole.shape, [((2, 2), columns), ((5, 0), row)]), "extra": extra},
                 checkpoint_id=str(tmp_path / "ckpt"))
        assert torch.equal(columns, whole[2:4, 2:4]) and torch.equal(row, whole[5:6]) and extra == {"step": 4}
    finally:
        dist.destroy_process_group()


def test_a_max_grad_norm_that_is_not_positive_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["verify", str(REPO / "fixtures" / "gpt.py"), "--tp", "2", "--max-grad-norm", "0", "-o", "out"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "error: --max-grad-norm 0: must be positive" in err and "hint: " in err
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
@pytest.mark.parametrize("entry, args", [("gpt.py", "--tp 2 --dp 2"), ("hf_llama.py", "--pp 2")],
                         ids=["gpt-dp2xtp2", "llama-pp2"])
def test_bf16_trains_like_the_single_device_autocast_run(entry, args, tmp_path):
    result, outcome = verify(f"fixtures/{entry}", *args.split(), "--precision", "bf16", "-o", tmp_path / "out")
    assert result.returncode == 0 and outcome["passed"] is True, outcome
    assert outcome["tolerance"]["grad_rtol"] == 8 * 2 ** -8        # verify's bf16 tolerances were applied
    assert "\nPRECISION = torch.bfloat16\n" in (tmp_path / "out" / "__init__.py").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("args", ["--tp 2 --dp 2", "--pp 2"], ids=["dp2xtp2", "pp2"])
def test_clipped_gradients_equal_the_single_device_clipped_gradients(args, tmp_path):
    """At --max-grad-norm 0.05 every step clips (the GPT fixture's gradient norm is above 1).
    TP=2xDP=2: the norm counts a replicated parameter on one tensor-parallel rank; the negative
    control counts it on both, and the clipped gradients then differ from the single device's."""
    out = tmp_path / "out"
    result, outcome = verify("fixtures/gpt.py", *args.split(), "--max-grad-norm", "0.05", "-o", out)
    assert result.returncode == 0 and outcome["passed"] is True, outcome
    assert outcome["max_grad_error"] <= outcome["tolerance"]["grad_rtol"]
    if "--tp" not in args:
        return
    api = out / "__init__.py"
    text = api.read_text()
    counted_once = "(names[key] in TP_SPLITS or _comm.TP.rank == 0)"
    assert counted_once in text
    api.write_text(text.replace(counted_once, "True"))
    result, outcome = verify("fixtures/gpt.py", "--max-grad-norm", "0.05", "-o", out)   # as it is: no rewrite
    assert result.returncode == 1 and outcome["passed"] is False, outcome
    assert outcome["max_grad_error"] > outcome["tolerance"]["grad_rtol"]


def single_device_losses(entry_file: Path, steps: int, init: Path) -> list[float]:
    """The uninterrupted run: train.py's optimizer (AdamW, lr 1e-3) and batches (example_inputs()
    drawn after manual_seed(seed + step)), on one device; its initial weights saved to `init`."""
    spec = importlib.util.spec_from_file_location("resume_entry", entry_file)
    entry = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(entry)
    torch.manual_seed(0)
    model = entry.build()
    torch.save(model.state_dict(), init)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        torch.manual_seed(step)
        output = model(*entry.example_inputs())
        loss = output if isinstance(output, torch.Tensor) else output.loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def train(out: Path, *args) -> list[float]:
    """train.py of the output on its world of gloo processes; the losses rank 0 prints."""
    from nnscaler_cst.verify.launch import free_port
    world = int(re.search(r"\nWORLD_SIZE = (\d+)", (out / "__init__.py").read_text()).group(1))
    env = {**os.environ, "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    procs = [subprocess.Popen([sys.executable, str(out / "train.py"), *map(str, args)],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, cwd=out.parent,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    logs = [proc.communicate(timeout=600)[0] for proc in procs]
    for proc, log in zip(procs, logs):
        assert proc.returncode == 0, log[-3000:]
    return [float(x) for x in re.findall(r"^step \d+ loss (\S+)$", logs[0], re.M)]


@pytest.fixture(scope="module")
def resumable(tmp_path_factory):
    """The GPT fixture rewritten at TP=2xDP=2 and at PP=2, and 8 single-device steps' losses."""
    folder = tmp_path_factory.mktemp("resume")
    entry = REPO / "fixtures" / "gpt.py"
    for name, args in (("tp2dp2", ["--tp", "2", "--dp", "2"]), ("pp2", ["--pp", "2"])):
        subprocess.run([sys.executable, "-m", "nnscaler_cst.cli", str(entry), *args, "-o", folder / name],
                       cwd=REPO, check=True, capture_output=True, timeout=600)
    return folder, single_device_losses(entry, 8, folder / "init.pt")


@pytest.mark.slow
@pytest.mark.parametrize("first, then", [("tp2dp2", "pp2"), ("pp2", "tp2dp2")])
def test_a_checkpoint_saved_under_one_plan_resumes_under_another_as_if_uninterrupted(resumable, first, then):
    from nnscaler_cst.verify.equivalence import run_verify
    folder, expected = resumable
    checkpoint = folder / f"from-{first}"
    losses = train(folder / first, "--init", folder / "init.pt", "--steps", 4, "--save", checkpoint)
    losses += train(folder / then, "--resume", checkpoint, "--steps", 8)
    tolerance = run_verify.__kwdefaults__     # verify's own float32 tolerances
    assert len(losses) == 8
    for got, want in zip(losses, expected):
        assert abs(got - want) <= tolerance["loss_atol"] + tolerance["rtol"] * abs(want), (losses, expected)
