"""A fork server for verify's processes: torch is imported once, each process is a fork.

Every verify process (the reference run, each rank) used to be a fresh `python worker.py`, and
each spent seconds importing torch before doing a few milliseconds of work. The server is one
such process that imports torch (through worker.py) and then only forks: it never runs a torch
op, never starts a thread and never joins a process group, so each fork starts as a fresh
worker would, with torch loaded and the installed libraries the entry file imports at its top
(`import timm`: seconds per process; installed_imports) and nothing else. The code under test
is still imported fresh in each fork (the server never imports the entry, the output or the
user's own modules), and `nnscaler_cst` stays unimportable there.

Both ends live here: `ForkServer` (the launcher's side, imported as nnscaler_cst.verify.forkserver)
and `serve()` (the server, run as a plain script next to worker.py). They talk over a Unix
SEQPACKET socket, one JSON message a packet: a request carries the process's log file as a
passed descriptor, and the server answers with its pid, later with its exit status (the server
is its parent and reaps it). A fork gets its own session (so the launcher can kill its whole
tree), dies with the server (PR_SET_PDEATHSIG), and the server dies with the launcher.

Linux only (prctl, /proc); elsewhere, or with NNSCALER_VERIFY_FORK=0, verify starts plain
processes as before.
"""
import json
import os
import select
import signal
import socket
import sys
import time
from contextlib import contextmanager

FORK_VARIABLE = "NNSCALER_VERIFY_FORK"      # "0": start every process fresh (no fork server)
# The server's own command line carries this much blank space, so a fork can write its
# worker command line over it: `ps` and leftover-process checks then see each process as the
# `python worker.py rank OUT ...` it stands for, not as a copy of the server.
TITLE_ROOM = 4096
_PACKET = 1 << 20


WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")


def enabled() -> bool:
    return sys.platform.startswith("linux") and os.environ.get(FORK_VARIABLE, "1") != "0"


_prestarted: list = []          # a server forked ahead by prestart_by_fork, for the next started()


def prestart_by_fork() -> None:
    """Fork the next verify's server from this process now: for a driver that imported torch and
    the tool once and forks itself per command (tests/fuzz/forked.py), so that no process of
    the command imports torch again. This process must be single-threaded, no torch op run."""
    from .launch import process_env
    if enabled():
        _prestarted.append(ForkServer(WORKER, process_env(), by_fork=True))


def installed_imports(entry_file) -> list[str]:
    """The installed packages (in site-packages) that the entry file imports at its top level:
    every process of verify imports them again (timm, transformers: seconds each), so the server
    imports them once. The user's own modules and the standard library are never among them."""
    import ast
    import importlib.util
    import site
    try:
        tree = ast.parse(open(entry_file, encoding="utf-8").read())
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return []
    names = []
    for stmt in tree.body:
        if isinstance(stmt, ast.Import):
            names += [alias.name.partition(".")[0] for alias in stmt.names]
        elif isinstance(stmt, ast.ImportFrom) and not stmt.level and stmt.module:
            names.append(stmt.module.partition(".")[0])
    roots = tuple(os.path.realpath(p) + os.sep for p in [*site.getsitepackages(), site.getusersitepackages()])
    found = []
    for name in dict.fromkeys(names):
        if name == "torch":
            continue                 # the worker's own import
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        origin = spec and (spec.origin or next(iter(spec.submodule_search_locations or ()), None))
        if origin and os.path.realpath(origin).startswith(roots):
            found.append(name)
    return found


@contextmanager
def started(preload: list[str] = ()):
    """A fork server for verify's processes, killed on the way out; None (fresh processes) where
    forking is off or unsupported. Imports no torch here: a caller starts it first thing.
    `preload`: installed packages the server imports for its forks (installed_imports)."""
    from .launch import process_env
    if not enabled():
        yield None
        return
    server = _prestarted.pop() if _prestarted else ForkServer(WORKER, process_env(), preload=preload)
    try:
        yield server
    finally:
        server.close()


# ---- the launcher's side -------------------------------------------------------------------

