"""The first hour of a new user (issue 27): one test per item, each the real command line in a
subprocess on small models written here, in a fresh folder.

1 an output folder never holds an input; 2 verify of a stale folder; 3 --check's hints;
4 an option that changes nothing; 5 warnings a user can act on; 6 tables at 80 columns and
--json on refusal; 7 progress on a terminal only; 8 the umask; 9 the command line's messages;
10 the README (length, links, its walk-through run as written); 11 the model's own error
before a fallback that would allocate its weights.
"""
from __future__ import annotations

import json
import os
import pty
import re
import resource
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 300

MLP = textwrap.dedent('''
    import torch
    import torch.nn as nn
    import torch.nn.functional as F


    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(32, 128)
            self.fc2 = nn.Linear(128, 16)

        def forward(self, x, y):
            return F.mse_loss(self.fc2(F.gelu(self.fc1(x))), y)


    def build():
        return MLP()


    def example_inputs():
        return (torch.randn(8, 32), torch.randn(8, 16))
''')

# A decoder whose RMSNorm is its own class (x.pow(2).mean(-1, keepdim=True)), batch 2
DECODER = textwrap.dedent('''
    import torch
    import torch.nn as nn
    import torch.nn.functional as F


    class RMSNorm(nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(dim))

        def forward(self, x):
            variance = x.pow(2).mean(-1, keepdim=True)
            return self.weight * (x * torch.rsqrt(variance + 1e-6))


    class Block(nn.Module):
        def __init__(self, dim, heads):
            super().__init__()
            self.heads = heads
            self.norm1 = RMSNorm(dim)
            self.qkv = nn.Linear(dim, 3 * dim, bias=False)
            self.proj = nn.Linear(dim, dim, bias=False)
            self.norm2 = RMSNorm(dim)
            self.up = nn.Linear(dim, 4 * dim, bias=False)
            self.down = nn.Linear(4 * dim, dim, bias=False)

        def forward(self, x):
            B, T, C = x.shape
            q, k, v = self.qkv(self.norm1(x)).split(C, dim=2)
            q = q.view(B, T, self.heads, C // self.heads).transpose(1, 2)
            k = k.view(B, T, self.heads, C // self.heads).transpose(1, 2)
            v = v.view(B, T, self.heads, C // self.heads).transpose(1, 2)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
            return x + self.down(F.silu(self.up(self.norm2(x))))


    class Decoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(64, 32)
            self.blocks = nn.ModuleList(Block(32, 4) for _ in range(2))
            self.norm = RMSNorm(32)
            self.head = nn.Linear(32, 64, bias=False)

        def forward(self, idx, targets):
            x = self.emb(idx)
            for block in self.blocks:
                x = block(x)
            logits = self.head(self.norm(x))
            return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


    def build():
        return Decoder()


    def example_inputs():
        return (torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8)))
''')


def env(**extra) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "CI")}
    e["PYTHONPATH"] = os.pathsep.join([str(REPO), *extra.pop("path", [])])
    return {**e, **extra}


def cli(args: list[str], cwd: Path, **kw) -> subprocess.CompletedProcess:
    extra = kw.pop("env", {})
    return subprocess.run([sys.executable, "-m", "nnscaler_cst", *args], cwd=cwd, env=env(**extra),
                          capture_output=True, text=True, timeout=TIMEOUT_S, **kw)


def project(tmp_path: Path, text: str = MLP, folder: str = "dot3") -> Path:
    (tmp_path / folder).mkdir()
    model = tmp_path / folder / "model.py"
    model.write_text(text)
    return model


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "error:" in line]


# 1 ------------------------------------------------------------------------------------------

