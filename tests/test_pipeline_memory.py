"""Activation memory follows the pipeline schedule, measured on real gloo processes (issue 5).

Why pipelines use 1F1B rather than GPipe: a stage must keep a micro-batch's activations (the
tensors autograd saves for backward) from its forward until its backward. Under GPipe every
rank runs all M forwards before any backward, so every stage holds M micro-batches at once.
Under 1F1B rank i runs D - i - 1 warm-up forwards and then alternates one forward with one
backward, so it never holds more than min(D - i, M) micro-batches: D on the first stage, one on
the last.

The driver below (a plain script, one process per rank, gloo) imports the generated package as
a user would, builds its stage, and runs ONE train_step under a
torch.autograd.graph.saved_tensors_hooks pair that counts the bytes of every storage autograd
saves (parameters excluded) while it is alive: a weakref finalizer on the storage subtracts it
when it is freed. It reports the peak per rank, and how many bytes each forward left alive
(one micro-batch's activations on that stage). The batch itself (micro-batches are views of
it) and the parameters are not activations and are not counted.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from nnscaler_cst.verify.launch import free_port

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
GPT = REPO / "fixtures" / "gpt.py"
TIMEOUT_S = 300
D, M = 4, 8          # pipeline stages (ranks), micro-batches

DRIVER = r'''
import importlib, json, os, sys, weakref
sys.modules["nnscaler_cst"] = None            # the generated code must not need the tool
import torch

folder, out_path = sys.argv[1:3]
sys.path.insert(0, os.path.dirname(folder))
package = importlib.import_module(os.path.basename(folder))
comm = importlib.import_module(package.__name__ + "._comm")
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
comm.setup(rank, world, tp=package.TP_SIZE, dp=package.DP_SIZE, pp=package.PP_SIZE, backend="gloo")
module = package.rank_module(rank)
torch.manual_seed(0)
stages = package.build(rank)
stages.train()
optimizer = torch.optim.AdamW(stages.parameters(), lr=1e-3)
torch.manual_seed(0)
batch = module.example_inputs()
# not activations: the parameters, and the batch the caller holds anyway (micro-batches are views of it)
not_activations = {t.untyped_storage().data_ptr() for t in [*stages.parameters(), *batch]}


class Meter:
    alive = 0          # bytes of saved, not yet freed activation storages
    peak = 0
    tracked = set()    # ids of the storages counted now
    saved = 0          # pack calls that counted a new storage


def freed(key, nbytes):
    Meter.tracked.discard(key)
    Meter.alive -= nbytes


def pack(t):
    storage = t.untyped_storage()
    if storage.data_ptr() in not_activations:
        return t
    key = id(storage)    # the storage's Python object lives exactly as long as the storage
    if key not in Meter.tracked:
        Meter.tracked.add(key)
        nbytes = storage.nbytes()
        Meter.alive += nbytes
        Meter.saved += 1
        Meter.peak = max(Meter.peak, Meter.alive)
        weakref.finalize(storage, freed, key, nbytes)
    return t


def unpack(t):
    return t


per_forward = {}     # stage -> bytes each forward left alive
for local, stage in enumerate(module.PIPELINE_STAGES):
    def measured(*args, _forward=stages[local].forward, _stage=stage, **kwargs):
        before = Meter.alive
        try:
            return _forward(*args, **kwargs)
        finally:
            per_forward.setdefault(_stage, []).append(Meter.alive - before)
    stages[local].forward = measured

with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
    loss = package.train_step(stages, optimizer, batch)
comm.teardown()
json.dump({"rank": rank, "stages": module.PIPELINE_STAGES, "schedule": module.SCHEDULE, "peak": Meter.peak,
           "alive_after_step": Meter.alive, "saved": Meter.saved, "per_forward": per_forward, "loss": loss},
          open(out_path, "w"))
'''


def rewrite(folder: Path, schedule: str) -> None:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    result = subprocess.run([sys.executable, "-m", "nnscaler_cst.cli", GPT, "--pp", str(D), "--micro-batches",
                             str(M), "--schedule", schedule, "-o", folder], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=TIMEOUT_S)
    assert result.returncode == 0, result.stdout + result.stderr


def measure(root: Path, schedule: str) -> list[dict]:
    folder = root / f"gpt_pp{D}_{schedule}"
    rewrite(folder, schedule)
    driver = root / "driver.py"
    driver.write_text(DRIVER)
    port = free_port()
    procs = []
    for rank in range(D):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(D), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "PYTHONWARNINGS": "ignore"}
        log = open(root / f"{schedule}_rank{rank}.log", "w")
        procs.append((subprocess.Popen([sys.executable, str(driver), str(folder),
                                        str(root / f"{schedule}_rank{rank}.json")],
                                       cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    deadline = time.monotonic() + TIMEOUT_S
    try:
        for proc, _ in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    for rank, (proc, _) in enumerate(procs):
        assert proc.returncode == 0, (root / f"{schedule}_rank{rank}.log").read_text()[-3000:]
    return [json.loads((root / f"{schedule}_rank{rank}.json").read_text()) for rank in range(D)]


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict[str, list[dict]]:
    root = tmp_path_factory.mktemp("pipeline_memory")
    for name in ("1f1b", "gpipe"):
        (root / name).mkdir()
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(measure, root / name, name) for name in ("1f1b", "gpipe")}
        return {name: f.result() for name, f in futures.items()}


def per_micro(report: dict) -> float:
    """Bytes one forward of this rank's stage leaves alive (all micro-batches have one shape)."""
    sizes = report["per_forward"][str(report["stages"][0])]
    assert len(sizes) == M and max(sizes) == min(sizes) > 0, sizes
    return sizes[0]


