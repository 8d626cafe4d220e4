"""Spec of `nnscaler-rewrite verify`: the rewritten model, run on real gloo processes, trains
exactly like the single-device model; and the check fails when the rewrite is wrong.

Every test runs the real command line (`nnscaler-rewrite verify FILE ... --json`) in a fresh
process: the tool rewrites, then starts one reference process and N rank processes, runs a few
AdamW steps on the same batches and compares per-step losses and the merged parameters.
Negative controls hand-break a correct output folder and verify it as it is (no --tp/--dp, so
verify does not rewrite): a wrong formula must fail the check (exit 1), a hung rank must end
the run within --timeout, naming the rank, and leave no process behind.

All tests are slow (~10-40 s each): run with `CI=true` or `pytest -m slow`.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import processes_mentioning

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
RUN_LIMIT_S = 600           # a guard for the test itself; verify's own --timeout is what is tested

# The tolerances the tool applies must stay strict enough to see one AdamW step (lr 1e-3) going
# the wrong way, and a loss that differs in the fourth digit.
MAX_PARAM_ATOL = 5e-4
MAX_LOSS_ERROR = 1e-4


def verify(*args, timeout: float = RUN_LIMIT_S) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "COLUMNS": "200", "PYTHONWARNINGS": "ignore"}
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "nnscaler_cst.cli", "verify", *map(str, args)], cwd=REPO,
                            env=env, capture_output=True, text=True, timeout=timeout)
    return result, time.monotonic() - started


def report(result: subprocess.CompletedProcess) -> dict:
    """The --json object verify printed (it prints none when a process died or hung)."""
    start = result.stdout.find("{")
    assert start >= 0, f"no JSON report; exit {result.returncode}\n{result.stdout}\n{result.stderr[-3000:]}"
    return json.loads(result.stdout[start:])


CASES = {
    # id -> (entry file, tp, dp)
    "gpt-tp2": ("fixtures/gpt.py", 2, 1),
    "gpt-dp2": ("fixtures/gpt.py", 1, 2),
    "gpt-dp2xtp2": ("fixtures/gpt.py", 2, 2),
    "hf_gpt2-tp2": ("fixtures/hf_gpt2.py", 2, 1),
    "hf_gpt2-dp2xtp2": ("fixtures/hf_gpt2.py", 2, 2),
    "hf_llama-tp2": ("fixtures/hf_llama.py", 2, 1),
    "hf_llama-dp2xtp2": ("fixtures/hf_llama.py", 2, 2),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """verify of each case, run once per module (the negative controls reuse the GPT TP=2 folder)."""
    root = tmp_path_factory.mktemp("verify")
    done = {}

    def run(case: str):
        if case not in done:
            entry, tp, dp = CASES[case]
            out = root / case.replace("-", "_")
            result, _ = verify(entry, "--tp", tp, "--dp", dp, "-o", out, "--json")
            done[case] = (result, out)
        return done[case]
    return run


@pytest.mark.parametrize("case", list(CASES))
def test_the_parallel_run_trains_like_the_single_device_run(runs, case):
    result, _ = runs(case)
    _, tp, dp = CASES[case]
    outcome = report(result)
    assert result.returncode == 0 and outcome["passed"] is True, outcome
    assert outcome["world_size"] == tp * dp
    tolerance = outcome["tolerance"]
    assert tolerance["param_atol"] <= MAX_PARAM_ATOL and tolerance["loss_atol"] <= MAX_LOSS_ERROR
    reference, parallel = outcome["reference_losses"], outcome["parallel_losses"]
    assert len(reference) == len(parallel) == outcome["steps"] >= 3
    for step, (ref, par) in enumerate(zip(reference, parallel)):
        assert ref == ref and 0 < ref < 100, (step, ref)           # a real loss, not NaN
        assert abs(ref - par) <= MAX_LOSS_ERROR * max(1.0, abs(ref)), (step, ref, par)
    assert outcome["max_abs_error"] <= tolerance["param_atol"], outcome["worst_param"]


@pytest.mark.parametrize("case", [c for c in CASES if "dp2xtp2" in c])
def test_tensor_by_data_parallel_ranks_all_run_one_program_file(runs, case):
    """Four ranks that run the same code share model.py; each reads its coordinates at run time."""
    result, out = runs(case)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in out.glob("model*.py")) == ["model.py"]
    assert re.search(r"^PROGRAMS = \['model'\]$", (out / "__init__.py").read_text(), re.M)


# --------------------------------------------------------------------------------------------
# Negative controls: the check can fail
# --------------------------------------------------------------------------------------------

def broken_copy(runs, tmp_path: Path, name: str) -> Path:
    result, folder = runs("gpt-tp2")
    assert result.returncode == 0, "the correct folder must verify first"
    copy = tmp_path / name
    shutil.copytree(folder, copy, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def edit(path: Path, old: str, new: str) -> str:
    text = path.read_text()
    assert text.count(old) == 1, f"`{old}` occurs {text.count(old)} times in {path.name}"
    path.write_text(text.replace(old, new))
    return path.read_text()


def test_a_missing_all_reduce_fails_the_check(runs, tmp_path):
    """The MLP's row-parallel output left as partial sums on every rank: the ranks still run the
    same collectives, so the run completes, with wrong numbers."""
    out = broken_copy(runs, tmp_path, "no_mlp_reduce")
    text = edit(out / "model.py",
                "x = tp_reduce(torch.nn.functional.linear(x, self.c_proj.weight), TP) + self.c_proj.bias",
                "x = torch.nn.functional.linear(x, self.c_proj.weight) + self.c_proj.bias")
    result, _ = verify("fixtures/gpt.py", "-o", out, "--json")
    outcome = report(result)
    assert result.returncode == 1 and outcome["passed"] is False, outcome
    assert outcome["max_abs_error"] > outcome["tolerance"]["param_atol"] or any(
        e > outcome["tolerance"]["loss_atol"] for e in outcome["loss_errors"]), outcome
    assert outcome["float64"]["passed"] is False, outcome     # not rounding: float64 differs as much
    assert (out / "model.py").read_text() == text   # verified as it is


def test_a_wrong_formula_on_one_rank_fails_the_check(runs, tmp_path):
    """Rank 1 swaps its query and key heads: same collectives, wrong attention on half the heads.
    Both ranks run model.py; the edit asks the tensor-parallel group which rank runs it."""
    out = broken_copy(runs, tmp_path, "swapped_qk")
    text = (out / "model.py").read_text()
    line = next(line for line in text.splitlines() if line.lstrip().startswith("q, k, v = self.c_attn(x).split("))
    indent = line[:len(line) - len(line.lstrip())]
    broken = edit(out / "model.py", line, f"{line}\n{indent}if TP.rank == 1:\n{indent}    q, k = k, q")
    result, _ = verify("fixtures/gpt.py", "-o", out, "--json")
    outcome = report(result)
    assert result.returncode == 1 and outcome["passed"] is False, outcome
    assert outcome["float64"]["passed"] is False, outcome
    assert (out / "model.py").read_text() == broken


@pytest.fixture(scope="module")
def hung(runs, tmp_path_factory):
    """verify of a folder whose rank 1 sleeps for 10 minutes in forward, with --timeout 40: the
    ranks' start-up counts against it, and on a loaded machine (CI runs two test workers) 20 s
    once caught rank 1 only entering forward, its stack one frame short of the model's line."""
    out = broken_copy(runs, tmp_path_factory.mktemp("hung"), "rank1_sleeps")
    edit(out / "model.py", "        b, t = idx.size()\n",
         "        if TP.rank == 1:  # rank 1 hangs\n            import time; time.sleep(600)\n        b, t = idx.size()\n")
    timeout = 40
    result, seconds = verify("fixtures/gpt.py", "-o", out, "--timeout", timeout, "--json", timeout=300)
    return result, seconds, timeout, out


def test_a_hung_rank_ends_the_run_within_the_timeout_naming_the_rank(hung):
    result, seconds, timeout, _ = hung
    assert result.returncode != 0
    message = result.stderr
    assert "timed out" in message, message[-2000:]
    assert re.search(r"rank\(?s?\)?\s[\d, ]*\b1\b", message), message[-2000:]
    assert re.search(r"rank 1 is in forward \(model\.py:\d+\)", message), message[-2000:]
    # the rank phase ends at the deadline; the rest is start-up and the single-device reference
    assert seconds < timeout + 120, seconds


def test_a_hung_run_leaves_no_process_behind(hung):
    _, _, _, out = hung
    deadline = time.monotonic() + 10
    while processes_mentioning(str(out)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert processes_mentioning(str(out)) == []
