"""Starting rank processes: the rendezvous port, and a world that loses its port to another program."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from nnscaler_cst.verify import launch

# Each rank binds MASTER_PORT the way rank 0's TCPStore does, and says which port it got.
BIND = ("import os, socket\n"
        "s = socket.socket(); s.bind(('127.0.0.1', int(os.environ['MASTER_PORT'])))\n"
        "open(os.environ['OUT'] + os.environ['RANK'], 'w').write(os.environ['MASTER_PORT'])\n")


def test_the_rendezvous_port_is_free_and_below_the_ephemeral_range():
    low = launch._ephemeral_low()
    for _ in range(20):
        port = launch.free_port()
        assert 1024 <= port < low
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_world_whose_port_is_taken_starts_again_on_another(tmp_path, monkeypatch):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    busy = taken.getsockname()[1]
    ports = iter([busy, launch.free_port()])
    monkeypatch.setattr(launch, "free_port", lambda: next(ports))
    try:
        launch.run_world([sys.executable, "-c", BIND], 1, timeout=60, OUT=tmp_path / "rank")
    finally:
        taken.close()
    assert int((tmp_path / "rank0").read_text()) != busy


def test_other_failures_are_not_retried(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(launch, "free_port", lambda: calls.append(1) or 29999)
    with pytest.raises(launch.LaunchError, match="exited with 3"):
        launch.run_world([sys.executable, "-c", "raise SystemExit(3)"], 2, timeout=60)
    assert len(calls) == 1


# Rank 1 waits forever in a function of its own; rank 0 ends at once.
STUCK = ("import faulthandler, os, signal, time\n"
         "faulthandler.register(signal.SIGUSR1)\n"
         "def wait_for_the_peer():\n"
         "    time.sleep(600)\n"
         "if os.environ['RANK'] == '1':\n"
         "    wait_for_the_peer()\n")


@pytest.mark.slow
def test_a_run_past_its_deadline_names_the_rank_and_the_call_it_waits_in():
    with pytest.raises(launch.LaunchError) as caught:
        launch.run_world([sys.executable, "-c", STUCK], 2, timeout=3)
    message = str(caught.value)
    assert "rank(s) 1 " in message and "rank 1 is in wait_for_the_peer" in message, message


# Spends CPU_S of CPU time on one core, then ends; SPIN spins on that core until killed.
CPU_S = 0.6
WORK = ("import os, sys, time\n"
        "os.sched_setaffinity(0, {int(sys.argv[1])})\n"
        f"while time.process_time() < {CPU_S}:\n"
        "    pass\n")
SPIN = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True:\n    pass\n"


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux's CPU affinity and schedstat")
def test_time_spent_waiting_for_a_cpu_does_not_count_against_the_deadline():
    """Three spinning processes share the run's core: it gets a quarter of it and needs about
    four times its CPU time in wall time, past the deadline, yet it is slow, not hung."""
    core = str(min(os.sched_getaffinity(0)))
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN, core]) for _ in range(3)]
    try:
        started = time.monotonic()
        launch.run_all([([sys.executable, "-c", WORK, core], launch.process_env())], timeout=CPU_S * 1.5)
        assert time.monotonic() - started > CPU_S * 1.5    # it did run past the deadline
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def test_ranks_wait_at_openmp_barriers_asleep_unless_the_user_says_otherwise(tmp_path, monkeypatch):
    """A rank's (and the reference's) OpenMP threads sleep at a barrier: spinning, they take the
    core of a thread of another process (launch.py OMP_WAIT). A policy the user set is kept."""
    read = "import os; open(os.environ['OUT'] + os.environ['RANK'], 'w').write(os.environ['OMP_WAIT_POLICY'])\n"
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    launch.run_world([sys.executable, "-c", read], 1, timeout=60, OUT=tmp_path / "default")
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    launch.run_world([sys.executable, "-c", read], 1, timeout=60, OUT=tmp_path / "set")
    assert (tmp_path / "default0").read_text() == "PASSIVE"
    assert (tmp_path / "set0").read_text() == "ACTIVE"
