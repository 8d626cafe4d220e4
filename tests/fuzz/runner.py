"""Run one drawn model under one plan the way a user does, and say how it ended.

The model's files go into a fresh folder; `nnscaler-rewrite verify ENTRY --tp/--dp/--pp ... -o
OUT --json` runs there as a subprocess. Every run ends in one of three outcomes:

- PASSED: exit 0, the parallel run equals the single-device run.
- REFUSED: exit 2 with a `path:line:col: error:` line, no traceback, and nothing written (the
  folder holds exactly the model's files afterwards).
- FAILURE: anything else — a wrong result, a crash after writing, a traceback, an internal
  error (the dry run's `internal error:` is a bug of the rewrite even when located), a
  refusal without a location, a hang.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .models import DrawnModel

REPO = Path(__file__).resolve().parents[2]

PLANS = {"tp2": ["--tp", "2"], "dp2": ["--dp", "2"], "pp2": ["--pp", "2"], "dp2xtp2": ["--dp", "2", "--tp", "2"]}
VERIFY_TIMEOUT_S = 120          # verify's own deadline for its processes
RUN_TIMEOUT_S = 420             # ours, for the whole command (rewrite + verify)

EXCEPTION_LINE = re.compile(r"^[\w.]*(?:Error|Exception|Exit|Interrupt)\b.*$", re.M)
LOCATED_ERROR = re.compile(r"^(?P<path>\S[^:\n]*):(?P<line>\d+):(?P<col>\d+): error: (?P<message>.*)$", re.M)


def plans_for(model: DrawnModel) -> list[str]:
    """The plans that apply: pipelining needs a loop over at least two blocks to cut."""
    return [p for p in PLANS if p != "pp2" or model.blocks_in_loop >= 2]


@dataclass
class Outcome:
    kind: str                 # "PASSED" | "REFUSED" | "FAILURE"
    reason: str               # the refusal's message, or what went wrong
    command: str
    seconds: float
    detail: str = ""          # stderr/stdout tail of a failure

    def report(self, model: DrawnModel) -> str:
        return (f"{self.kind}: {self.reason}\ncommand (in the model's folder): {self.command}\n"
                f"--- model ---\n{model.source()}\n--- output tail ---\n{self.detail}")


def _files(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts}


def subprocess_cli(args: list[str], cwd: Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """The command line as a user runs it: a fresh process."""
    return subprocess.run([sys.executable, "-m", "nnscaler_cst.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def run(model: DrawnModel, plan: str, workdir: Path, cli=subprocess_cli) -> Outcome:
    """Write the model into `workdir` (a fresh folder), run verify under `plan`, classify.
    `cli` runs the command: a fresh process, or a fork of a prepared one (fuzz/forked.py)."""
    workdir.mkdir(parents=True, exist_ok=True)
    for name, text in model.files.items():
        (workdir / name).write_text(text)
    before = _files(workdir)
    args = ["verify", model.entry, *PLANS[plan], "-o", "out", "--json", "--timeout", str(VERIFY_TIMEOUT_S)]
    command = "nnscaler-rewrite " + " ".join(args)
    env = {**os.environ, "COLUMNS": "200"}
    started = time.monotonic()
    try:
        result = cli(args, workdir, env, RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        return Outcome("FAILURE", f"hang: no exit after {RUN_TIMEOUT_S}s", command, RUN_TIMEOUT_S,
                       str(exc.stderr or "")[-3000:])
    seconds = time.monotonic() - started
    tail = f"exit {result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    written = _files(workdir) - before

    def failure(reason: str) -> Outcome:
        return Outcome("FAILURE", reason, command, seconds, tail)

    if "Traceback (most recent call last)" in result.stderr:
        raised = EXCEPTION_LINE.findall(result.stderr.split("Traceback (most recent call last)")[-1])
        return failure(f"a traceback: {raised[-1][:300] if raised else '(no exception line)'}")
    if result.returncode == 0:
        return Outcome("PASSED", "", command, seconds)
    if result.returncode == 2:
        located = LOCATED_ERROR.search(result.stderr)
        if located is None:
            said = next((line for line in result.stderr.splitlines() if "error:" in line), "(no error line)")
            return failure(f"refused without a location: {said.strip()[:300]}")
        if "internal error" in located["message"]:
            return failure(f"internal error: {located['message']}")
        if written:
            return failure(f"refused after writing {sorted(written)[:5]}")
        return Outcome("REFUSED", located["message"], command, seconds)
    if result.returncode == 1:
        start = result.stdout.find("{")
        if start >= 0:
            report = json.loads(result.stdout[start:])
            return failure(f"wrong result: loss errors {report['loss_errors']}, max parameter error "
                           f"{report['max_abs_error']:.3g} ({report['worst_param']}), first-step gradient error "
                           f"{report['max_grad_error']:.3g} ({report['worst_grad']})")
        return failure("crash after writing: " + (result.stderr.strip().splitlines() or ["(no message)"])[0][:300])
    return failure(f"exit {result.returncode}")


def refusal_group(message: str) -> str:
    """A refusal's message with its sizes, names and positions stripped, to count like with like."""
    message = re.sub(r"`[^`]*`|'[^']*'", "'…'", message)
    message = re.sub(r"\(\s*\d+(\s*,\s*\d+)*\s*,?\s*\)", "(…)", message)
    return re.sub(r"\d+", "N", message)[:160]
