"""Ladder step 2 (DESIGN.md): before anything is written, the emitted rank modules are built, loaded
with their share of the state dict and run (forward and backward) under fake tensors, every
pipeline stage included (nnscaler_cst/verify/dry_run.py).

The fixtures' outputs pass it; an emission made inconsistent on purpose (a rewrite step
monkeypatched: a collective left out, the constructors' sizes left whole, a module a stage
still calls dropped) is reported as `internal error` at the user's line, exit 2, nothing
written. What fake tensors cannot run is a warning, not a refusal. In-process throughout.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

import nnscaler_cst.rewrite as rewrite_module
from nnscaler_cst import cli
from nnscaler_cst.analysis import analyze
from nnscaler_cst.errors import UserError
from nnscaler_cst.rewrite import PlanRequest, rewrite
from nnscaler_cst.verify import dry_run as dry

REPO = Path(__file__).resolve().parents[1]
_ANALYSES: dict[str, object] = {}


@pytest.fixture
def at_repo(monkeypatch):
    monkeypatch.chdir(REPO)        # paths print relative to the repository: fixtures/gpt.py


def analysis_of(name: str):
    """One analysis per fixture for the whole module (the trace is the slow part)."""
    if name not in _ANALYSES:
        _ANALYSES[name] = analyze(REPO / "fixtures" / name)
    return _ANALYSES[name]


def line_of(path: Path, needle: str) -> tuple[int, int]:
    """1-based (line, column) of `needle` in a file, as the tool prints them."""
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if needle in line:
            return number, line.index(needle) + 1
    raise AssertionError(f"{needle!r} not in {path}")


def no_dry_run_left():
    assert not [m for m in sys.modules if m.startswith("_nnscaler_dry_run_")]
    assert not [p for p in sys.path if "nnscaler-dry-run-" in p]


# ---- (1) the fixtures' outputs pass, every stage run -------------------------------------------

@pytest.mark.parametrize("fixture, request_, checked", [
    ("gpt.py", dict(tp=2), {(0, "build, load"), (1, "shard shapes"), (0, "forward, backward")}),
    ("gpt.py", dict(pp=2), {(0, "build, load"), (1, "build, load"), (0, "stage 0 forward"),
                            (1, "stage 1 forward")}),
    ("gpt.py", dict(tp=2, dp=2, pp=2), {(0, "build, load"), (1, "shard shapes"), (4, "build, load"),
                                        (5, "shard shapes"), (0, "stage 0 forward"), (4, "stage 1 forward")}),
    ("hf_llama.py", dict(tp=2), {(0, "build, load"), (1, "shard shapes"), (0, "forward, backward")}),
    ("hf_llama.py", dict(pp=2), {(0, "build, load"), (1, "build, load"), (0, "stage 0 forward"),
                                 (1, "stage 1 forward")}),
], ids=["gpt-tp2", "gpt-pp2", "gpt-tp2dp2pp2", "hf_llama-tp2", "hf_llama-pp2"])
@pytest.mark.slow
def test_fixture_outputs_pass(at_repo, fixture, request_, checked):
    analysis = analysis_of(fixture)
    result = rewrite(analysis, PlanRequest(**request_))       # runs the dry run itself
    assert not [w for w in result.plan.warnings if "dry-run" in w]
    report = dry.dry_run(analysis, result.files)
    assert set(report.checked) == checked and not report.warnings
    no_dry_run_left()


@pytest.mark.slow
def test_interleaved_stages_all_run(at_repo):
    """Two stages per rank (interleaved 1F1B): all four stages run, each on the rank holding it."""
    analysis = analysis_of("gpt.py")
    result = rewrite(analysis, PlanRequest(pp=2, schedule="interleaved"))
    report = dry.dry_run(analysis, result.files)
    assert [what for _, what in report.checked if "forward" in what] == [f"stage {s} forward" for s in range(4)]
    assert [rank for rank, what in report.checked if "forward" in what] == [0, 1, 0, 1]


def test_real_tensors_when_the_trace_needed_them(at_repo):
    """A model traced on real tensors is dry-run on real ones (its rank-sized shares)."""
    analysis = analyze(REPO / "fixtures" / "mlp.py", trace_mode="real")
    assert analysis.trace.mode == "real"
    result = rewrite(analysis, PlanRequest(tp=2))
    report = dry.dry_run(analysis, result.files)
    assert (0, "forward, backward") in report.checked and not report.warnings
    no_dry_run_left()


# ---- (2) a broken emission is caught before writing ---------------------------------------------

def drop_gather(monkeypatch, needle_site_line: int):
    """plan_edits, except that the all-gather of one site's result is left out."""
    original = rewrite_module.plan_edits
    dropped = []

    def broken(*args, **kwargs):
        edits = original(*args, **kwargs)
        for span, site in edits.sites.items():
            if span.line == needle_site_line and any(step.op == "gather" for step in site.result):
                site.result = [step for step in site.result if step.op != "gather"]
                dropped.append(span)
        return edits

    monkeypatch.setattr(rewrite_module, "plan_edits", broken)
    return dropped


