"""Bad input, everywhere: one table over every input the tool takes.

Command-line options and their combinations, paths, entry files, plan and schedule tables,
device specs and op rules (in a user's rules folder), source annotations and
`[tool.nnscaler-rewrite]` values. Each case runs the CLI in this process (`nnscaler_cst.cli.main`,
in a temporary folder holding the case's files) and asserts the error contract of the design
card: the first stderr line is `path:line:col: error:` at the place to fix (or starts with
`error:` for an option), a hint follows, the exit code is 2, there is no traceback, and nothing
was written (no output folder; the case's folder holds just what it held before).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from test_entry_errors import BAD_FILES, dedent, position_of

from nnscaler_cst import cli
from nnscaler_cst.rules_path import ENV_VAR, builtin_rules_dir

MODEL = dedent("""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F


    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(64, 256)
            self.fc2 = nn.Linear(256, 64)

        def forward(self, x, y):
            h = F.gelu(self.fc1(x))
            return F.mse_loss(self.fc2(h), y)


    def build():
        return MLP()


    def example_inputs():
        return (torch.randn(8, 64), torch.randn(8, 64))
""")

# a model with a loop over blocks, for the pipeline options
BLOCKS = dedent("""
    import torch
    import torch.nn as nn


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(16, 16) for _ in range(4)])

        def forward(self, x):
            for block in self.blocks:
                x = torch.relu(block(x))
            return x.pow(2).mean()


    def build():
        return Net()


    def example_inputs():
        return (torch.randn(8, 16),)
""")

GOOD_ENTRY = dedent("""


    def build():
        return Net()


    def example_inputs():
        return (torch.randn(8, 16),)
""")

GOOD_PLAN = dedent("""
    [plan]
    name = "mine"
    axes = ["tp"]

    [[constraint]]
    id = "split-matrices"
    select = { params = "matrix" }
    op_trans = { axis = "tp", algo = "split", n = "|tp|" }
""")

GOOD_SCHEDULE = dedent("""
    [schedule]
    name = "mine"
    virtual_stages = 1
    warmup = "D - i - 1"
    order = ["F[k] < F[k+1]", "B[k] < B[k+1]", "F[k] < B[k]"]