class ForkServer:
    """One server process; `spawn` starts a worker process as its fork."""

    def __init__(self, worker: str, env: dict, by_fork: bool = False, preload: list[str] = ()):
        """Start the server as `python forkserver.py`, or (`by_fork`) as a fork of this process,
        which must be single-threaded and have run no torch op yet (a prepared driver that runs
        many verifies: tests/fuzz/forked.py); it then needs no imports of its own."""
        import subprocess
        import tempfile
        from .launch import LAUNCHER_VARIABLE
        self.worker = worker
        self.log = tempfile.TemporaryFile()
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # one thread while it imports torch (so it can fork); each fork sets its own count
        env = {**env, LAUNCHER_VARIABLE: str(os.getpid()), "OMP_NUM_THREADS": "1"}
        if by_fork:
            self.proc = _ForkedServer(self, theirs, env)
        else:
            self.proc = subprocess.Popen([sys.executable, __file__, str(theirs.fileno()), ",".join(preload),
                                          " " * TITLE_ROOM],
                                         env=env, stdin=subprocess.DEVNULL, stdout=self.log,
                                         stderr=subprocess.STDOUT, pass_fds=[theirs.fileno()],
                                         start_new_session=True)
        theirs.close()
        self.exits: dict[int, int] = {}       # pid -> exit status as Popen.returncode gives it
        self.pids: set[int] = set()
        self.ready: bool | None = None        # None until the server says whether it can fork

    def wait_ready(self, timeout: float) -> None:
        """Wait until the server has imported torch: its start-up is no part of the processes'
        run time, which their deadline bounds."""
        deadline = time.monotonic() + timeout
        while self.ready is None:
            if time.monotonic() > deadline:
                from .launch import LaunchError
                raise LaunchError(f"the fork server did not start within {timeout:.0f}s")
            if select.select([self.sock], [], [], 0.1)[0] and self._receive(block=False) is None:
                self._server_gone()     # it died starting (an import failed): say so, not wait out the time

    def serves(self, cmd: list[str]) -> bool:
        """Whether `cmd` runs as a fork: a worker command, and a server that could fork safely
        (else the launcher starts it as a fresh process, as without a server)."""
        if cmd[:2] != [sys.executable, self.worker]:
            return False
        while self.ready is None:
            self._receive(block=True)
        return self.ready

    def spawn(self, cmd: list[str], env: dict, log) -> "Forked":
        """Start `python worker.py ARGS` (cmd) as a fork, env as its whole environment, output to `log`."""
        request = {"argv": cmd[1:], "env": env, "cwd": os.getcwd()}
        try:
            socket.send_fds(self.sock, [json.dumps(request).encode()], [log.fileno()])
        except OSError:
            self._server_gone()
        while True:
            reply = self._receive(block=True)
            if "pid" in reply:
                self.pids.add(reply["pid"])
                return Forked(self, reply["pid"])

    def poll(self, pid: int) -> int | None:
        while pid not in self.exits and self._receive(block=False):
            pass
        return self.exits.get(pid)

    def _receive(self, block: bool) -> dict | None:
        if not select.select([self.sock], [], [], None if block else 0)[0]:
            return None
        try:
            data = self.sock.recv(_PACKET)
        except OSError:
            data = b""
        if not data:                              # the server is gone: so are its forks (PDEATHSIG)
            for pid in self.pids - self.exits.keys():
                self.exits[pid] = -signal.SIGKILL
            if block:
                self._server_gone()
            return None
        reply = json.loads(data)
        if "exit" in reply:
            self.exits[reply["exit"]] = reply["code"]
        if "ready" in reply:
            self.ready = reply["ready"]
        return reply

    def _server_gone(self):
        from .launch import LaunchError
        try:
            self.proc.wait(timeout=5)
        except Exception:
            pass
        self.log.seek(0)
        said = self.log.read().decode(errors="replace").strip()
        raise LaunchError(f"the fork server exited with {self.proc.returncode}" + (f":\n{said[-3000:]}" if said else ""))

    def close(self) -> None:
        """Kill the server; its forks die with it (each is killed first by its _Process anyway)."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        self.sock.close()
        self.log.close()


class _ForkedServer:
    """The server as a fork of the launcher: as subprocess.Popen for close() and the error path."""

    def __init__(self, server: ForkServer, theirs: socket.socket, env: dict):
        sys.stdout.flush()
        sys.stderr.flush()
        self.returncode = None
        self.pid = os.fork()
        if self.pid == 0:
            try:
                server.sock.close()
                os.setsid()
                null = os.open(os.devnull, os.O_RDONLY)
                os.dup2(null, 0)
                os.dup2(server.log.fileno(), 1)
                os.dup2(server.log.fileno(), 2)
                os.environ.clear()
                os.environ.update(env)
                # as `python worker.py` would be: the tool unimportable, its folder first on the path
                for name in [m for m in sys.modules if m == "nnscaler_cst" or m.startswith("nnscaler_cst.")]:
                    del sys.modules[name]
                sys.path[:] = [os.path.dirname(server.worker)] + _interpreter_path()
                import importlib.util
                spec = importlib.util.spec_from_file_location("worker", server.worker)
                worker = importlib.util.module_from_spec(spec)
                sys.modules["worker"] = worker
                spec.loader.exec_module(worker)
                serve(theirs.detach(), worker)
            except BaseException:
                import traceback
                traceback.print_exc()
            finally:
                os._exit(1)

    def poll(self):
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout=None):
        if self.returncode is None:
            self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        return self.returncode


def _interpreter_path() -> list[str]:
    """sys.path as a fresh interpreter starts it: $PYTHONPATH and the installation's own folders
    (site-packages included), without what this process added at run time."""
    import site
    roots = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, site.getuserbase())}
    given = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    own = [p for p in sys.path if p and any(os.path.realpath(p).startswith(r + os.sep) for r in roots)]
    return given + [p for p in own if p not in given]


class Forked:
    """The part of subprocess.Popen that the launcher uses, for a fork of the server."""

    def __init__(self, server: ForkServer, pid: int):
        self.server, self.pid, self.returncode = server, pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.poll(self.pid)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"process {self.pid} still running")
            select.select([self.server.sock], [], [], 0.05)
        return self.returncode


# ---- the server ----------------------------------------------------------------------------

def serve(fd: int, worker=None, preload: list[str] = ()) -> None:
    if worker is None:
        import worker              # torch, and the worker's own set-up (ends with the launcher)
    worker.preload()
    for name in preload:
        try:
            __import__(name)
        except Exception:          # noqa: BLE001 -- each fork imports it as a fresh process would
            import traceback
            traceback.print_exc()
    sock = socket.socket(fileno=fd)
    me = os.getpid()
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:
        # A fork copies only the forking thread: a lock another thread holds (OpenMP's pool,
        # started by some environment settings) would stay locked in the fork forever.
        sock.send(json.dumps({"ready": False, "why": f"{threads} threads after importing torch"}).encode())
        return
    sock.send(json.dumps({"ready": True}).encode())
    while True:
        if select.select([sock], [], [], 0.05)[0]:
            data, fds, _, _ = socket.recv_fds(sock, _PACKET, 1)
            if not data:
                return                        # the launcher closed its end: its forks die with us
            request = json.loads(data)
            pid = os.fork()
            if pid == 0:
                _run_fork(worker, sock, me, request, fds[0])
            os.close(fds[0])
            sock.send(json.dumps({"pid": pid}).encode())
        while True:                           # reap, and say how each ended
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            sock.send(json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}).encode())


def _run_fork(worker, sock, server_pid: int, request: dict, log_fd: int) -> None:
    """In the fork: become the worker process the request describes, run it, exit with its status."""
    code = 1
    try:
        sock.close()
        os.setsid()                           # its own group: the launcher kills it with all it started
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(null)
        os.close(log_fd)
        _die_with(server_pid)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        # this request's $PYTHONPATH, after the worker's folder, as a fresh interpreter puts it
        sys.path[1:1] = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
        sys.argv = list(request["argv"])
        sys.dont_write_bytecode = bool(os.environ.get("PYTHONDONTWRITEBYTECODE"))
        if os.environ.get("OMP_NUM_THREADS", "").isdigit():
            worker.torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        _retitle([sys.executable, *sys.argv])
        signal.signal(signal.SIGINT, signal.default_int_handler)
        worker.main()
        code = 0
    except SystemExit as exc:                 # as the interpreter itself would end
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
    except BaseException:
        import traceback
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)                    # no interpreter teardown: the server's state is not ours


def _die_with(server_pid: int) -> None:
    import ctypes
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != server_pid:            # the server went before we asked
        os._exit(1)


def _retitle(argv: list[str]) -> None:
    """Write `argv` over this process's command line (the server's blank room), as setproctitle does."""
    import ctypes
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        start, end = int(fields[45]), int(fields[46])        # arg_start, arg_end (fields 48, 49)
    except (OSError, ValueError, IndexError):
        return
    title = "\0".join(argv).encode()[:end - start - 1]
    ctypes.memmove(start, title + b"\0" * (end - start - len(title)), end - start)


if __name__ == "__main__":
    serve(int(sys.argv[1]), preload=[name for name in sys.argv[2].split(",") if name])