def test_each_rank_ran_its_schedule_in_one_process_per_stage(measured):
    for name, reports in measured.items():
        for rank, report in enumerate(reports):
            assert report["stages"] == [rank]
            actions = report["schedule"].split()
            assert len(actions) == 2 * M and all(a.startswith(str(rank)) for a in actions)
            if name == "gpipe":
                assert [a[1] for a in actions] == ["F"] * M + ["B"] * M
            assert report["saved"] > 0
        losses = {round(r["loss"], 6) for r in reports}
        assert len(losses) == 1, losses     # every rank reports the full step's loss
    assert {round(r["loss"], 6) for r in measured["1f1b"]} == {round(r["loss"], 6) for r in measured["gpipe"]}


def test_no_saved_activation_outlives_the_step(measured):
    alive = {name: [r["alive_after_step"] for r in reports] for name, reports in measured.items()}
    assert alive == {"1f1b": [0] * D, "gpipe": [0] * D}


def test_1f1b_first_stage_holds_about_D_micro_batches_gpipe_about_M(measured):
    """The brief's yardstick: the last stage under 1F1B holds one micro-batch at a time, so its
    peak is one micro-batch's activations; stage 0 holds D of them under 1F1B, M under GPipe."""
    one_f1b, gpipe = measured["1f1b"], measured["gpipe"]
    unit = one_f1b[-1]["peak"]
    ratio_1f1b = one_f1b[0]["peak"] / unit
    ratio_gpipe = gpipe[0]["peak"] / unit
    assert 0.6 * D <= ratio_1f1b <= 1.4 * D, (ratio_1f1b, one_f1b[0]["peak"], unit)
    assert 0.6 * M <= ratio_gpipe <= 1.4 * M, (ratio_gpipe, gpipe[0]["peak"], unit)
    assert one_f1b[0]["peak"] <= 0.7 * gpipe[0]["peak"]


def test_1f1b_rank_i_holds_D_minus_i_micro_batches_at_its_peak(measured):
    """In flight on rank i under 1F1B: D - i - 1 warm-up forwards plus the steady state's one."""
    for rank, report in enumerate(measured["1f1b"]):
        held = report["peak"] / per_micro(report)
        assert held == pytest.approx(min(D - rank, M), rel=0.1), (rank, held)


def test_gpipe_every_rank_holds_all_micro_batches_at_its_peak(measured):
    for rank, report in enumerate(measured["gpipe"]):
        held = report["peak"] / per_micro(report)
        assert held == pytest.approx(M, rel=0.1), (rank, held)


def test_the_same_stage_saves_the_same_bytes_per_micro_batch_under_either_schedule(measured):
    for rank in range(D):
        assert per_micro(measured["1f1b"][rank]) == per_micro(measured["gpipe"][rank])
