"""Spec of user errors in the model file, seen from the command line.

A broken model file gives exit code 2 and a first stderr line `path:line:col: error: ...` that
points at the place in the user's own file to fix (1-based line and column, in characters),
a hint saying what to do, and no traceback unless --verbose. Each case runs the real CLI in a
fresh process on a real file; the expected position is found by searching the file's text.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

TIMEOUT_S = 120


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    # a narrow terminal, where a long message must still stay on its one `path:line:col:` line
    env = {**os.environ, "COLUMNS": "80"}
    return subprocess.run([sys.executable, "-m", "nnscaler_cst.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S)


def position_of(text: str, needle: str) -> tuple[int, int]:
    """1-based (line, column) of `needle` in `text`, columns counted in characters."""
    offset = text.index(needle)
    before = text[:offset]
    return before.count("\n") + 1, offset - (before.rfind("\n") + 1) + 1


@dataclass
class BadFile:
    id: str
    source: str
    at: str | None            # text the error must point at; None: the file as a whole (1:1)
    says: list[str]           # what the message and hint must mention


def dedent(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


_GOOD_ENTRY = dedent("""


    def build():
        return Net()


    def example_inputs():
        return (torch.randn(4, 4),)
""")

BAD_FILES = [
    BadFile("syntax_error", dedent("""
        import torch


        def build():
            return torch.nn.Linear(2, 2


        def example_inputs():
            return (torch.randn(1, 2),)
    """), at="(2, 2", says=["syntax error", "was never closed", "valid Python"]),
    BadFile("no_build", dedent("""
        import torch


        def example_inputs():
            return (torch.randn(1, 2),)
    """), at=None, says=["no `build()`", "def build():", "--model ClassName"]),
    BadFile("no_example_inputs", dedent("""
        import torch


        def build():
            return torch.nn.Linear(2, 2)
    """), at=None, says=["no `example_inputs()`", "def example_inputs():"]),
    BadFile("exception_deep_in_forward", dedent("""
        import torch
        import torch.nn as nn


        def heads(x):
            return x.view(3, 5)


        class Inner(nn.Module):
            def forward(self, x):
                return heads(x) * 2


        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.inner = Inner()
                self.w = nn.Parameter(torch.ones(4))

            def forward(self, x):
                return self.inner(x * self.w).sum()
    """) + _GOOD_ENTRY, at="x.view(3, 5)", says=["forward", "RuntimeError", "shape '[3, 5]' is invalid",
                                                 "example inputs"]),
    BadFile("exception_after_unicode_on_the_line", dedent("""
        import torch
        import torch.nn as nn


        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.w = nn.Parameter(torch.ones(4))

            def forward(self, x):
                größe = "→"; ñ = (x * self.w).view(3, 5)
                return ñ.sum()
    """) + _GOOD_ENTRY, at="(x * self.w).view(3, 5)", says=["RuntimeError", "shape '[3, 5]' is invalid"]),
    BadFile("exception_inside_torch_points_at_the_users_call", dedent("""
        import torch
        import torch.nn as nn


        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(5, 2)

            def forward(self, x):
                h = x + 1
                return self.fc(h).sum()
    """) + _GOOD_ENTRY, at="self.fc(h)", says=["RuntimeError", "example inputs"]),
    BadFile("exception_in_build", dedent("""
        import torch


        def make(width):
            return torch.nn.Linear(2, width)


        def build():
            return make(-3)


        def example_inputs():
            return (torch.randn(1, 2),)
    """), at="torch.nn.Linear(2, width)", says=["build()", "RuntimeError"]),
    BadFile("import_error_at_top_level", dedent("""
        import torch
        import torch_does_not_exist_xyz


        def build():
            return torch.nn.Linear(2, 2)


        def example_inputs():
            return (torch.randn(1, 2),)
    """), at="import torch_does_not_exist_xyz", says=["import", "No module named 'torch_does_not_exist_xyz'"]),
    BadFile("output_neither_scalar_nor_loss", dedent("""
        import torch


        def build():
            return torch.nn.Linear(2, 3)


        def example_inputs():
            return (torch.randn(4, 2),)
    """), at=None, says=["not a scalar loss", "`.loss`", "def loss(output)"]),
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    """Every bad file, run once; in parallel, as each run is mostly imports."""
    workdirs = {}
    for spec in BAD_FILES:
        workdirs[spec.id] = tmp_path_factory.mktemp(spec.id)
        (workdirs[spec.id] / "model.py").write_text(spec.source, encoding="utf-8")
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        results = pool.map(lambda workdir: run_cli("inspect", "model.py", cwd=workdir), workdirs.values())
        return {spec_id: (workdir, result) for (spec_id, workdir), result in zip(workdirs.items(), results)}


@pytest.fixture(params=BAD_FILES, ids=lambda b: b.id)
def bad(request, runs) -> tuple[BadFile, Path, subprocess.CompletedProcess]:
    workdir, result = runs[request.param.id]
    return request.param, workdir, result


def expected_location(bad: BadFile, workdir: Path) -> str:
    if bad.at is None:
        return "model.py:1:1"
    line, col = position_of((workdir / "model.py").read_text(encoding="utf-8"), bad.at)
    return f"model.py:{line}:{col}"


@pytest.mark.slow
def test_a_bad_model_file_exits_2(bad):
    _, _, result = bad
    assert result.returncode == 2, result.stderr


@pytest.mark.slow
def test_the_error_points_at_the_place_to_fix_in_the_users_file(bad):
    spec, workdir, result = bad
    first_line = result.stderr.splitlines()[0]
    assert first_line.startswith(f"{expected_location(spec, workdir)}: error: "), result.stderr


@pytest.mark.slow
def test_the_error_says_what_went_wrong_and_what_to_do(bad):
    spec, _, result = bad
    flat = " ".join(result.stderr.split())
    missing = [words for words in spec.says if words not in flat]
    assert missing == [], result.stderr
    assert re.search(r"^\s+hint: \S", result.stderr, re.M), result.stderr


@pytest.mark.slow
def test_the_error_is_one_unwrapped_line_and_shows_no_traceback(bad):
    _, _, result = bad
    assert "Traceback" not in result.stderr
    assert len(result.stderr.splitlines()) == 2, result.stderr    # `error:` line + `hint:` line
    assert result.stdout == ""


# --verbose is one switch for every error; one case runs by default, the others with -m slow
@pytest.mark.parametrize("spec", [pytest.param(b, id=b.id, marks=[] if b.id == "exception_deep_in_forward"
                                               else [pytest.mark.slow]) for b in BAD_FILES])
@pytest.mark.slow
def test_verbose_shows_the_traceback_and_the_same_error(spec, tmp_path):
    (tmp_path / "model.py").write_text(spec.source, encoding="utf-8")
    result = run_cli("inspect", "model.py", "--verbose", cwd=tmp_path)
    assert result.returncode == 2
    assert "Traceback (most recent call last)" in result.stderr
    assert f"{expected_location(spec, tmp_path)}: error: " in result.stderr


# ---- the happy paths ---------------------------------------------------------------------------
@pytest.mark.slow
def test_a_good_model_file_exits_0_and_prints_its_sites(fixtures_dir, tmp_path):
    result = run_cli("inspect", str(fixtures_dir / "gpt.py"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "fixtures/gpt.py" in result.stdout and "100.0% mapped" in result.stdout


@pytest.mark.slow
def test_the_console_script_is_the_same_command(fixtures_dir, tmp_path):
    script = shutil.which("nnscaler-rewrite")
    assert script is not None, "the package's console script is installed"
    result = subprocess.run([script, "inspect", str(fixtures_dir / "mlp.py"), "--json"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=TIMEOUT_S)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["summary"]["compute_ops"] > 0


CLASS_ONLY = """
    import torch
    import torch.nn as nn


    class Regressor(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 1)

        def forward(self, x):
            return self.fc(x).pow(2).mean()


    def example_inputs():
        return (torch.randn(8, 4),)
"""


@pytest.fixture
def class_only(tmp_path) -> Path:
    (tmp_path / "regressor.py").write_text(dedent(CLASS_ONLY))
    return tmp_path


@pytest.mark.slow
def test_model_option_builds_the_named_class_when_there_is_no_build(class_only):
    result = run_cli("inspect", "regressor.py", "--model", "Regressor", "--json", cwd=class_only)
    assert result.returncode == 0, result.stderr
    sites = json.loads(result.stdout)["sites"]
    assert {"torch.nn.Linear", "Tensor.pow", "Tensor.mean"} <= {s["callee"] for s in sites}
    assert [s["module_path"] for s in sites if s["callee"] == "torch.nn.Linear"] == [""]


@pytest.mark.slow
def test_model_option_naming_something_that_is_not_a_module_class_is_an_error(class_only):
    result = run_cli("inspect", "regressor.py", "--model", "example_inputs", cwd=class_only)
    assert result.returncode == 2
    assert result.stderr.startswith("regressor.py:1:1: error: `example_inputs` is not an nn.Module class")