@pytest.mark.slow     # over 5 s: keeps the quick subset under 3 minutes
def test_1_an_output_folder_holding_an_input_or_foreign_files_is_refused_with_or_without_force(tmp_path):
    model = project(tmp_path)
    (tmp_path / "dot3" / "helper.py").write_text("SCALE = 2\n")
    original = model.read_text()
    for out, force in (("dot3", []), (".", ["--force"]), (str(tmp_path / "dot3"), ["--force"])):
        run = cli(["dot3/model.py", "--tp", "2", "-o", out, *force], tmp_path)
        assert run.returncode == 2, run.stderr
        assert "Traceback" not in run.stderr
        [line] = error_lines(run.stderr)
        assert "dot3/model.py" in line and "input" in line, line
    assert model.read_text() == original and sorted(p.name for p in (tmp_path / "dot3").iterdir()) == \
        ["helper.py", "model.py"]
    # an import of the model lives in the folder: refused once the trace has read it
    model.write_text(original.replace("import torch\n", "import torch\nfrom helper import SCALE\n", 1))
    (tmp_path / "dot3" / "out").mkdir()
    run = cli(["dot3/model.py", "--tp", "2", "-o", "dot3"], tmp_path)
    assert run.returncode == 2 and "input of the rewrite" in run.stderr
    # a folder of the user's own files: refused, naming them
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "train.py").write_text("print('mine')\n")
    (tmp_path / "mine" / "notes").mkdir()
    (tmp_path / "mine" / "notes" / "a.txt").write_text("x\n")
    run = cli(["dot3/model.py", "--tp", "2", "-o", "mine", "--force"], tmp_path)
    assert run.returncode == 2
    [line] = error_lines(run.stderr)
    assert "did not write" in line and "train.py" in line and "notes/" in line
    assert (tmp_path / "mine" / "train.py").read_text() == "print('mine')\n"


def test_1_generated_files_in_folders_are_the_tools_by_its_record_and_the_users_files_stay(tmp_path):
    """A rewritten library class goes to a mirror of its source file (`timm/layers/x.py`): what
    the tool wrote is what .nnscaler/ records, at any depth; the user's files beside them stay."""
    from nnscaler_cst.emit.assemble import with_header
    from nnscaler_cst.emit.output import write_output
    from nnscaler_cst.errors import UserError
    out = tmp_path / "out"
    generation = {"model.py": with_header("x = 1\n", "m"), "timm/__init__.py": with_header("", "m"),
                  "timm/layers/attention.py": with_header("y = 2\n", "m")}
    write_output(out, generation)
    (out / "timm" / "NOTES.md").write_text("mine\n")
    write_output(out, {**generation, "timm/layers/attention.py": with_header("y = 3\n", "m")})
    assert (out / "timm" / "layers" / "attention.py").read_text().endswith("y = 3\n")
    assert (out / "timm" / "NOTES.md").read_text() == "mine\n"
    write_output(out, {"model.py": generation["model.py"]})          # no longer generated: removed
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if ".nnscaler" not in p.parts) == \
        ["model.py", "timm", "timm/NOTES.md"]
    theirs = tmp_path / "theirs"            # no record: nested files of someone else are named
    (theirs / "pkg").mkdir(parents=True)
    (theirs / "pkg" / "util.py").write_text("z = 0\n")
    with pytest.raises(UserError, match=r"did not write: pkg/"):
        write_output(theirs, generation)


# 2 ------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_2_verify_of_a_stale_folder_says_stale_and_how_to_regenerate_not_failed(tmp_path):
    project(tmp_path)
    assert cli(["dot3/model.py", "--dp", "2", "-o", "out"], tmp_path).returncode == 0
    model = tmp_path / "dot3" / "model.py"
    model.write_text(model.read_text().replace("F.mse_loss(", "2 * F.mse_loss("))
    run = cli(["verify", "dot3/model.py", "-o", "out"], tmp_path)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "FAILED" not in run.stdout and "is stale" in run.stderr
    assert "`nnscaler-rewrite dot3/model.py --dp 2 -o out`" in run.stderr


# 3 ------------------------------------------------------------------------------------------

@pytest.mark.slow     # over 10 s: keeps the quick subset under 3 minutes
def test_3_check_names_the_command_that_regenerates_a_missing_folder_and_markers_at_file_line(tmp_path):
    project(tmp_path)
    run = cli(["dot3/model.py", "--dp", "2", "-o", "out", "--check"], tmp_path)
    assert run.returncode == 1
    assert run.stdout == "" and run.stderr.strip().splitlines() == \
        ["out does not exist: write it with `nnscaler-rewrite dot3/model.py --dp 2 -o out`"]
    assert cli(["dot3/model.py", "--dp", "2", "-o", "out"], tmp_path).returncode == 0
    model = tmp_path / "dot3" / "model.py"
    model.write_text(model.read_text().replace("F.mse_loss(", "2 * F.mse_loss("))
    run = cli(["dot3/model.py", "--dp", "2", "-o", "out", "--check"], tmp_path)
    assert run.returncode == 1
    assert "regenerate it with `nnscaler-rewrite dot3/model.py --dp 2 -o out`" in run.stderr
    program = tmp_path / "out" / "model.py"
    lines = program.read_text().splitlines()
    program.write_text("\n".join(lines[:3] + ["<<<<<<< yours", "a = 1", "=======", "a = 2",
                                              ">>>>>>> generated"] + lines[3:]) + "\n")
    for args in (["--check"], []):
        run = cli(["dot3/model.py", "--dp", "2", "-o", "out", *args], tmp_path)
        assert run.returncode in (1, 2)
        assert re.search(r"out/model\.py:4[: ].*conflict markers", run.stderr), run.stderr


