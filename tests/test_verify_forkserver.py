"""Spec of verify's fork server (nnscaler_cst/verify/forkserver.py): verify's processes are forks of
one process that imported torch once, and still behave as fresh `python worker.py` processes.

Each test runs real gloo worlds (slow): the reference and both ranks of a TP=2 rewrite of
fixtures/mlp.py start as forks and the run passes; a fork cannot import the tool, even when the
server is a fork of a process that has the tool imported; `ps` names each fork by the command
it stands for; with NNSCALER_VERIFY_FORK=0 the processes start fresh as before.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from conftest import mlp_rewritten_for_tp2, processes_mentioning
from nnscaler_cst.verify import equivalence, forkserver
from nnscaler_cst.verify.launch import LaunchError, process_env, run_all

pytestmark = pytest.mark.slow
WORKER = str(equivalence.WORKER)


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """mlp.py rewritten for TP=2 into out/, once."""
    return mlp_rewritten_for_tp2(tmp_path_factory.mktemp("forks"))


def test_a_verify_whose_processes_are_forks_passes(project, monkeypatch):
    monkeypatch.chdir(project)
    with forkserver.started() as server:
        assert server is not None and server.serves([sys.executable, WORKER])
        result = equivalence.run_verify(Path("mlp.py"), Path("out"), steps=2, timeout=120, forks=server)
        # the reference run and both ranks were the server's forks, and each ended well
        assert len(server.pids) == 3 and [server.exits[p] for p in sorted(server.pids)] == [0, 0, 0]
    assert result.passed, result.to_json()


def test_without_forks_the_processes_start_fresh_and_pass(project, monkeypatch):
    monkeypatch.chdir(project)
    monkeypatch.setenv(forkserver.FORK_VARIABLE, "0")
    with forkserver.started() as server:
        assert server is None
    assert equivalence.run_verify(Path("mlp.py"), Path("out"), steps=1, timeout=120).passed


IMPORTS_THE_TOOL = textwrap.dedent('''\
    import nnscaler_cst.verify.launch
    def build(): ...
    ''')


def test_a_fork_cannot_import_the_tool(tmp_path, monkeypatch):
    """A passing run proves the generated code self-contained: the tool is no import away."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "entry.py").write_text(IMPORTS_THE_TOOL)
    with forkserver.started() as server:
        with pytest.raises(LaunchError, match=r"ModuleNotFoundError: .*nnscaler_cst"):
            run_all([([sys.executable, WORKER, "reference", "entry.py", str(tmp_path)], process_env())], 60, server)
        assert server.pids, "the reference run was no fork"


# A driver that imported the tool (as tests/fuzz/forked.py does) forks the server from itself: its
# forks must still find the tool unimportable, and be seen in `ps` as the worker command they run.
BY_FORK = textwrap.dedent('''\
    import os, sys
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch, nnscaler_cst.cli
    from nnscaler_cst.verify import equivalence, forkserver
    from nnscaler_cst.verify.launch import LaunchError, process_env, run_all
    forkserver.prestart_by_fork()
    with forkserver.started() as server:
        try:
            run_all([([sys.executable, equivalence.WORKER.as_posix(), "reference", "entry.py", sys.argv[1]],
                      process_env())], 60, server)
        except LaunchError as err:
            print("FAILED", err)
        print("FORKS", len(server.pids), "READY", server.ready)
    ''')


def test_a_server_forked_from_a_process_that_imported_the_tool_hides_it(tmp_path):
    (tmp_path / "entry.py").write_text(IMPORTS_THE_TOOL)
    result = subprocess.run([sys.executable, "-c", BY_FORK, str(tmp_path)], cwd=tmp_path, capture_output=True,
                            text=True, timeout=300)
    assert "FORKS 1 READY True" in result.stdout, result.stdout + result.stderr
    assert re.search(r"ModuleNotFoundError: .*nnscaler_cst", result.stdout), result.stdout


SLEEPER = textwrap.dedent('''\
    import time
    def build():
        time.sleep(600)
    ''')


def test_ps_names_a_fork_by_the_worker_command_it_runs(tmp_path, monkeypatch):
    """Leftover-process checks (tests/test_faults.py) and users find the ranks by their command."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "entry.py").write_text(SLEEPER)
    marker = str(tmp_path / "workdir-named")
    with forkserver.started() as server, tempfile.TemporaryFile() as log:
        assert server.serves([sys.executable, WORKER])
        fork = server.spawn([sys.executable, WORKER, "reference", "entry.py", marker], process_env(), log)
        try:
            seen = []
            for _ in range(100):
                seen = processes_mentioning(marker)
                if seen:
                    break
                time.sleep(0.1)
            assert seen == [fork.pid]
            cmdline = Path(f"/proc/{fork.pid}/cmdline").read_bytes().split(b"\0")
            assert cmdline[1:4] == [WORKER.encode(), b"reference", b"entry.py"]
        finally:
            fork.kill()
            fork.wait(timeout=30)
    assert processes_mentioning(marker) == []


# verify's forks find the installed libraries the entry imports at its top already imported by
# the server (timm, transformers: seconds each per process); the entry itself is never imported
# by the server, and a local module is never preloaded.
SEES_PRELOADED = textwrap.dedent('''\
    import sys
    import torch
    PRELOADED = "libcst" in sys.modules
    def build():
        open("seen.txt", "w").write(f"{PRELOADED} {'seen_once' in sys.modules}")
        return torch.nn.Linear(2, 2)
    def example_inputs():
        return (torch.randn(4, 2),)
    def loss(output):
        return output.pow(2).mean()
    ''')


def test_the_server_imports_the_installed_libraries_the_entry_imports(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "seen_once.py").write_text("")
    (tmp_path / "entry.py").write_text("import os\nimport libcst.metadata\nfrom seen_once import *\n"
                                       + SEES_PRELOADED)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert forkserver.installed_imports(tmp_path / "entry.py") == ["libcst"]
    (tmp_path / "entry.py").write_text(SEES_PRELOADED)       # the check: no import of its own
    with forkserver.started(["libcst"]) as server:
        run_all([([sys.executable, WORKER, "reference", "entry.py", str(tmp_path), "--steps", "1"],
                  process_env())], 120, server)
        assert server.pids, "the reference run was no fork"
    assert (tmp_path / "seen.txt").read_text() == "True False"


def test_a_server_that_dies_starting_is_reported_at_once(tmp_path):
    """A server whose start-up fails (an import error in it) used to leave the launcher waiting
    for its `ready` until the whole run's deadline: it is a LaunchError carrying its output."""
    (tmp_path / "sitecustomize.py").write_text("import os, sys\nprint('broken start-up', flush=True)\nos._exit(3)\n")
    env = {**process_env(), "PYTHONPATH": str(tmp_path)}
    server = forkserver.ForkServer(forkserver.WORKER, env)
    start = time.monotonic()
    try:
        with pytest.raises(LaunchError, match="broken start-up"):
            server.wait_ready(120)
    finally:
        server.close()
    assert time.monotonic() - start < 30
