"""Spec of hand edits to the output (README "Hand edits", DESIGN "Output contract: Editable")
and of the fast `--check`.

The three-way merge on golden strings; what a regeneration does with every kind of file it
finds (synthetic folders, no tracing); the check cache's answers; then the real command line
on a user project: edits survive a model change and `--check` accepts them, a conflicting
edit exits 1 with markers, and a current output is checked without importing torch.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from nnscaler_cst.checkcache import effective_options, is_current, record
from nnscaler_cst.emit.assemble import with_header
from nnscaler_cst.emit.merge import conflict_marker_lines, has_unresolved_conflict, merge3
from nnscaler_cst.emit.output import staleness, write_output
from nnscaler_cst.emit.pristine import CHECK_CACHE, PRISTINE_DIR
from nnscaler_cst.errors import UserError

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 300


def dedent(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


# --------------------------------------------------------------------------------------------
# The three-way merge
# --------------------------------------------------------------------------------------------

BASE = dedent("""
    class MLP(nn.Module):
        def forward(self, x):
            x = self.c_fc(x)
            x = self.gelu(x)
            x = self.c_proj(x)
            return x
""")


def test_edits_on_both_sides_in_different_places_merge_cleanly():
    yours = BASE.replace("x = self.gelu(x)", "x = self.gelu(x)  # tuned by hand")
    generated = BASE.replace("        return x\n", "        x = self.c_out(x)\n        return x\n")
    merged = merge3(BASE, yours, generated)
    assert merged.conflicts == 0 and merged.kept_edits == 1
    assert merged.text == dedent("""
        class MLP(nn.Module):
            def forward(self, x):
                x = self.c_fc(x)
                x = self.gelu(x)  # tuned by hand
                x = self.c_proj(x)
                x = self.c_out(x)
                return x
    """)


def test_edits_to_the_same_lines_conflict_with_all_three_versions_between_markers():
    yours = BASE.replace("x = self.c_proj(x)", "x = self.c_proj(x) * 0.5")
    generated = BASE.replace("x = self.c_proj(x)", "x = tp_reduce(self.c_proj(x), TP)")
    merged = merge3(BASE, yours, generated)
    assert merged.conflicts == 1 and merged.conflict_lines == [5]
    assert merged.text == dedent("""
        class MLP(nn.Module):
            def forward(self, x):
                x = self.c_fc(x)
                x = self.gelu(x)
        <<<<<<< yours
                x = self.c_proj(x) * 0.5
        ||||||| last generation
                x = self.c_proj(x)
        =======
                x = tp_reduce(self.c_proj(x), TP)
        >>>>>>> generated
                return x
    """)


@pytest.mark.parametrize("yours, generated", [
    (BASE, BASE.replace("c_fc", "c_in")),                                  # no edit: the new generation
    (BASE.replace("gelu", "relu"), BASE),                                  # no new generation: the edit
    (BASE.replace("gelu", "relu"), BASE.replace("gelu", "relu")),          # the same change on both sides
])
def test_a_side_that_did_not_change_takes_the_other(yours, generated):
    merged = merge3(BASE, yours, generated)
    assert merged.conflicts == 0
    assert merged.text == (generated if yours == BASE else yours)


def test_lines_the_user_deleted_stay_deleted_and_added_lines_at_the_end_are_kept():
    yours = BASE.replace("        x = self.gelu(x)\n", "") + "# reviewed\n"
    generated = BASE.replace("class MLP(nn.Module)", "class MLP(torch.nn.Module)")
    merged = merge3(BASE, yours, generated)
    assert merged.conflicts == 0 and merged.kept_edits == 2
    assert merged.text == generated.replace("        x = self.gelu(x)\n", "") + "# reviewed\n"


def test_a_conflict_on_a_last_line_without_newline_keeps_the_markers_on_lines_of_their_own():
    merged = merge3("a\nb", "a\nB", "a\nbb")
    assert merged.text == "a\n<<<<<<< yours\nB\n||||||| last generation\nb\n=======\nbb\n>>>>>>> generated\n"


def test_markers_left_in_a_file_are_found_and_markers_in_the_base_do_not_count():
    merged = merge3(BASE, BASE.replace("gelu", "relu"), BASE.replace("gelu", "silu")).text
    assert conflict_marker_lines(merged) == [4, 6, 8, 10]
    assert has_unresolved_conflict(merged, BASE)
    assert not has_unresolved_conflict(BASE.replace("gelu", "relu"), BASE)


# --------------------------------------------------------------------------------------------
# Regenerating over a folder: every kind of file
# --------------------------------------------------------------------------------------------

def generation(version: str = "1", *, extra: dict[str, str] | None = None) -> dict[str, str]:
    body = BASE if version == "1" else BASE.replace("        return x\n", "        x = self.c_out(x)\n        return x\n")
    files = {"model.py": with_header(body, f"from m.py; v{version}"),
             "train.py": with_header("import model\n", "from m.py")}
    return {**files, **(extra or {})}


def listing(folder: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(folder.iterdir()) if p.is_file()}


def test_a_first_write_keeps_the_generation_as_its_pristine_copy(tmp_path):
    out = tmp_path / "out"
    write_output(out, generation())
    assert listing(out) == generation() == listing(out / PRISTINE_DIR)


def test_a_clean_hand_edit_survives_a_new_generation_and_is_reported(tmp_path):
    out = tmp_path / "out"
    write_output(out, generation("1"))
    edited = (out / "model.py").read_text().replace("x = self.gelu(x)", "x = self.gelu(x)  # mine")
    (out / "model.py").write_text(edited)
    result = write_output(out, generation("2"))
    text = (out / "model.py").read_text()
    assert "x = self.gelu(x)  # mine" in text and "x = self.c_out(x)" in text
    assert [(o.name, o.action, o.kept_edits) for o in result.outcomes if o.name == "model.py"] == \
        [("model.py", "merged", 1)]
    assert listing(out / PRISTINE_DIR) == generation("2")       # the base of the next merge
    assert not staleness(out, generation("2"))                  # clean edits are not staleness


def test_a_generated_file_the_user_deleted_is_written_again(tmp_path):
    out = tmp_path / "out"
    write_output(out, generation())
    (out / "train.py").unlink()
    result = write_output(out, generation())
    assert listing(out) == generation()
    assert ("train.py", "restored") in [(o.name, o.action) for o in result.outcomes]


def test_a_file_no_longer_generated_is_removed_unedited_and_set_aside_edited(tmp_path):
    out = tmp_path / "out"
    write_output(out, generation(extra={"old.py": "# @generated\nx = 1\n", "older.py": "y = 2\n"}))
    (out / "older.py").write_text("y = 3  # mine\n")
    result = write_output(out, generation())
    assert set(listing(out)) == {"model.py", "train.py", "older.py.edited"}
    assert (out / "older.py.edited").read_text() == "y = 3  # mine\n"
    assert [(o.name, o.set_aside_as) for o in result.conflicts] == [("older.py", "older.py.edited")]


def test_a_file_still_holding_conflict_markers_blocks_the_rewrite_and_nothing_is_written(tmp_path):
    out = tmp_path / "out"
    write_output(out, generation())
    (out / "model.py").write_text((out / "model.py").read_text().replace("gelu", "relu"))
    assert write_output(out, generation("2")).outcomes       # written: no conflict yet
    model = out / "model.py"
    model.write_text(model.read_text() + "<<<<<<< yours\nz = 1\n=======\nz = 2\n>>>>>>> generated\n")
    before = listing(out)
    with pytest.raises(UserError, match="conflict markers"):
        write_output(out, generation("1"))
    assert listing(out) == before
    assert staleness(out, generation("2")).problems


def test_force_writes_the_new_generation_and_keeps_each_edited_file_as_edited(tmp_path):
    out = tmp_path / "out"
    write_output(out, generation())
    (out / "model.py").write_text((out / "model.py").read_text() + "# mine\n")
    edited = (out / "model.py").read_text()
    write_output(out, generation("2"), force=True)
    assert listing(out) == {**generation("2"), "model.py.edited": edited}


def test_files_the_user_added_to_a_folder_with_pristine_copies_stay(tmp_path):
    out = tmp_path / "out"
    write_output(out, generation())
    (out / "NOTES.md").write_text("reviewed\n")
    (out / "weights.pt").write_bytes(bytes(range(256)))            # not text: copied byte for byte
    (out / "helpers").mkdir()
    (out / "helpers" / "util.py").write_text("z = 0\n")
    write_output(out, generation("2"))
    assert (out / "NOTES.md").read_text() == "reviewed\n"
    assert (out / "weights.pt").read_bytes() == bytes(range(256))
    assert (out / "helpers" / "util.py").read_text() == "z = 0\n"


def test_a_folder_written_before_pristine_copies_merges_unedited_files_and_refuses_edited_ones(tmp_path):
    out = tmp_path / "out"
    write_output(out, generation())
    shutil.rmtree(out / ".nnscaler")
    write_output(out, generation("2"))                      # unedited: each file is its own base
    assert listing(out) == generation("2")
    shutil.rmtree(out / ".nnscaler")
    (out / "model.py").write_text((out / "model.py").read_text() + "# mine\n")
    with pytest.raises(UserError, match="no base to merge against"):
        write_output(out, generation("1"))


def test_a_folder_of_someone_elses_files_is_refused(tmp_path):
    out = tmp_path / "src"
    out.mkdir()
    (out / "app.py").write_text("print('hello')\n")
    with pytest.raises(UserError, match="did not write"):
        write_output(out, generation())


# --------------------------------------------------------------------------------------------
# The check cache
# --------------------------------------------------------------------------------------------

@pytest.fixture
def cached_output(tmp_path, monkeypatch):
    """A model file, and its output written with a cache saying it read the model file."""
    monkeypatch.chdir(tmp_path)
    model = tmp_path / "m.py"
    model.write_text("import torch\n")
    out = tmp_path / "out"
    options = effective_options({"tp": 2, "out": out}, {"dp": 1})
    cache = record(model, options, {str(model)}, generation(), out)
    write_output(out, generation(), check_cache=cache)
    return model, options, out


def test_the_cache_answers_current_when_nothing_changed(cached_output):
    model, options, out = cached_output
    assert is_current(model, options, out)
    assert (out / CHECK_CACHE).is_file()


def test_a_clean_hand_edit_is_still_current(cached_output):
    model, options, out = cached_output
    (out / "model.py").write_text((out / "model.py").read_text() + "# mine\n")
    assert is_current(model, options, out)


@pytest.mark.parametrize("change", ["model", "options", "pristine", "deleted", "markers", "environment"])
def test_the_cache_does_not_answer_when_an_input_or_the_output_changed(cached_output, monkeypatch, change):
    model, options, out = cached_output
    if change == "model":
        model.write_text("import torch  # changed\n")
    elif change == "options":
        options = {**options, "tp": "4"}
    elif change == "pristine":
        (out / PRISTINE_DIR / "model.py").write_text("tampered\n")
    elif change == "deleted":
        (out / "train.py").unlink()
    elif change == "markers":
        (out / "model.py").write_text("<<<<<<< yours\na\n=======\nb\n>>>>>>> generated\n")
    elif change == "environment":
        monkeypatch.setenv("NNSCALER_RULES_PATH", "/elsewhere")
    assert not is_current(model, options, out)


def test_a_local_module_imported_from_its_bytecode_is_watched_by_its_source(cached_output):
    model, options, out = cached_output
    source = model.parent / "sizes_cfg.py"
    source.write_text("LAYERS = 4\n")
    bytecode = Path(importlib.util.cache_from_source(str(source)))     # what an import opens when cached
    bytecode.parent.mkdir(exist_ok=True)
    bytecode.write_bytes(b"")
    write_output(out, generation(), check_cache=record(model, options, {str(model), str(bytecode)},
                                                       generation(), out))
    assert is_current(model, options, out)
    source.write_text("LAYERS = 5\n")
    assert not is_current(model, options, out)


def test_options_are_the_same_whether_given_on_the_command_line_or_in_pyproject():
    assert effective_options({"tp": 2, "dp": None, "out": "a"}, {}) == effective_options({}, {"tp": 2, "out": "b"})


# --------------------------------------------------------------------------------------------
# The command line on a user project
# --------------------------------------------------------------------------------------------

def run(*args, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200", "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, *map(str, args)], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)


def rewrite(*args, cwd: Path) -> subprocess.CompletedProcess:
    return run("-m", "nnscaler_cst", "model.py", "--tp", 2, "-o", "parallel", *args, cwd=cwd)


def ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result


def program_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob("model*.py"))


# The user's edits to every program file: a comment, and an expression changed to an equal one.
USER_EDITS = [("        att = F.softmax(att, dim=-1)\n", "        att = F.softmax(att, dim=-1)  # checked by hand\n"),
              ("(1.0 / math.sqrt(k.size(-1)))", "k.size(-1) ** -0.5")]
# The model change: a new layer at the end of the MLP, and one more block.
MODEL_CHANGE = [("        self.dropout = nn.Dropout(config.dropout)\n\n    def forward(self, x):\n        x = self.c_fc(x)",
                 "        self.dropout = nn.Dropout(config.dropout)\n"
                 "        self.c_out = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)\n\n"
                 "    def forward(self, x):\n        x = self.c_fc(x)"),
                ("        x = self.dropout(x)\n        return x\n", "        x = self.dropout(x)\n        x = self.c_out(x)\n"
                 "        return x\n"),
                ("n_layer: int = 4", "n_layer: int = 5")]


def edit(path: Path, replacements) -> None:
    text = path.read_text()
    for old, new in replacements:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    path.write_text(text)


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """A user project: the GPT fixture as model.py and its output in parallel/."""
    root = tmp_path_factory.mktemp("project")
    shutil.copy(REPO / "fixtures" / "gpt.py", root / "model.py")
    ok(rewrite(cwd=root))
    return root


@pytest.fixture
def copy(project, tmp_path) -> Path:
    return Path(shutil.copytree(project, tmp_path / "project"))


@pytest.fixture(scope="module")
def edited_then_regenerated(project, tmp_path_factory):
    """Edit the program files, change the model, --check, regenerate, --check again."""
    root = Path(shutil.copytree(project, tmp_path_factory.mktemp("edited") / "project"))
    for path in program_files(root / "parallel"):
        edit(path, USER_EDITS)
    current_with_edits = rewrite("--check", cwd=root)
    edit(root / "model.py", MODEL_CHANGE)
    stale = rewrite("--check", cwd=root)
    regenerated = rewrite(cwd=root)
    check = rewrite("--check", cwd=root)
    return root, current_with_edits, stale, regenerated, check


@pytest.mark.slow
def test_hand_edits_alone_do_not_make_the_output_stale(edited_then_regenerated):
    _, current_with_edits, _, _, _ = edited_then_regenerated
    assert ok(current_with_edits).stdout.strip() == "parallel is up to date"


@pytest.mark.slow
def test_a_model_change_makes_the_edited_output_stale(edited_then_regenerated):
    _, _, stale, _, _ = edited_then_regenerated
    assert stale.returncode == 1, stale.stdout + stale.stderr
    assert "+        self.c_out = nn.Linear(" in stale.stdout and "stale" in stale.stderr


@pytest.mark.slow
def test_hand_edits_survive_regeneration_after_a_model_change(edited_then_regenerated):
    root, _, _, regenerated, check = edited_then_regenerated
    ok(regenerated)
    programs = program_files(root / "parallel")
    assert programs
    for path in programs:
        text = path.read_text()
        assert "att = F.softmax(att, dim=-1)  # checked by hand" in text and "k.size(-1) ** -0.5" in text
        assert "self.c_out = nn.Linear(" in text and "n_layer: int = 5" in text
        assert f"kept 2 hand edits in parallel/{path.name}" in regenerated.stdout
    assert ok(check).stdout.strip() == "parallel is up to date"


@pytest.mark.slow
def test_the_regenerated_output_with_hand_edits_verifies(edited_then_regenerated):
    root, *_ = edited_then_regenerated
    ok(run("-m", "nnscaler_cst", "verify", "model.py", "-o", "parallel", "--steps", 2, cwd=root))


@pytest.mark.slow
def test_a_conflicting_edit_exits_1_with_markers_and_the_users_text(copy):
    # the line right above where the model change adds a layer: whatever the plan, both sides
    # change the same region
    for path in program_files(copy / "parallel"):
        edit(path, [("        x = self.dropout(x)\n", "        x = self.dropout(x) * 1.0  # mine\n")])
    edit(copy / "model.py", MODEL_CHANGE)
    result = rewrite(cwd=copy)
    assert result.returncode == 1, result.stdout + result.stderr
    for path in program_files(copy / "parallel"):
        text = path.read_text()
        # the user's line in their side of the conflict (which lines around it the region takes
        # is the plan's: a scatter may move onto the line above)
        yours = text.partition("<<<<<<< yours\n")[2].partition("|||||||")[0]
        assert "        x = self.dropout(x) * 1.0  # mine\n" in yours
        assert ">>>>>>> generated\n" in text
        assert f"parallel/{path.name}:" in result.stderr and "conflict" in result.stderr
    assert rewrite("--check", cwd=copy).returncode == 1       # unresolved: not current


@pytest.mark.slow
def test_a_current_output_is_checked_from_the_cache_without_importing_torch_libcst_or_typer(copy):
    """Given on the command line, or (no model file) taken from pyproject: the same options."""
    ok(rewrite(cwd=copy))         # the cache names the tool's own files: others may edit them meanwhile
    explicit = ok(run("-X", "importtime", "-m", "nnscaler_cst", "model.py", "--tp", 2, "-o", "parallel", "--check",
                      cwd=copy))
    (copy / "pyproject.toml").write_text('[tool.nnscaler-rewrite]\nmodel-file = "model.py"\ntp = 2\n'
                                         'out = "parallel"\n')
    from_pyproject = ok(run("-X", "importtime", "-m", "nnscaler_cst", "--check", cwd=copy))
    for result in (explicit, from_pyproject):
        assert result.stdout.strip() == "parallel is up to date"
        assert heavy_imports(result) == set()


def heavy_imports(result: subprocess.CompletedProcess) -> set[str]:
    """Top-level packages among torch, LibCST, z3, typer and rich that a run (-X importtime) imported."""
    imported = {line.split("|")[-1].strip().split(".")[0] for line in result.stderr.splitlines() if "|" in line}
    assert "nnscaler_cst" in imported
    return imported & {"torch", "libcst", "typer", "rich", "z3"}