@pytest.mark.slow
def test_missing_collective_is_an_internal_error_and_nothing_is_written(at_repo, monkeypatch, capsys, tmp_path):
    """The position embedding stays split where it is added to the whole token embedding: the CLI
    names the user's line of the add, exits 2 and writes nothing (no rank crash later)."""
    gpt = REPO / "fixtures" / "gpt.py"
    wpe_line, _ = line_of(gpt, "pos_emb = self.transformer.wpe(pos)")
    add_line, add_col = line_of(gpt, "tok_emb + pos_emb")
    dropped = drop_gather(monkeypatch, wpe_line)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_:
        cli.main(["fixtures/gpt.py", "--tp", "2", "-o", str(out)])
    err = capsys.readouterr().err
    assert dropped, "the test no longer breaks anything: the gather moved"
    assert exit_.value.code == 2
    assert f"fixtures/gpt.py:{add_line}:{add_col}: error: internal error:" in err, err
    assert "the forward raised RuntimeError" in err and "rank 0 (tp 0, dp 0, pp 0)" in err
    assert "note: the generated line: x = self.transformer.drop(tok_emb + pos_emb)" in err
    assert not out.exists() and list(tmp_path.iterdir()) == []
    no_dry_run_left()


def test_constructor_sizes_left_whole(at_repo, monkeypatch):
    """Constructors not divided: the rank's parameters disagree with their shards at load."""
    original = rewrite_module.plan_edits

    def broken(*args, **kwargs):
        edits = original(*args, **kwargs)
        edits.ctors = {}
        return edits

    monkeypatch.setattr(rewrite_module, "plan_edits", broken)
    with pytest.raises(UserError) as error:
        rewrite(analysis_of("gpt.py"), PlanRequest(tp=2))
    message = error.value.format()
    assert message.startswith("fixtures/gpt.py:") and ": error: internal error:" in message
    assert "state dict mismatch" in message and "in the rank's model but" in message
    no_dry_run_left()


def test_pipeline_stage_missing_a_module_it_calls(at_repo, monkeypatch):
    """The last stage made to drop ln_f, which it still calls: caught on stage 1's forward."""
    original = rewrite_module.stages_to_rewrite

    def broken(*args, **kwargs):
        stages = original(*args, **kwargs)
        stages.drop[stages.stages - 1] = [*stages.drop[stages.stages - 1], "transformer.ln_f"]
        return stages

    monkeypatch.setattr(rewrite_module, "stages_to_rewrite", broken)
    gpt = REPO / "fixtures" / "gpt.py"
    line, col = line_of(gpt, "self.transformer.ln_f(x)")
    with pytest.raises(UserError) as error:
        rewrite(analysis_of("gpt.py"), PlanRequest(pp=2))
    message = error.value.format()
    assert message.startswith(f"fixtures/gpt.py:{line}:{col}: error: internal error:"), message
    assert "rank 1 (tp 0, dp 0, pp 1): stage 1's forward raised" in message
    no_dry_run_left()


