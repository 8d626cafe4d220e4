"""The pre-commit hook `nnscaler-rewrite-check` (.pre-commit-hooks.yaml), run for real:
`pre-commit try-repo` installs this repository into a hook environment of its own and runs the
hook in a user's git repository whose pyproject.toml names the model file, the options and the
output folder. It passes when the committed output is current and fails with the diff when the
model changed.

The hook environment is made with the test environment's packages visible
(VIRTUALENV_SYSTEM_SITE_PACKAGES) and torch pinned to this machine's (PIP_CONSTRAINT), so pip
installs only nnscaler-rewrite itself and never fetches a CUDA build of torch. try-repo takes
this checkout's committed files plus its changes to tracked files (not untracked ones).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 900
PYPROJECT = textwrap.dedent("""
    [tool.nnscaler-rewrite]
    model-file = "model.py"
    tp = 2
    out = "parallel"
""")


def git(*args, cwd: Path, env: dict) -> None:
    subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def user_repo(tmp_path_factory):
    """A user's repository: model.py, pyproject.toml, and the committed output of the rewrite."""
    root = tmp_path_factory.mktemp("hook")
    repo = root / "user"
    repo.mkdir()
    (root / "constraints.txt").write_text("torch==2.13.0\n")
    env = {**os.environ, "PRE_COMMIT_HOME": str(root / "pre-commit-home"),
           "VIRTUALENV_SYSTEM_SITE_PACKAGES": "1", "PIP_CONSTRAINT": str(root / "constraints.txt"),
           "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.com", "PYTHONWARNINGS": "ignore"}
    shutil.copy(REPO / "fixtures" / "gpt.py", repo / "model.py")
    (repo / "pyproject.toml").write_text(PYPROJECT)
    git("init", "-q", cwd=repo, env=env)
    result = subprocess.run([sys.executable, "-m", "nnscaler_cst", "model.py"], cwd=repo, env=env,
                            capture_output=True, text=True, timeout=TIMEOUT_S)
    assert result.returncode == 0, result.stdout + result.stderr
    git("add", "-A", cwd=repo, env=env)
    git("commit", "-qm", "model and its parallel output", cwd=repo, env=env)
    return repo, env


def try_repo(repo: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pre_commit", "try-repo", str(REPO), "nnscaler-rewrite-check",
                           "--all-files", "--verbose"], cwd=repo, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)


@pytest.mark.slow
def test_the_hook_passes_when_the_committed_output_is_current(user_repo):
    repo, env = user_repo
    result = try_repo(repo, env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Passed" in result.stdout and "parallel is up to date" in result.stdout


@pytest.mark.slow
def test_the_hook_fails_with_the_diff_when_the_model_changed(user_repo):
    repo, env = user_repo
    model = repo / "model.py"
    model.write_text(model.read_text().replace("4 * config.n_embd", "2 * config.n_embd"))
    git("add", "model.py", cwd=repo, env=env)
    result = try_repo(repo, env)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Failed" in result.stdout and "parallel is stale" in result.stdout
    assert "+        self.c_fc = nn.Linear(config.n_embd, 2 * config.n_embd // 2, bias=config.bias)" in result.stdout
