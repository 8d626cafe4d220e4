"""Start processes under a deadline, and start gloo worlds on a port nobody takes meanwhile.

A port found by binding to port 0 is an *ephemeral* port: between closing our probe socket
and rank 0 binding its TCPStore, the kernel may hand that same port to any outgoing
connection on the machine (gloo opens dozens), and rank 0 fails with EADDRINUSE. Ports
below the kernel's ephemeral range are never handed out that way, so we probe one of
those; a world that still loses the race (another program listening) is started again on
a fresh port.
"""
from __future__ import annotations

import importlib.util
import os
import random
import re
import signal
import socket
import subprocess
import sysconfig
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from ..errors import UserError


class LaunchError(Exception):
    """A process failed or timed out."""


_PORT_IN_USE = ("eaddrinuse", "address already in use")
_ATTEMPTS = 3
# A worker prints this prefix and its phase ("setup", "step 2", "saving") as it enters each phase
# (verify/worker.py), so a failure or a hang is reported with the step it happened in.
PHASE_MARK = "nnscaler-verify phase: "
# A rendezvous port the user fixes (a firewall that opens one port): used as it is, never retried.
PORT_VARIABLE = "NNSCALER_VERIFY_PORT"
# The launcher's pid: a worker that finds its parent already gone at start-up ends at once.
LAUNCHER_VARIABLE = "NNSCALER_VERIFY_LAUNCHER"
_STACK_DUMP = "(most recent call first):"   # faulthandler's heading of a stack dump
_STACK_DUMP_WAIT_S = 5.0


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; macOS and Windows start at 49152


def free_port() -> int:
    """A port that is free now and that the kernel will not give to an outgoing connection."""
    high = _ephemeral_low()
    low = max(1024, high - 12000)
    for _ in range(200):
        port = random.randrange(low, high)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:  # a crowded machine: fall back to any port
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def process_env(**extra) -> dict:
    env = dict(os.environ)
    env.update({k: str(v) for k, v in extra.items()})
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault(*OMP_WAIT)
    return env


# OpenMP threads that sleep, not spin, at a barrier: the reference's reordered pass runs two
# threads beside the ranks, and a spinning thread takes the core its partner needs (MobileNetV2's
# float64 verify on a busy 2-core machine: 111 s with spinning, 30 s without). libgomp reads it
# when torch loads, so it goes in each process's environment (and the console script's own).
OMP_WAIT = ("OMP_WAIT_POLICY", "PASSIVE")