def test_the_break_is_real_without_the_dry_run(at_repo, monkeypatch):
    """Without the dry run the same broken emission would be written: the check is what refuses."""
    drop_gather(monkeypatch, line_of(REPO / "fixtures" / "gpt.py", "pos_emb = self.transformer.wpe(pos)")[0])
    monkeypatch.setattr(rewrite_module, "dry_run", lambda analysis, files: dry.DryRun())
    result = rewrite(analysis_of("gpt.py"), PlanRequest(tp=2))
    assert "tp_gather(self.transformer.wpe(pos)" not in result.files["model.py"]


def test_a_value_stored_on_the_model_is_run_again_at_a_second_step(at_repo, monkeypatch):
    """fixtures/stored_buffer.py stores its position encoding back on the module in forward, as
    transformers' CTRL does. With the scatter written on the stored value (what the rewrite did
    before: materialize now converts its use), the first step passes and the second slices the
    slice; the first step changed the model's state, so the dry run runs a second one and refuses
    at the add, naming the line that stores the buffer. The rewrite as it is passes."""
    path = REPO / "fixtures" / "stored_buffer.py"
    add_line, _ = line_of(path, "x + pos_embeds")
    store_line, store_col = line_of(path, "self.pos_encoding = self.pos_encoding.to(device")
    result = rewrite(analysis_of("stored_buffer.py"), PlanRequest(tp=2))
    model = result.files["model.py"]
    assert "self.pos_encoding = self.pos_encoding.to(device=x.device, dtype=x.dtype)\n" in model
    assert "pos_embeds = tp_scatter(self.pos_encoding, TP, dim=1)[positions, :]" in model
    report = dry.dry_run(analysis_of("stored_buffer.py"), result.files)
    assert (0, "forward, backward") in report.checked and (0, "second step") not in report.checked

    from nnscaler_cst.plan import whole_sizes
    from nnscaler_cst.source.files import SourceFile
    monkeypatch.setattr(SourceFile, "value_is_stored", lambda self, node: False)
    # `.to()` hands the buffer back unmodified: what keeps its layout one under both names (and
    # its sizes whole in the replan) is switched off too, so that the slice of the slice is written
    from nnscaler_cst.graph.graph import Graph
    monkeypatch.setattr(Graph, "passed_through", property(lambda self: {}))
    monkeypatch.setattr(whole_sizes, "_handed_back", lambda graph: {})
    with pytest.raises(UserError) as error:
        rewrite(analyze(path), PlanRequest(tp=2))          # a fresh analysis: the planner caches per graph
    message = error.value.format()
    assert message.startswith(f"fixtures/stored_buffer.py:{add_line}:9: error: internal error:"), message
    assert "rank 0 (tp 0, dp 0, pp 0): the forward raised RuntimeError" in message
    assert "(at the second step: the first changed the model's state)" in message
    assert (f"fixtures/stored_buffer.py:{store_line}:{store_col}: note: pos_encoding was [32, 64] when built "
            "and is [32, 32] after a step: stored here (self.pos_encoding = tp_scatter(") in message
    no_dry_run_left()


# ---- what the dry run cannot run is a warning -----------------------------------------------------

def test_unsupported_under_fake_tensors_is_a_warning(at_repo, monkeypatch):
    from torch._subclasses.fake_tensor import DataDependentOutputException
    import torch
    original = dry._shape_only_collectives

    def data_dependent(comm):
        original(comm)

        def all_reduce(t, axis, op=None):
            raise DataDependentOutputException(torch.ops.aten._local_scalar_dense.default)
        comm._all_reduce = all_reduce

    monkeypatch.setattr(dry, "_shape_only_collectives", data_dependent)
    result = rewrite(analysis_of("gpt.py"), PlanRequest(tp=2))
    warnings = [w for w in result.plan.warnings if "could not dry-run" in w]
    assert len(warnings) == 1 and warnings[0].startswith("fixtures/gpt.py: warning: ")
    assert "DataDependentOutputException" in warnings[0]
    no_dry_run_left()