""")

GOOD_DEVICE = (builtin_rules_dir() / "devices" / "cpu-gloo.toml").read_text()


@dataclass
class Case:
    id: str
    args: list[str]                  # the command line (after `nnscaler-rewrite`)
    says: list[str]                  # words the message and hint must hold (whitespace-normalised)
    at: tuple[str, str | int] | None = None   # (file, text at the place, or a line); None: `error:`
    files: dict[str, str] = field(default_factory=lambda: {"model.py": MODEL})
    env: dict[str, str] = field(default_factory=dict)   # {ENV_VAR: "my_rules"}: paths below the case's folder


def case(id, args, says, at=None, files=None, env=None, extra=None):
    files = dict(files if files is not None else {"model.py": MODEL}, **(extra or {}))
    return Case(id, args.split() if isinstance(args, str) else args, says, at, files, env or {})


def device_line(key: str, new: str) -> str:
    """The built-in device spec with the line setting `key` replaced by `new` ("": removed)."""
    text, found = re.subn(rf"^{re.escape(key)} = .*\n", new and new + "\n", GOOD_DEVICE, flags=re.M)
    assert found == 1, key
    return text


def replace(text: str, old: str, new: str) -> str:
    assert old in text, old
    return text.replace(old, new)


OUT = "-o out"
CASES = [
    # ---- command-line options ---------------------------------------------------------------
    case("tp_zero", f"model.py --tp 0 {OUT}", ["--tp 0", "at least 1"]),
    case("dp_zero", f"model.py --dp 0 {OUT}", ["--dp 0", "at least 1"]),
    case("tp_negative", f"model.py --tp -2 {OUT}", ["--tp -2", "at least 1"]),
    case("pp_zero", f"model.py --pp 0 {OUT}", ["--pp 0", "at least 1"]),
    case("devices_zero", f"model.py --plan auto --devices 0 {OUT}", ["--devices 0", "at least 1"]),
    case("tp_not_a_number", f"model.py --tp two {OUT}", ["--tp", "integer", "--help"]),
    case("tp_without_value", "model.py -o out --tp", ["--tp", "requires an argument", "--help"]),
    case("unknown_option", f"model.py --tensor-parallel 2 {OUT}", ["No such option", "--tensor-parallel"]),
    case("options_before_the_file", f"--tp 0 model.py {OUT}", ["--tp 0", "at least 1"]),
    case("memory_budget_not_a_size", f"model.py --tp 2 --memory-budget lots {OUT}",
         ["--memory-budget", "'lots' is not a size", "24GiB"]),
    case("memory_budget_zero", f"model.py --tp 2 --memory-budget 0GiB {OUT}", ["--memory-budget", "not a positive"]),
    case("memory_budget_unknown_unit", f"model.py --tp 2 --memory-budget 24GX {OUT}", ["'24GX' is not a size"]),
    case("unknown_plan", f"model.py --tp 2 --plan megatrom {OUT}", ["unknown plan 'megatrom'", "megatron"]),
    case("unknown_schedule", f"model.py --pp 2 --schedule 2f2b {OUT}", ["unknown schedule '2f2b'", "1f1b"]),
    case("unknown_cluster", f"model.py --tp 2 --cluster a100 {OUT}", ["unknown cluster 'a100'", "a100-node"]),
    case("plan_dp_with_tp", f"model.py --plan dp --tp 2 {OUT}", ["--plan dp", "--tp", "--plan megatron"]),
    case("plan_auto_without_devices", f"model.py --plan auto {OUT}", ["--plan auto needs --devices"]),
    case("devices_with_a_fixed_plan", f"model.py --devices 4 --tp 2 {OUT}", ["--devices is for --plan auto"]),
    case("devices_with_plan_megatron", f"model.py --devices 4 --plan megatron {OUT}",
         ["--devices is for --plan auto", "--plan megatron"]),
    case("megatron_without_tp", f"model.py --plan megatron {OUT}", ["--plan megatron needs --tp"]),
    case("stages_not_numbers", f"model.py --pp 2 --stages a,b {OUT}", ["--stages a,b", "block indices"]),
    case("stages_decreasing", f"model.py --pp 3 --stages 3,1 {OUT}", ["--stages 3,1", "increasing"]),
    case("stages_without_pp", f"model.py --stages 2 {OUT}", ["--stages needs --pp"]),
    # without a pipeline --micro-batches is gradient accumulation: it must divide each rank's batch
    case("accumulation_not_dividing_the_batch", f"model.py --dp 2 --micro-batches 3 {OUT}",
         ["batch of 4 per data-parallel rank", "3 micro-batches"], at=("model.py", "def example_inputs")),
    case("micro_batches_zero", f"model.py --pp 2 --micro-batches 0 {OUT}", ["--micro-batches 0", "at least 1"]),
    case("diff_of_a_rank_that_does_not_exist", "model.py --tp 2 --diff 7", ["no rank 7", "world of 2"]),
    case("diff_negative_rank", "model.py --tp 2 --diff -1", ["--diff -1", "ranks start at 0"]),
    case("diff_with_check", "model.py --tp 2 --diff 0 --check", ["--diff and --check"]),
    case("schedule_command_pp_zero", "schedule model.py --pp 0", ["--pp 0", "at least 1"]),
    case("plan_command_unknown_cluster", "plan model.py --tp 2 --cluster tpu", ["unknown cluster 'tpu'"]),
    case("verify_with_tp_zero", f"verify model.py --tp 0 {OUT}", ["--tp 0", "at least 1"]),
    case("verify_steps_zero", f"verify model.py --tp 2 --steps 0 {OUT}", ["--steps 0", "at least 1"]),
    case("verify_negative_timeout", f"verify model.py --tp 2 --timeout -5 {OUT}", ["--timeout -5", "positive"]),
    case("inspect_bad_trace_mode", "inspect model.py --trace-mode symbolic", ["--trace-mode", "auto | fake | real"]),
    # ---- sizes that do not divide: say which size, by what --------------------------------
    case("tp_not_dividing_the_widths", f"model.py --tp 3 {OUT}",
         ["64 is not divisible by 3", "256 is not divisible by 3", "use --tp 2 or 4"],
         at=("rules/plans/megatron.toml", 'id = "split-weight-matrices"')),
    case("dp_not_dividing_the_batch", f"model.py --dp 3 {OUT}", ["batch of 8 is not divisible by --dp 3"],
         at=("model.py", "def example_inputs")),
    case("micro_batches_not_dividing_the_batch", f"model.py --pp 2 --micro-batches 3 {OUT}",
         ["batch of 8", "3 micro-batches"], files={"model.py": BLOCKS}, at=("model.py", "def example_inputs")),
    case("more_stages_than_blocks", f"model.py --pp 5 {OUT}", ["4 blocks cannot fill 5 pipeline stages"],
         files={"model.py": BLOCKS}, at=("model.py", "def forward")),
    # ---- paths ----------------------------------------------------------------------------
    case("model_file_missing", f"nothere.py --tp 2 {OUT}", ["no such file", "nothere.py"]),
    case("model_file_is_a_folder", f"sub --tp 2 {OUT}", ["sub is a folder, not a model file"],
         extra={"sub/keep.txt": ""}),
    case("out_is_an_existing_file", "model.py --tp 2 -o out.txt", ["-o out.txt", "is a file, not a folder"],
         extra={"out.txt": "mine\n"}),
    case("verify_out_is_an_existing_file", "verify model.py --tp 2 -o out.txt", ["is a file, not a folder"],
         extra={"out.txt": "mine\n"}),
    case("plan_table_path_missing", f"model.py --tp 2 --plan tables/mine.toml {OUT}",
         ["no plan table tables/mine.toml"]),
    # ---- entry files ----------------------------------------------------------------------
    *[case(f"entry_{b.id}", f"model.py --tp 2 {OUT}", b.says, at=("model.py", b.at), files={"model.py": b.source})
      for b in BAD_FILES],
    case("entry_build_returns_no_module", f"model.py --tp 2 {OUT}", ["build()", "nn.Module", "int"],
         files={"model.py": replace(MODEL, "return MLP()", "return 3")}, at=("model.py", "def build")),
    case("entry_example_inputs_raises", f"model.py --tp 2 {OUT}", ["example_inputs()", "ValueError", "no data"],
         files={"model.py": replace(MODEL, "return (torch.randn(8, 64), torch.randn(8, 64))",
                                    "raise ValueError('no data')")},
         at=("model.py", "raise ValueError('no data')")),
    case("entry_model_class_missing", f"model.py --tp 2 --model Missing {OUT}",
         ["`Missing` is not an nn.Module class"], at=("model.py", 1)),
    # ---- plan tables ----------------------------------------------------------------------
    case("plan_toml_syntax_error", f"model.py --tp 2 --plan mine.toml {OUT}", ["invalid TOML", "toml.io"],
         extra={"mine.toml": replace(GOOD_PLAN, 'select = { params = "matrix" }', 'select = { params = "matrix" ')},
         at=("mine.toml", 7)),
    case("plan_constraint_without_select", f"model.py --tp 2 --plan mine.toml {OUT}", ["needs `select`"],
         extra={"mine.toml": replace(GOOD_PLAN, 'select = { params = "matrix" }\n', "")},
         at=("mine.toml", 'id = "split-matrices"')),
    case("plan_unknown_algo", f"model.py --tp 2 --plan mine.toml {OUT}", ["unknown algo 'sp lit'", "replicate"],
         extra={"mine.toml": replace(GOOD_PLAN, 'algo = "split"', 'algo = "sp lit"')},
         at=("mine.toml", 'id = "split-matrices"')),
    case("plan_bad_n", f"model.py --tp 2 --plan mine.toml {OUT}", ["n = 'three'", "|tp|"],
         extra={"mine.toml": replace(GOOD_PLAN, 'n = "|tp|"', 'n = "three"')},
         at=("mine.toml", 'id = "split-matrices"')),
    case("plan_extends_unknown", f"model.py --tp 2 --plan mine.toml {OUT}", ["unknown plan 'megatronn'"],
         extra={"mine.toml": replace(GOOD_PLAN, 'axes = ["tp"]', 'axes = ["tp"]\nextends = "megatronn"')},
         at=("mine.toml", "extends")),
    case("plan_op_assign_mismatch", f"model.py --tp 2 --plan mine.toml {OUT}", ["op_assign = 'consecutive'"],
         extra={"mine.toml": GOOD_PLAN + 'op_assign = "consecutive"\n'}, at=("mine.toml", 'id = "split-matrices"')),
    # ---- schedule tables ------------------------------------------------------------------
    case("schedule_toml_syntax_error", f"model.py --pp 2 --schedule mine.toml {OUT}", ["invalid TOML"],
         extra={"mine.toml": replace(GOOD_SCHEDULE, 'warmup = "D - i - 1"', 'warmup = D - i - 1')},
         files={"model.py": BLOCKS}, at=("mine.toml", 4)),
    case("schedule_is_a_plan_table", f"model.py --pp 2 --schedule megatron {OUT}",
         ["megatron is a plan table, not a schedule"], files={"model.py": BLOCKS},
         at=("rules/plans/megatron.toml", 1)),
    case("schedule_bad_order_constraint", f"model.py --pp 2 --schedule mine.toml {OUT}", ["F[k] <= B[k]"],
         extra={"mine.toml": replace(GOOD_SCHEDULE, '"F[k] < B[k]"', '"F[k] <= B[k]"')},
         files={"model.py": BLOCKS}, at=("mine.toml", "order")),
    case("schedule_unknown_name_in_warmup", f"model.py --pp 2 --schedule mine.toml {OUT}", ["unknown name Q"],
         extra={"mine.toml": replace(GOOD_SCHEDULE, 'warmup = "D - i - 1"', 'warmup = "Q - i"')},
         files={"model.py": BLOCKS}, at=("mine.toml", "warmup")),
    # ---- device specs and op rules in a user's rules folder --------------------------------
    case("rules_path_missing", f"model.py --tp 2 {OUT}", [ENV_VAR, "does not exist"],
         env={ENV_VAR: "no_such_rules"}),
    case("device_toml_syntax_error", f"model.py --tp 2 --cluster box {OUT}", ["invalid TOML"],
         extra={"my_rules/devices/box.toml": device_line("flops", "flops = 5e10e")},
         env={ENV_VAR: "my_rules"}, at=("my_rules/devices/box.toml", "flops")),
    case("device_missing_key", f"model.py --tp 2 --cluster box {OUT}", ["no `latency`"],
         extra={"my_rules/devices/box.toml": device_line("latency", "")},
         env={ENV_VAR: "my_rules"}, at=("my_rules/devices/box.toml", 1)),
    case("device_value_not_a_number", f"model.py --tp 2 --cluster box {OUT}", ["flops", "positive number"],
         extra={"my_rules/devices/box.toml": device_line("flops", 'flops = "fast"')},
         env={ENV_VAR: "my_rules"}, at=("my_rules/devices/box.toml", "flops")),
    case("device_matmul_rate_of_an_unknown_dtype", f"model.py --tp 2 --cluster box {OUT}",
         ["[device.matmul] has `int8`", "fp32, tf32, bf16, fp16"],
         extra={"my_rules/devices/box.toml": device_line("bf16", "int8 = 5e8")},
         env={ENV_VAR: "my_rules"}, at=("my_rules/devices/box.toml", "int8")),
    case("device_memory_bandwidth_negative", f"model.py --tp 2 --cluster box {OUT}",
         ["memory_bandwidth", "positive number"],
         extra={"my_rules/devices/box.toml": device_line("memory_bandwidth", "memory_bandwidth = -2e9")},
         env={ENV_VAR: "my_rules"}, at=("my_rules/devices/box.toml", "memory_bandwidth")),
    case("precision_unknown", f"model.py --tp 2 --precision fp8 {OUT}", ["--precision fp8", "bf16"]),
    case("device_without_cluster_table", f"model.py --tp 2 --cluster box {OUT}", ["no [cluster] table"],
         extra={"my_rules/devices/box.toml": GOOD_DEVICE.split("[cluster]")[0]},
         env={ENV_VAR: "my_rules"}, at=("my_rules/devices/box.toml", 1)),
    case("op_rule_toml_syntax_error", f"model.py --tp 2 {OUT}", ["invalid TOML"],
         extra={"my_rules/ops/mine.toml": '[[op]]\ncallee = ["torch.nn.GELU"\n'},
         env={ENV_VAR: "my_rules"}, at=("my_rules/ops/mine.toml", 2)),
    case("op_rule_bad_dims", f"model.py --tp 2 {OUT}", ["bad op rule"],
         extra={"my_rules/ops/mine.toml": '[[op]]\ncallee = ["torch.nn.functional.gelu"]\ndims = "a b"\n'},
         env={ENV_VAR: "my_rules"}, at=("my_rules/ops/mine.toml", 2)),
    case("op_rule_without_dims_or_kind", f"model.py --tp 2 {OUT}", ["needs `dims` or a `kind`"],
         extra={"my_rules/ops/mine.toml": '[[op]]\ncallee = ["torch.nn.functional.gelu"]\n'},
         env={ENV_VAR: "my_rules"}, at=("my_rules/ops/mine.toml", 2)),
    # ---- source annotations ---------------------------------------------------------------
    case("annotation_unknown_axis", f"model.py --tp 2 {OUT}", ["bad annotation 'pp=split'", "tp=replicate"],
         files={"model.py": replace(MODEL, "h = F.gelu(self.fc1(x))", "h = F.gelu(self.fc1(x))  # nnscaler: pp=split")},
         at=("model.py", "# nnscaler: pp=split")),
    case("annotation_without_value", f"model.py --tp 2 {OUT}", ["bad annotation 'tp'"],
         files={"model.py": replace(MODEL, "h = F.gelu(self.fc1(x))", "h = F.gelu(self.fc1(x))  # nnscaler: tp")},
         at=("model.py", "# nnscaler: tp")),
    case("annotation_unknown_dim_label", f"model.py --tp 2 {OUT}", ["zz"],
         files={"model.py": replace(MODEL, "h = F.gelu(self.fc1(x))", "h = F.gelu(self.fc1(x))  # nnscaler: tp=zz")},
         at=("model.py", "# nnscaler: tp=zz")),
    # ---- [tool.nnscaler-rewrite] in pyproject.toml ----------------------------------------
    case("pyproject_toml_syntax_error", f"model.py --tp 2 {OUT}", ["invalid TOML"],
         extra={"pyproject.toml": '[project]\nname = "x"\n\n[tool.nnscaler-rewrite]\ntp = 2\nout = "par\n'},
         at=("pyproject.toml", 6)),
    case("pyproject_unknown_key", f"model.py {OUT}", ["unknown key `tensor-parallel`", "memory-budget"],
         extra={"pyproject.toml": "[tool.nnscaler-rewrite]\ntp = 2\ntensor-parallel = 2\n"},
         at=("pyproject.toml", "tensor-parallel")),
    case("pyproject_tp_a_string", f"model.py {OUT}", ['tp = "two"', "whole number"],
         extra={"pyproject.toml": '[tool.nnscaler-rewrite]\ntp = "two"\n'}, at=("pyproject.toml", "tp =")),
    case("pyproject_tp_zero", f"model.py {OUT}", ["tp = 0", "at least 1"],
         extra={"pyproject.toml": "[tool.nnscaler-rewrite]\n  tp = 0\n"}, at=("pyproject.toml", "tp = 0")),
    case("pyproject_memory_budget", f"model.py --tp 2 {OUT}", ["memory-budget", "'lots' is not a size"],
         extra={"pyproject.toml": '[tool.nnscaler-rewrite]\nmemory-budget = "lots"\n'},
         at=("pyproject.toml", "memory-budget")),
    case("pyproject_rules_missing", f"model.py --tp 2 {OUT}", ["rules folder 'my_rules' does not exist"],
         extra={"pyproject.toml": '[tool.nnscaler-rewrite]\nrules = ["my_rules"]\n'}, at=("pyproject.toml", "rules")),
    case("pyproject_stages", f"model.py --pp 2 {OUT}", ["stages", "block indices"],
         extra={"pyproject.toml": '[tool.nnscaler-rewrite]\nstages = "x"\n'}, at=("pyproject.toml", "stages")),
    case("pyproject_not_a_table", f"model.py --tp 2 {OUT}", ["must be a table"],
         extra={"pyproject.toml": '[tool]\nnnscaler-rewrite = 3\n'}, at=("pyproject.toml", 1)),
]


@dataclass
class Result:
    code: int
    stdout: str
    stderr: str


def run_in_process(args: list[str], cwd: Path, env: dict[str, str], monkeypatch, capsys) -> Result:
    monkeypatch.chdir(cwd)
    monkeypatch.delenv(ENV_VAR, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, str(cwd / value))
    capsys.readouterr()
    code = 0
    try:
        cli.main(args)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except Exception as exc:        # an internal error: what a user would see as a traceback
        import traceback
        out = capsys.readouterr()
        return Result(1, out.out, out.err + "Traceback (most recent call last):\n" + traceback.format_exc())
    out = capsys.readouterr()
    return Result(code, out.out, out.err)


def expected_location(spec: Case, workdir: Path) -> str | None:
    if spec.at is None:
        return None
    name, place = spec.at
    if name.startswith("rules/"):
        path = builtin_rules_dir() / name.removeprefix("rules/")
        shown = str(path)
    else:
        path, shown = workdir / name, name
    if place is None:
        return f"{shown}:1:1"
    if isinstance(place, int):
        return f"{shown}:{place}:"
    line, col = position_of(path.read_text(encoding="utf-8"), place)
    return f"{shown}:{line}:{col}"


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts}


@pytest.mark.slow
@pytest.mark.parametrize("spec", CASES, ids=lambda c: c.id)
def test_bad_input_is_refused_at_its_place_with_a_hint_exit_2_and_nothing_written(spec, tmp_path, monkeypatch,
                                                                                  capsys):
    for name, text in spec.files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text, encoding="utf-8")
    before = _files(tmp_path)
    result = run_in_process(spec.args, tmp_path, spec.env, monkeypatch, capsys)
    report = f"exit {result.code}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert "Traceback" not in result.stderr, report
    assert result.code == 2, report
    first = result.stderr.splitlines()[0] if result.stderr else ""
    where = expected_location(spec, tmp_path)
    if where is None:
        assert first.startswith("error: "), report
    else:
        assert first.startswith(where) and ": error: " in first, f"expected {where}: error:\n{report}"
    flat = " ".join(result.stderr.split())
    assert [w for w in spec.says if w not in flat] == [], report
    assert re.search(r"^\s+hint: \S", result.stderr, re.M), report
    assert not (tmp_path / "out").exists(), report
    assert _files(tmp_path) == before, report


def test_the_table_has_at_least_40_cases_with_distinct_names():
    assert len(CASES) >= 40
    assert len({c.id for c in CASES}) == len(CASES)