class _Process:
    """One started command: its own session (so its whole tree can be killed), its log, its name.
    A command the fork server serves (`forks`, verify/forkserver.py) is started as its fork."""

    def __init__(self, cmd: list[str], env: dict, forks=None):
        self.name = f"rank {env['RANK']}" if "RANK" in env else "the reference run"
        self.log = tempfile.TemporaryFile()
        env = {**env, LAUNCHER_VARIABLE: str(os.getpid())}
        if forks is not None and forks.serves(cmd):
            self.popen = forks.spawn(cmd, env, self.log)
        else:
            self.popen = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                          start_new_session=hasattr(os, "killpg"))

    def text(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def phase(self) -> str:
        """The phase it last entered, as "during step 2"; "" for a command that marks none."""
        marks = [line[len(PHASE_MARK):].strip() for line in self.text().splitlines() if line.startswith(PHASE_MARK)]
        return f" during {marks[-1]}" if marks else ""

    def stop(self) -> None:
        if self.popen.poll() is None:
            if hasattr(os, "killpg"):
                try:
                    os.killpg(self.popen.pid, signal.SIGKILL)   # the process and anything it started
                except ProcessLookupError:
                    pass
            else:
                self.popen.kill()
            self.popen.wait()
        self.log.close()


@contextmanager
def terminated_as_exit():
    """SIGTERM (a job scheduler, `kill`) ends the run as an exception would: the processes are
    killed and temporary folders removed on the way out; exit 143 as for the signal itself."""
    if threading.current_thread() is not threading.main_thread():
        yield                                     # only the main thread may set a handler
        return

    def exit_on_terminate(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, exit_on_terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_all(commands: list[tuple[list[str], dict]], timeout: float, forks=None) -> None:
    """Start every command; wait for all; on the first failure or the deadline kill the rest
    (each command's whole process group), naming the process, its phase and where it waits.
    `forks`: a fork server (verify/forkserver.py) that starts the commands it serves."""
    procs = []
    if forks is not None:
        forks.wait_ready(timeout)
    deadline = time.monotonic() + timeout
    try:
        for cmd, env in commands:
            procs.append(_Process(cmd, env, forks))
        while True:
            states = [p.popen.poll() for p in procs]
            failed = [k for k, code in enumerate(states) if code not in (None, 0)]
            if failed:
                raise LaunchError(_failure_report(procs, failed))
            if all(code == 0 for code in states):
                return
            if time.monotonic() > deadline:
                running = [p for p in procs if p.popen.poll() is None]
                waited = max((_cpu_wait_s(p.popen.pid) for p in running), default=0.0)
                if time.monotonic() > deadline + waited:
                    raise LaunchError(_hang_report(running, timeout, waited))
            time.sleep(0.05)
    finally:
        for p in procs:
            p.stop()


def _cpu_wait_s(pid: int) -> float:
    """Seconds the process's main thread has waited for a CPU while it could run (Linux's
    schedstat; 0 elsewhere). The deadline does not count them: on a machine with more runnable
    processes than cores a run is slow, not hung, and one waiting in a deadlock sleeps."""
    try:
        return int(Path(f"/proc/{pid}/schedstat").read_text().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


def _failure_report(procs: list[_Process], failed: list[int]) -> str:
    """The process that failed first, by cause: one killed by a signal explains the others, which
    then fail on a closed connection."""
    first = min(failed, key=lambda k: (procs[k].popen.returncode >= 0, k))
    proc, code = procs[first], procs[first].popen.returncode
    if code < 0:
        how = f"was killed by {_signal_name(-code)}"
        why = " (no traceback: killed from outside, e.g. by the out-of-memory killer)" \
            if -code == signal.SIGKILL else ""
    else:
        how, why = f"exited with {code}", ""
        if any(s in proc.text().lower() for s in _PORT_IN_USE):
            why = " (the rendezvous port was taken by another program)"
    others = [f"{procs[k].name} {_exit_words(procs[k].popen.returncode)}" for k in failed if k != first]
    then = f"; then {', '.join(others)}" if others else ""
    tail = _tail(proc)
    return f"{proc.name} {how}{proc.phase()}{why}{then}" + (f":\n{tail}" if tail else "")


def _exit_words(code: int) -> str:
    return f"was killed by {_signal_name(-code)}" if code < 0 else f"exited with {code}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _hang_report(stuck: list[_Process], timeout: float, waited: float = 0.0) -> str:
    places = _where_stuck(stuck)
    ranks = [p.name.removeprefix("rank ") for p in stuck if p.name.startswith("rank ")]
    waiting = f"rank(s) {', '.join(ranks)}" if ranks else " and ".join(p.name for p in stuck)
    queued = f", past the {waited:.0f}s spent waiting for a CPU on a loaded machine" if waited >= 1 else ""
    lines = [f"timed out after {timeout:.0f}s waiting for {waiting} (a deadlock or a hang){queued}"]
    in_collective = [_in_collective(place) for place in places]
    if any(in_collective) and not all(in_collective):
        lines.append(f"  the others wait for {', '.join(p.name for p, c in zip(stuck, in_collective) if not c)}, "
                     "which is in no collective")
    for proc, place, collective in zip(stuck, places, in_collective):
        if place:
            waits = f", waiting in {collective}" if collective else ""
            lines.append(f"  {proc.name} is in {' <- '.join(f for _, f in place)}{proc.phase()}{waits}")
    return "\n".join(lines)


def fixed_port() -> int | None:
    """$NNSCALER_VERIFY_PORT, checked; None when unset."""
    value = os.environ.get(PORT_VARIABLE)
    if value is not None and not (value.isdigit() and 0 < int(value) < 65536):
        raise UserError(f"{PORT_VARIABLE}={value}: not a port number",
                        hint=f"a port from 1024 to 65535, or unset {PORT_VARIABLE} to let verify pick one")
    return int(value) if value is not None else None


def run_world(command: list[str], world: int, timeout: float, forks=None, **env) -> None:
    """Run ``command`` as ranks 0..world-1 of one torch.distributed world (the variables
    torchrun sets), one intra-op thread each. The port is $NNSCALER_VERIFY_PORT when set.
    `forks`: as for run_all."""
    fixed = fixed_port()
    for attempt in range(_ATTEMPTS):
        port = fixed or free_port()
        try:
            run_all([(command, process_env(RANK=r, WORLD_SIZE=world, LOCAL_RANK=r, MASTER_ADDR="127.0.0.1",
                                           MASTER_PORT=port, **env))
                     for r in range(world)], timeout, forks)
            return
        except LaunchError as err:
            in_use = any(s in str(err).lower() for s in _PORT_IN_USE)
            if fixed and in_use:
                raise LaunchError(f"{err}\nhint: port {fixed} is {PORT_VARIABLE}; free it, or unset "
                                  f"{PORT_VARIABLE} to let verify pick a free port") from None
            if attempt + 1 == _ATTEMPTS or not in_use:
                raise


def _where_stuck(stuck: list[_Process]) -> list[list[tuple[str, str]]]:
    """Where each stuck process is: the workers dump their stack on SIGUSR1 (faulthandler). Per
    process its innermost frame, then the innermost caller in each of up to three files outside torch and
    the standard library (the generated files' lines), each as (path, "all_reduce (_comm.py:212)")."""
    if not hasattr(signal, "SIGUSR1"):
        return [[] for _ in stuck]
    dumps_before = [proc.text().count(_STACK_DUMP) for proc in stuck]
    for proc in stuck:
        if proc.popen.poll() is None:
            proc.popen.send_signal(signal.SIGUSR1)
    deadline = time.monotonic() + _STACK_DUMP_WAIT_S   # a loaded machine may take a while to answer
    while time.monotonic() < deadline and any(p.text().count(_STACK_DUMP) == n for p, n in zip(stuck, dumps_before)):
        time.sleep(0.1)
    time.sleep(0.1)                                     # the dump's last lines
    places = []
    for proc in stuck:
        block = proc.text().rpartition(_STACK_DUMP)[2]
        frames = [(path, f"{func} ({Path(path).name}:{line})")
                  for path, line, func in re.findall(r'File "([^"]+)", line (\d+) in (\S+)', block)]
        callers = {}                                 # the innermost caller in each file under test
        for path, frame in frames[1:]:
            if not _library(path):
                callers.setdefault(path, frame)
        places.append(frames[:1] + list(callers.items())[:3])
    return places


def _in_collective(place: list[tuple[str, str]]) -> str:
    """The torch.distributed call a stuck process waits in ("all_reduce"), or ""."""
    if not place:
        return ""
    path, frame = place[0]
    return frame.split(" ")[0] if _torch_dir() / "distributed" in Path(path).resolve().parents else ""


def _tail(proc: _Process, lines: int = 25) -> str:
    return "\n".join([line for line in proc.text().splitlines() if not line.startswith(PHASE_MARK)][-lines:])


def _library(path: str) -> bool:
    """A frame of torch or of Python itself: the callers worth naming are in the files under test."""
    if path.startswith("<frozen"):
        return True
    folder = Path(path).resolve().parents
    return _torch_dir() in folder or Path(sysconfig.get_paths()["stdlib"]).resolve() in folder


def _torch_dir() -> Path:
    """torch's folder, found without importing torch (this module serves torch-free tests too)."""
    spec = importlib.util.find_spec("torch")
    return Path(spec.origin).resolve().parent if spec and spec.origin else Path("/nonexistent-torch")
