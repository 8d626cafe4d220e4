"""Spec of `nnscaler-rewrite verify` under faults: a rank that dies mid-step, a rank stuck before
a collective, a rendezvous port another program holds.

Each fault is injected for real into the real command line (gloo processes, a real listening
socket): a rank dies or hangs through $NNSCALER_VERIFY_FAULT (verify/worker.py), the port is
fixed with $NNSCALER_VERIFY_PORT and held by a listener. verify must end with exit 1 (a failed
run, not bad input) in under a minute, name the rank and the step, leave no process behind, and
write nothing: the output folder is byte for byte as before and its temporary folder is gone.

All tests are slow (each runs verify once): run with `CI=true` or `pytest -m slow`.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import processes_mentioning

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
BOUND_S = 60             # a fault must end verify within this
HANG_TIMEOUT_S = 25      # verify's --timeout for the hung rank (its processes need ~10 s to start)
GUARD_S = 300            # a guard for the test itself


def cli(*args, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nnscaler_cst.cli", *map(str, args)], cwd=cwd,
                          env={**os.environ, "COLUMNS": "1000", **(env or {})}, capture_output=True, text=True,
                          timeout=GUARD_S)


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """mlp.py rewritten for TP=2 into out/, once."""
    root = tmp_path_factory.mktemp("faults")
    shutil.copy(REPO / "fixtures" / "mlp.py", root / "mlp.py")
    result = cli("mlp.py", "--tp", 2, "-o", "out", cwd=root)
    assert result.returncode == 0, result.stderr
    return root


def files_under(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def verify_under_fault(project: Path, tmp_path: Path, *options, env: dict) -> tuple[int, str, float]:
    """Run verify on the folder as it is; while it runs, watch its processes (so the check that
    none is left can fail); afterwards check it left none and wrote nothing. (exit, stderr, seconds)"""
    before = files_under(project)
    scratch = tmp_path / "tmp"          # verify's temporary folder goes here, to be checked
    scratch.mkdir()
    def started_processes():            # the ranks name the output folder, the reference run its workdir
        return processes_mentioning(str(project)) + processes_mentioning(str(scratch))

    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "nnscaler_cst.cli", "verify", "mlp.py", "-o", "out",
                             "--steps", "2", *map(str, options)],
                            cwd=project, env={**os.environ, "COLUMNS": "1000", "TMPDIR": str(scratch), **env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = 0
    while proc.poll() is None and time.monotonic() - started < GUARD_S:
        seen = max(seen, len(started_processes()))
        time.sleep(0.02)        # a rank that fails its rendezvous lives well under a second
    _, stderr = proc.communicate(timeout=GUARD_S)
    seconds = time.monotonic() - started
    assert seen >= 1, "no process of the run was ever seen: the leftover check below could not fail"
    assert started_processes() == [], "processes left behind"
    assert files_under(project) == before, "verify wrote into the project"
    left = list(scratch.glob("nnscaler-verify-*"))   # torch's own caches (torchinductor_*) may stay
    assert left == [], f"verify left {left}"
    return proc.returncode, stderr, seconds


def test_a_rank_that_dies_mid_step_ends_verify_naming_the_rank_and_the_step(project, tmp_path):
    code, message, seconds = verify_under_fault(project, tmp_path, env={"NNSCALER_VERIFY_FAULT": "die:1:1"})
    assert code == 1, message
    assert "rank 1 was killed by SIGKILL during step 1" in message, message
    assert seconds < BOUND_S, seconds


def test_a_rank_stuck_before_a_collective_is_named_with_the_collective_the_others_wait_in(project, tmp_path):
    code, message, seconds = verify_under_fault(project, tmp_path, "--timeout", HANG_TIMEOUT_S,
                                                env={"NNSCALER_VERIFY_FAULT": "hang:1:1"})
    assert code == 1, message
    assert f"timed out after {HANG_TIMEOUT_S}s waiting for rank(s) 0, 1" in message, message
    assert "the others wait for rank 1, which is in no collective" in message, message
    # where rank 0 waits: the torch.distributed call, and the generated line that made it
    assert re.search(r"rank 0 is in all_reduce \(distributed_c10d\.py:\d+\) <- _all_reduce \(_comm\.py:\d+\) "
                     r"<- .*\(model\.py:\d+\).* during step 1, waiting in all_reduce", message), message
    assert re.search(r"rank 1 is in hang_before_collective \(worker\.py:\d+\) .* during step 1", message), message
    assert seconds < BOUND_S, seconds


def test_a_rendezvous_port_held_by_another_program_ends_verify_naming_rank_0(project, tmp_path):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        code, message, seconds = verify_under_fault(project, tmp_path, env={"NNSCALER_VERIFY_PORT": str(port)})
    assert code == 1, message
    assert "rank 0 exited with 1 during setup (the rendezvous port was taken by another program)" in message, message
    assert f"hint: port {port} is NNSCALER_VERIFY_PORT" in message, message
    assert seconds < BOUND_S, seconds


def signal_verify_while_its_ranks_run(project: Path, scratch: Path, signum: int) -> int:
    """Start verify with rank 1 stuck in step 0, send verify `signum` once both ranks run, and
    return its exit status after its ranks are gone (or the wait for that gave up)."""
    proc = subprocess.Popen([sys.executable, "-m", "nnscaler_cst.cli", "verify", "mlp.py", "-o", "out",
                             "--steps", "2", "--timeout", str(GUARD_S)], cwd=project,
                            env={**os.environ, "NNSCALER_VERIFY_FAULT": "hang:1:0", "TMPDIR": str(scratch)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ranks = str(project / "out")
    started = time.monotonic()
    while len(processes_mentioning(ranks)) < 2 and time.monotonic() - started < GUARD_S:
        assert proc.poll() is None, "verify ended before its ranks started"
        time.sleep(0.2)
    assert list(scratch.glob("nnscaler-verify-*")), "verify's temporary folder is not where the test looks"
    proc.send_signal(signum)
    code = proc.wait(timeout=GUARD_S)
    deadline = time.monotonic() + 10
    while processes_mentioning(ranks) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_mentioning(ranks) == [], "ranks outlived verify"
    return code


def test_verify_killed_outright_takes_its_ranks_with_it(project, tmp_path):
    """SIGKILL of verify itself (a CI job's time limit) runs no cleanup of ours: the kernel ends the ranks."""
    assert signal_verify_while_its_ranks_run(project, tmp_path, signal.SIGKILL) == -signal.SIGKILL


def test_verify_terminated_ends_its_ranks_and_removes_its_temporary_folder(project, tmp_path):
    assert signal_verify_while_its_ranks_run(project, tmp_path, signal.SIGTERM) == 128 + signal.SIGTERM
    assert list(tmp_path.glob("nnscaler-verify-*")) == []


# Rank 1 starts a child of its own that would sleep for ten minutes, then waits; rank 0 fails.
TREE = ("import os, subprocess, sys, time\n"
        "if os.environ['RANK'] == '1':\n"
        "    child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        "    open(os.environ['OUT'], 'w').write(str(child.pid))\n"
        "    time.sleep(600)\n"
        "while not os.path.exists(os.environ['OUT']):\n"
        "    time.sleep(0.05)\n"
        "raise SystemExit(3)\n")


def test_a_failed_world_is_ended_with_everything_its_ranks_started(tmp_path):
    from nnscaler_cst.verify import launch
    pid_file = tmp_path / "grandchild"
    with pytest.raises(launch.LaunchError, match="rank 0 exited with 3"):
        launch.run_world([sys.executable, "-c", TREE], 2, timeout=60, OUT=pid_file)
    grandchild = Path("/proc") / pid_file.read_text()
    deadline = time.monotonic() + 5
    while grandchild.exists() and "Z" not in (grandchild / "stat").read_text().split()[2] \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not grandchild.exists() or (grandchild / "stat").read_text().split()[2] == "Z", "a grandchild survived"
