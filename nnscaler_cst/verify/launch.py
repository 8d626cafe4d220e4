"""Start processes under a deadline, and start gloo worlds on a port nobody takes meanwhile.

A port found by binding to port 0 is an *ephemeral* port: between closing our probe socket
and rank 0 binding its TCPStore, the kernel may hand that same port to any outgoing
connection on the machine (gloo opens dozens), and rank 0 fails with EADDRINUSE. Ports
below the kernel's ephemeral range are never handed out that way, so we probe one of
those; a world that still loses the race (another program listening) is started again on
a fresh port.
"""
from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path


class LaunchError(Exception):
    """A process failed or timed out."""


_PORT_IN_USE = ("eaddrinuse", "address already in use")
_ATTEMPTS = 3


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
    return env


def run_all(commands: list[tuple[list[str], dict]], timeout: float) -> None:
    """Start every command; wait for all; on the first failure or the deadline kill the rest."""
    procs = []
    for cmd, env in commands:
        log = tempfile.TemporaryFile()
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log, env))
    deadline = time.monotonic() + timeout
    try:
        while True:
            states = [p.poll() for p, _, _ in procs]
            failed = [(k, code) for k, code in enumerate(states) if code not in (None, 0)]
            if failed:
                k, code = failed[0]
                raise LaunchError(f"process {procs[k][2].get('RANK', 'reference')} exited with {code}:\n"
                                  + _tail(procs[k][1]))
            if all(code == 0 for code in states):
                return
            if time.monotonic() > deadline:
                stuck = [k for k, c in enumerate(states) if c is None]
                waiting = [procs[k][2].get("RANK", "reference") for k in stuck]
                where = _where_stuck([(procs[k][0], procs[k][1]) for k in stuck])
                raise LaunchError(f"timed out after {timeout:.0f}s waiting for rank(s) {', '.join(waiting)} "
                                  "(a deadlock or a hang)" + "".join(
                                      f"\n  rank {name} is in {place}" for name, place in zip(waiting, where)
                                      if place))
            time.sleep(0.05)
    finally:
        for p, log, _ in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()


def run_world(command: list[str], world: int, timeout: float, **env) -> None:
    """Run ``command`` as ranks 0..world-1 of one torch.distributed world (the variables
    torchrun sets), one intra-op thread each."""
    for attempt in range(_ATTEMPTS):
        port = free_port()
        try:
            run_all([(command, process_env(RANK=r, WORLD_SIZE=world, LOCAL_RANK=r, MASTER_ADDR="127.0.0.1",
                                           MASTER_PORT=port, **env))
                     for r in range(world)], timeout)
            return
        except LaunchError as err:
            if attempt + 1 == _ATTEMPTS or not any(s in str(err).lower() for s in _PORT_IN_USE):
                raise


def _where_stuck(stuck: list[tuple[subprocess.Popen, object]]) -> list[str]:
    """Where each stuck process is: the workers dump their stack on SIGUSR1 (faulthandler); the
    innermost frames, most recent first (`all_reduce (_comm.py:212) <- sync_grads (...)`)."""
    if not hasattr(signal, "SIGUSR1"):
        return [""] * len(stuck)
    for proc, _ in stuck:
        if proc.poll() is None:
            proc.send_signal(signal.SIGUSR1)
    time.sleep(1.0)
    places = []
    for _, log in stuck:
        log.seek(0)
        text = log.read().decode(errors="replace")
        block = text.rpartition("(most recent call first):")[2]
        frames = re.findall(r'File "([^"]+)", line (\d+) in (\S+)', block)
        places.append(" <- ".join(f"{func} ({Path(path).name}:{line})" for path, line, func in frames[:3]))
    return places


def _tail(log, lines: int = 25) -> str:
    log.seek(0)
    return "\n".join(log.read().decode(errors="replace").splitlines()[-lines:])
