"""The tool as users install it: a wheel that carries everything read at run time, and the
user's own rules folders.

The built-in rules are the repository's top-level rules/, shipped in the wheel as the data
package nnscaler_cst/rules (pyproject.toml); nnscaler_cst/rules_path.py finds them in either
place. The slow test builds the wheel, installs it (not editable) into a fresh virtual
environment and runs the main job from a folder outside the repository.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from setuptools import find_packages

from nnscaler_cst.plan.cost import load_cluster
from nnscaler_cst.plan.tables import available_plans, load_table
from nnscaler_cst.rules_path import ENV_VAR, builtin_rules_dir, rules_dirs

REPO = Path(__file__).resolve().parents[1]


def test_the_wheel_lists_every_package_and_the_rules_folders():
    """setuptools cannot map rules/ into a package it finds, so the packages are listed by hand:
    a subpackage added to nnscaler_cst/ and not to pyproject.toml would be missing from the wheel."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    kinds = sorted(p.name for p in (REPO / "rules").iterdir() if p.is_dir())
    assert kinds == ["devices", "ops", "plans"]
    expected = find_packages(str(REPO), include=["nnscaler_cst*"]) + \
        ["nnscaler_cst.rules"] + [f"nnscaler_cst.rules.{k}" for k in kinds]
    assert sorted(config["packages"]) == sorted(expected)
    assert config["package-dir"] == {"nnscaler_cst.rules": "rules"}
    for kind in kinds:
        assert config["package-data"][f"nnscaler_cst.rules.{kind}"] == ["*.toml"]
        assert {p.suffix for p in (REPO / "rules" / kind).iterdir() if p.is_file()} == {".toml"}


def test_in_a_checkout_the_built_in_rules_are_the_top_level_folder(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert builtin_rules_dir() == REPO / "rules"
    assert rules_dirs() == [REPO / "rules"]


def test_a_users_rules_folder_adds_plans_and_clusters_and_shadows_built_in_ones(tmp_path, monkeypatch):
    mine = tmp_path / "my_rules"
    (mine / "plans").mkdir(parents=True)
    (mine / "devices").mkdir()
    (mine / "plans" / "wide.toml").write_text(
        '[plan]\nname = "wide"\naxes = ["tp"]\n\n[[constraint]]\nid = "all-split"\n'
        'select = { params = "matrix" }\nop_trans = { axis = "tp", algo = "split", n = "|tp|" }\n')
    spec = (REPO / "rules" / "devices" / "cpu-gloo.toml").read_text()
    (mine / "devices" / "box.toml").write_text(re.sub(r"(?m)^flops = .*", "flops = 7e10", spec))
    (mine / "devices" / "cpu-gloo.toml").write_text(re.sub(r"(?m)^flops = .*", "flops = 1e10", spec))
    monkeypatch.setenv(ENV_VAR, str(mine))
    assert rules_dirs() == [mine, REPO / "rules"]
    assert load_table("wide").constraints[0].id == "all-split"
    assert "wide" in available_plans() and "megatron" in available_plans()
    assert load_cluster("box").flops == 7e10
    assert load_cluster("cpu-gloo").flops == 1e10        # the user's file of the same name wins
    assert load_cluster("a100-node").flops > 1e14       # built-in ones stay reachable


def test_pyproject_rules_folders_are_read_relative_to_the_pyproject(tmp_path, monkeypatch):
    from nnscaler_cst.config import project_defaults
    monkeypatch.delenv(ENV_VAR, raising=False)
    (tmp_path / "team_rules" / "devices").mkdir(parents=True)
    spec = (REPO / "rules" / "devices" / "cpu-gloo.toml").read_text()
    (tmp_path / "team_rules" / "devices" / "rack.toml").write_text(re.sub(r"(?m)^latency = .*", "latency = 1e-4", spec))
    (tmp_path / "pyproject.toml").write_text('[tool.nnscaler-rewrite]\nrules = ["team_rules"]\ntp = 2\n')
    (tmp_path / "models").mkdir()
    try:
        assert project_defaults(tmp_path / "models" / "model.py")["tp"] == 2
        assert rules_dirs() == [tmp_path / "team_rules", REPO / "rules"]
        assert load_cluster("rack").latency == 1e-4
    finally:
        project_defaults(REPO / "fixtures" / "mlp.py")      # back to no project folders
    assert rules_dirs() == [REPO / "rules"]


def _run(cmd: list[str], cwd: Path, timeout: int = 600, **env) -> subprocess.CompletedProcess:
    result = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                            env={**os.environ, **env})
    assert result.returncode == 0, f"{cmd}\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return result


@pytest.mark.slow
def test_the_wheel_installed_in_a_fresh_venv_runs_the_main_job_outside_the_repository(tmp_path):
    # build from a copy of what the sdist holds, so the shared checkout gets no build/ folder
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("nnscaler_cst", "rules"):
        shutil.copytree(REPO / name, src / name, ignore=ignore)
    # --no-isolation: the build backend (setuptools) installed here, no index needed
    _run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", tmp_path / "dist", src], cwd=src)
    wheel = next((tmp_path / "dist").glob("nnscaler_rewrite-*.whl"))

    # torch, libcst, z3 ... come from the system site; the tool only from the wheel
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--system-site-packages", venv], cwd=tmp_path)
    bin_dir = venv / "bin"
    _run([bin_dir / "python", "-m", "pip", "install", "--no-deps", "--ignore-installed", "--no-index",
          "--quiet", wheel], cwd=tmp_path)

    work = tmp_path / "work"         # a folder outside the repository, with just the model file
    work.mkdir()
    shutil.copy(REPO / "fixtures" / "mlp.py", work / "mlp.py")
    where = _run([bin_dir / "python", "-c", "import nnscaler_cst, nnscaler_cst.rules_path as r; "
                  "print(nnscaler_cst.__file__); print(r.builtin_rules_dir())"], cwd=work).stdout.split()
    site = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    assert where == [str(site / "nnscaler_cst" / "__init__.py"), str(site / "nnscaler_cst" / "rules")], where
    assert (site / "nnscaler_cst" / "rules" / "devices" / "cpu-gloo.toml").is_file()

    path = f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"
    for command in (["inspect", "mlp.py"], ["plan", "mlp.py", "--tp", "2", "--cluster", "a100-node"],
                    ["explain", "mlp.py", "--dp", "2"]):
        _run([bin_dir / "nnscaler-rewrite", *command], cwd=work, PATH=path)
    result = _run([bin_dir / "nnscaler-rewrite", "verify", "mlp.py", "--tp", "2", "-o", "parallel", "--steps", "2"],
                  cwd=work, PATH=path)
    assert "Traceback" not in result.stderr
    written = {p.name for p in (work / "parallel").iterdir()}
    assert {"_comm.py", "__init__.py", "train.py", "plan.json"} <= written, written
    assert any(name.startswith("model") and name.endswith(".py") for name in written), written


@pytest.mark.slow
def test_the_tool_runs_without_numpy(tmp_path):
    """numpy is not among the declared dependencies (torch does not require it either): plan,
    rewrite and the auto search must run with `import numpy` failing."""
    script = ("import sys; sys.modules['numpy'] = None\n"
              "from nnscaler_cst.cli import main\n"
              "main(sys.argv[1:])\n")
    for args in (["plan", str(REPO / "fixtures" / "mlp.py"), "--plan", "auto", "--devices", "4"],
                 [str(REPO / "fixtures" / "gpt.py"), "--tp", "2", "--dp", "2", "-o", str(tmp_path / "out")]):
        result = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-2000:]
        assert "Traceback" not in result.stderr