# 4 ------------------------------------------------------------------------------------------

def test_4_sequence_parallel_that_moves_no_norm_is_refused_saying_why(tmp_path):
    project(tmp_path, DECODER)
    run = cli(["dot3/model.py", "--tp", "2", "--sequence-parallel", "-o", "out"], tmp_path)
    assert run.returncode == 2, run.stderr
    [line] = error_lines(run.stderr)
    assert re.match(r".*sequence_parallel\.toml:\d+:\d+: error: --sequence-parallel moves no norm", line)
    assert "torch.nn.RMSNorm" in line and "RMSNorm computes the norm in ops of its own" in line
    assert not (tmp_path / "out").exists()


# 5 ------------------------------------------------------------------------------------------

@pytest.mark.slow     # over 5 s: keeps the quick subset under 3 minutes
def test_5_warnings_are_what_a_user_can_act_on_and_name_the_weight_and_its_sizes(tmp_path):
    project(tmp_path, DECODER)
    run = cli(["dot3/model.py", "--tp", "2", "--dp", "2", "-o", "out"], tmp_path)
    assert run.returncode == 0, run.stderr
    assert "warning" not in run.stderr          # a batch of one per rank is nothing to act on
    run = cli(["dot3/model.py", "--tp", "3", "-o", "out3"], tmp_path)
    assert run.returncode == 0, run.stderr
    weights = [line for line in run.stderr.splitlines() if "keeps its weights whole" in line]
    assert weights and all(re.search(r"\w+\.weight \(\d+ x \d+\)", line) for line in weights), weights
    assert any("blocks.0.up.weight (128 x 32)" in line for line in weights)
    assert not any("size 1 " in line or "size 2 " in line for line in weights)     # the batch: not a weight's


# 6 ------------------------------------------------------------------------------------------

LIBRARY = textwrap.dedent('''
    import torch.nn as nn
    import torch.nn.functional as F


    class FeedForwardWithAVeryDescriptiveName(nn.Module):
        def __init__(self):
            super().__init__()
            self.up_projection_layer = nn.Linear(32, 128)
            self.down_projection_layer = nn.Linear(128, 32)

        def forward(self, x):
            attended = F.scaled_dot_product_attention(x, x, x)
            return self.down_projection_layer(F.gelu(self.up_projection_layer(attended)))
''')


@pytest.mark.slow     # over 5 s: keeps the quick subset under 3 minutes
def test_6_tables_fit_80_columns_with_package_relative_sites_and_json_errors(tmp_path):
    site = tmp_path / "site"
    (site / "deeplib" / "layers").mkdir(parents=True)
    (site / "deeplib" / "__init__.py").write_text("")
    (site / "deeplib" / "layers" / "__init__.py").write_text("")
    (site / "deeplib" / "layers" / "feed_forward_blocks.py").write_text(LIBRARY)
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "model.py").write_text(textwrap.dedent('''
        import torch
        from deeplib.layers.feed_forward_blocks import FeedForwardWithAVeryDescriptiveName


        def build():
            return FeedForwardWithAVeryDescriptiveName()


        def example_inputs():
            return (torch.randn(2, 4, 8, 32),)


        def loss(output):
            return output.sum()
    '''))
    run = cli(["plan", "model.py", "--tp", "2", "--dp", "2"], tmp_path / "app",
              env={"COLUMNS": "80", "path": [str(site)]})
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert max(map(len, lines)) <= 80, "\n".join(lines)
    assert "deeplib/layers/feed_forward_blocks.py" in [line.strip() for line in lines]
    assert str(site) not in run.stdout
    rows = [line.split() for line in lines if re.match(r"\s*\d+:\d+\s", line)]
    # every row whole: the site's line, the callee's whole name, each column down to the last
    assert sorted(row[1] for row in rows) == ["F.gelu", "F.scaled_dot_product_attention", "Tensor.sum",
                                              "nn.Linear", "nn.Linear"]
    assert all(row[-1] == "batch" for row in rows), run.stdout
    run = cli(["inspect", "model.py"], tmp_path / "app", env={"COLUMNS": "80", "path": [str(site)]})
    assert run.returncode == 0 and max(map(len, run.stdout.splitlines())) <= 80, run.stdout
    assert "F.scaled_dot_product_attention" in run.stdout and str(site) not in run.stdout
    run = cli(["plan", "model.py", "--tp", "0", "--json"], tmp_path / "app", env={"path": [str(site)]})
    assert run.returncode == 2
    assert json.loads(run.stdout)["error"] == "--tp 0: must be at least 1"
    run = cli(["plan", "model.py", "--tq", "2", "--json"], tmp_path / "app", env={"path": [str(site)]})
    assert run.returncode == 2 and "--tq" in json.loads(run.stdout)["error"]