# ---- (3) what a stage holds of another stage's modules -------------------------------------------

BATCH_NORM_AFTER_THE_LOOP = '''
import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        return x + torch.relu(self.conv(x))


class Net(nn.Module):
    def __init__(self, c=4, n=4):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.blocks = nn.ModuleList(Block(c) for _ in range(n))
        self.norm = nn.BatchNorm2d(c)
        self.head = nn.Linear(c, 2)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean((2, 3)))


def build():
    return Net()


def example_inputs():
    return (torch.randn(4, 3, 8, 8),)


def loss(output):
    return output.pow(2).mean()
'''


def test_a_batch_norm_another_stage_holds_loads_nothing(tmp_path):
    """Stage 0 keeps the last stage's BatchNorm hollow; loading its share (a plain dict, no
    versions) must not make BatchNorm add a num_batches_tracked key the stage does not hold."""
    (tmp_path / "net.py").write_text(BATCH_NORM_AFTER_THE_LOOP.lstrip())
    analysis = analyze(tmp_path / "net.py")
    result = rewrite(analysis, PlanRequest(pp=2, micro_batches=1))      # runs the dry run itself
    assert "'norm'" in next(line for line in result.files["model_stage0.py"].splitlines()
                            if line.startswith("STAGE_DROPS"))
    assert (0, "stage 0 forward") in dry.dry_run(analysis, result.files).checked
    no_dry_run_left()


IN_PLACE_FIRST = BATCH_NORM_AFTER_THE_LOOP.replace(
    "        self.conv = nn.Conv2d(c, c, 3, padding=1)\n",
    "        self.conv = nn.Conv2d(c, c, 3, padding=1)\n        self.act = nn.ReLU(inplace=True)\n").replace(
    "        return x + torch.relu(self.conv(x))",
    "        x = self.act(x)               # in place, on the activation the stage received\n"
    "        return x + self.conv(x)")


def test_a_stage_whose_first_op_is_in_place(tmp_path):
    """A received activation needs gradients; an in-place op at the start of a stage (a block that
    opens with ReLU(inplace=True), DLA's base_layer cut before its ReLU) must not meet it as a leaf."""
    (tmp_path / "net.py").write_text(IN_PLACE_FIRST.lstrip())
    analysis = analyze(tmp_path / "net.py")
    result = rewrite(analysis, PlanRequest(pp=2, micro_batches=1))      # runs the dry run itself
    assert (1, "stage 1 forward") in dry.dry_run(analysis, result.files).checked
    no_dry_run_left()


LAYER_FILE = '''
import torch
import torch.nn as nn


class Pool(nn.Module):
    def __init__(self):
        super().__init__()
        self.flatten = nn.Flatten(1)

    def forward(self, x):
        x = x.mean((2, 3), keepdim=True)
        return self.flatten(x)
'''

NET_USING_IT = '''
import torch
import torch.nn as nn
from pool import Pool


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)
        self.pool = Pool()
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        x = self.conv(x)
        return self.head(self.pool(x))


def build():
    return Net()


def example_inputs():
    return (torch.randn(2, 3, 4, 4),)


def loss(output):
    return output.pow(2).mean()
'''


def test_a_failing_line_of_a_mirrored_file_is_located_in_that_file(tmp_path):
    """A rewritten line of the mirror of a model file maps to that file, not to another model
    file whose own rewritten lines align as well (DLA's failure at dla.py:169 was put in timm's
    adaptive_avgmax_pool.py)."""
    (tmp_path / "pool.py").write_text(LAYER_FILE.lstrip())
    (tmp_path / "net.py").write_text(NET_USING_IT.lstrip())
    analysis = analyze(tmp_path / "net.py")
    mirror = LAYER_FILE.lstrip().splitlines()
    index = next(i for i, line in enumerate(mirror) if "self.flatten(x)" in line)
    mirror[index] = "        return dp_layers(self.flatten, x, DP)"
    location = dry._user_location(analysis, "pool.py", mirror, index, None)
    assert (Path(location.path).name, location.line) == ("pool.py", index + 1), location
