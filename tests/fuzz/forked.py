"""Run the command line as a fork of a long-lived process that has imported the tool once.

A fresh `python -m nnscaler_cst.cli` spends seconds importing torch, torch's fake-tensor and
compiler modules and the tool before its own work, and a fuzz run starts thousands. `prepare()`
imports all that once into this process, which then runs nothing of torch; `run_cli` forks it
for each command, so each command still starts from the same clean state (no module, cache or
global of one example leaks into the next) and ends with the fork. Linux only (fork, prctl).
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import time

PR_SET_PDEATHSIG = 1


def prepare() -> None:
    """Import what every command imports. Call before anything has imported torch: torch started
    with one intra-op thread leaves this process single-threaded, so forking it is safe."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401            (fake tensors import it)
    import torch._inductor.config  # noqa: F401   (use_deterministic_algorithms imports it)
    import nnscaler_cst.analysis  # noqa: F401
    import nnscaler_cst.cli  # noqa: F401
    import nnscaler_cst.rewrite  # noqa: F401
    import nnscaler_cst.verify.equivalence  # noqa: F401
    threads = len(os.listdir("/proc/self/task"))
    assert threads == 1, f"{threads} threads after the imports: forking would be unsafe"


def run_cli(args: list[str], cwd, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """`nnscaler-rewrite ARGS` in `cwd` under `env`, as a fork of this process; as subprocess.run
    with capture_output=True, text=True (TimeoutExpired past `timeout`, the fork's tree killed)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush()
        sys.stderr.flush()
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:
            _child(args, cwd, env, out, err, parent)
        deadline = time.monotonic() + timeout
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                _kill_tree(pid)
                os.waitpid(pid, 0)
                raise subprocess.TimeoutExpired(["nnscaler-rewrite", *args], timeout, stderr=_read(err))
            time.sleep(0.02)
        return subprocess.CompletedProcess(["nnscaler-rewrite", *args], os.waitstatus_to_exitcode(status),
                                           _read(out), _read(err))


def _child(args, cwd, env, out, err, parent: int) -> None:
    code = 1
    try:
        os.setsid()                                   # its own group: killed with all it started
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:
            os._exit(1)
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        sys.argv = ["nnscaler-rewrite", *args]
        if args and args[0] == "verify":
            from nnscaler_cst.verify.forkserver import prestart_by_fork
            prestart_by_fork()                        # verify's processes fork from a copy of this
        from nnscaler_cst.cli import main
        main(list(args))
        code = 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
    except BaseException:
        sys.excepthook(*sys.exc_info())              # the traceback the command line would print
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _kill_tree(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _read(file) -> str:
    file.seek(0)
    return file.read().decode(errors="replace")