# 7 ------------------------------------------------------------------------------------------

def run_on_a_terminal(args: list[str], cwd: Path) -> str:
    """The command's output as a terminal shows it (a pty for stdin, stdout and stderr)."""
    pid, fd = pty.fork()
    if pid == 0:        # the child: the command on the pty
        os.chdir(cwd)
        os.environ.update(env(COLUMNS="100"))
        os.execv(sys.executable, [sys.executable, "-m", "nnscaler_cst", *args])
    chunks = []
    while True:
        try:
            data = os.read(fd, 4096)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    os.waitpid(pid, 0)
    return b"".join(chunks).decode(errors="replace")


@pytest.mark.slow     # over 5 s: keeps the quick subset under 3 minutes
def test_7_progress_shows_on_a_terminal_and_nothing_extra_when_piped(tmp_path):
    project(tmp_path)
    shown = run_on_a_terminal(["dot3/model.py", "--tp", "2", "-o", "out"], tmp_path)
    assert "tracing dot3/model.py" in shown and "writing out/" in shown, shown
    run = cli(["dot3/model.py", "--tp", "2", "-o", "out2"], tmp_path)
    assert run.returncode == 0 and run.stderr == ""
    assert run.stdout.splitlines() == [line for line in run.stdout.splitlines() if line.startswith("wrote out2/")]


# 8 ------------------------------------------------------------------------------------------

@pytest.mark.slow     # over 5 s: keeps the quick subset under 3 minutes
def test_8_output_folders_and_files_take_the_umask_also_on_regeneration(tmp_path):
    project(tmp_path)
    for _ in range(2):          # the first write, then a regeneration over the folder
        run = subprocess.run([sys.executable, "-m", "nnscaler_cst", "dot3/model.py", "--tp", "2", "-o", "out"],
                             cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=TIMEOUT_S,
                             preexec_fn=lambda: os.umask(0o022))
        assert run.returncode == 0, run.stderr
        out = tmp_path / "out"
        modes = {p.relative_to(tmp_path).as_posix(): stat.S_IMODE(p.stat().st_mode)
                 for p in [out, *out.rglob("*")]}
        assert all(mode == (0o755 if (tmp_path / name).is_dir() else 0o644) for name, mode in modes.items()), modes


# 9 ------------------------------------------------------------------------------------------

def test_9_the_command_line_says_what_it_means(tmp_path):
    from nnscaler_cst import __version__
    project(tmp_path)
    run = cli(["--version"], tmp_path)
    assert run.returncode == 0 and run.stdout == f"nnscaler-rewrite {__version__}\n"
    run = cli(["verfy", "dot3/model.py"], tmp_path)
    assert run.returncode == 2 and "did you mean `verify`" in run.stderr
    run = cli([], tmp_path)
    assert run.stdout.count("Usage:") == 1 and "nnscaler-rewrite model.py [options]" in run.stdout
    run = cli(["rewrite", "--help"], tmp_path)
    assert "<bool>" not in run.stdout and "[default: parallel]" in run.stdout
    assert re.search(r"--sequence-parallel\s+with --tp", run.stdout)
    (tmp_path / "dot3" / "pyproject.toml").write_text("[tool.nnscaler-rewrite]\ntp = 2\nmicro_batches = 4\n")
    run = cli(["dot3/model.py", "-o", "out"], tmp_path)
    assert run.returncode == 2
    assert error_lines(run.stderr) == ["dot3/pyproject.toml:3:1: error: unknown key `micro_batches` in "
                                       "[tool.nnscaler-rewrite]; did you mean `micro-batches`?"]


def test_9_every_flag_a_message_names_exists():
    """Hints name flags of the command line (or of the generated train.py and verify's workers)."""
    from click.testing import CliRunner  # noqa: F401 -- click comes with typer
    import typer
    from nnscaler_cst.cli import app
    command = typer.main.get_command(app)
    flags = {"--help", "--version"}
    for sub in command.commands.values():
        flags |= {opt for param in sub.params for opt in getattr(param, "opts", []) if opt.startswith("--")}
    sources = "\n".join(p.read_text() for p in (REPO / "nnscaler_cst").rglob("*.py"))
    flags |= set(re.findall(r"add_argument\(\"(--[a-z0-9-]+)\"", sources)) | {"--nproc-per-node"}
    named = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]+)", sources))
    assert named - flags == set()


def test_9_explain_shows_the_cost_with_and_without_each_constraint(tmp_path):
    project(tmp_path)
    run = cli(["explain", "dot3/model.py", "--tp", "2"], tmp_path, env={"COLUMNS": "200"})
    assert run.returncode == 0, run.stderr
    assert "cost with it (ms)" in run.stdout and "cost without it (ms)" in run.stdout


# 10 -----------------------------------------------------------------------------------------

def test_10_the_readme_is_short_and_every_relative_link_resolves():
    readme = REPO / "README.md"
    assert len(readme.read_text().splitlines()) <= 250
    pages = [readme, *sorted((REPO / "docs").glob("*.md"))]
    assert len(pages) > 3
    for page in pages:
        text = page.read_text()
        assert "shared/" not in text, page
        text = re.sub(r"```.*?```|`[^`\n]*`", "", text, flags=re.S)       # code is not links
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if "://" not in target:
                assert (page.parent / target).exists(), f"{page.name}: {target}"


def test_10_the_main_job_installs_only_what_the_tool_needs_and_ci_runs_the_readmes_test_command():
    text = (REPO / "README.md").read_text()
    commands = re.findall(r"```sh\n(python -m pip install .*?)\n```", text)
    main_job = next(c for c in commands if "nnscaler-rewrite verify fixtures/gpt.py --tp 2 -o parallel" in c)
    assert "[test]" not in main_job
    test_job = next(c for c in commands if "pytest" in c)
    assert test_job in (REPO / ".ci" / "run").read_text()


@pytest.mark.slow
def test_10_the_readmes_walk_through_runs_as_written(tmp_path):
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Walk-through"):text.index("\n## ", text.index("## Walk-through") + 3)]
    blocks = re.findall(r"```(\w+)\n(.*?)```", section, re.S)
    [model] = [body for kind, body in blocks if kind == "python"]
    assert model.startswith("# model.py\n")
    (tmp_path / "model.py").write_text(model)
    script = "set -e\n" + "".join(body for kind, body in blocks if kind == "sh")
    for word in ("inspect", "plan", "--diff", "verify", "torchrun"):
        assert word in script
    bin_dir = Path(sys.executable).parent     # nnscaler-rewrite and torchrun of this interpreter
    run = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                         env=env(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}"))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "PASSED" in run.stdout and "verified parallel/" in run.stdout
    assert re.search(r"step 1 loss \d", run.stdout)


# 11 -----------------------------------------------------------------------------------------

BIG = textwrap.dedent('''
    import torch
    import torch.nn as nn


    class Config:
        vocab = 1_200_000


    class Big(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.config = config
            self.emb = nn.Embedding(config.vocab, 1024)

        def forward(self, idx):
            start = self.config.decoder_start_token_id
            return self.emb(idx + start).sum()


    def build():
        return Big(Config())


    def example_inputs():
        return (torch.zeros(2, 4, dtype=torch.long),)
''')


def test_11_the_models_own_error_is_reported_not_an_allocation_of_its_weights(tmp_path):
    project(tmp_path, BIG)       # 4.6 GiB of weights: past the bound, and past this process's memory

    def limit_memory():
        resource.setrlimit(resource.RLIMIT_AS, (3 * 2**30, 3 * 2**30))

    run = subprocess.run([sys.executable, "-m", "nnscaler_cst", "inspect", "dot3/model.py"], cwd=tmp_path,
                         env=env(), capture_output=True, text=True, timeout=TIMEOUT_S, preexec_fn=limit_memory)
    assert run.returncode == 2, run.stderr
    [line] = error_lines(run.stderr)
    assert "AttributeError" in line and "decoder_start_token_id" in line and "GiB" in line
    assert "allocate memory" not in run.stderr
