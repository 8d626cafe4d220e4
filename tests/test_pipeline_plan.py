"""Pipeline stage plans on the GPT fixture (issue 5): which blocks each stage runs, which modules
it does not hold, which weight is tied across stages, how the model's forward is cut, and what
each rank's build(rank) holds.

The GPT fixture (fixtures/gpt.py) has 4 identical blocks in `transformer.h`, a prologue (token
and position embeddings) before the loop over them and an epilogue (final LayerNorm, LM head,
cross entropy) after it; `transformer.wte.weight` is `lm_head.weight` (weight tying).

The stage plan is read through the planner (in process, one trace of the model), the emitted
code through the command line (fresh processes), and the output package is imported in a
subprocess that cannot import `nnscaler_cst`, as a user's training script would.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from nnscaler_cst.errors import UserError

REPO = Path(__file__).resolve().parents[1]
GPT = REPO / "fixtures" / "gpt.py"
TIMEOUT_S = 300
N_BLOCKS = 4
BLOCKS = [f"transformer.h.{b}" for b in range(N_BLOCKS)]
TIED = ["lm_head.weight", "transformer.wte.weight"]


def run_cli(*args, cwd: Path = REPO) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200", "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "nnscaler_cst.cli", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S)


# --------------------------------------------------------------------------------------------
# The stage plan (plan/pipeline.py), in process
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def graph():
    from nnscaler_cst.analysis import analyze
    return analyze(GPT).graph


def stages(graph, pp: int, cuts=None):
    from nnscaler_cst.plan.pipeline import plan_stages
    return plan_stages(graph, pp, 1, cuts)


@pytest.mark.slow
def test_the_trunk_is_the_loop_over_transformer_h_handing_on_x(graph):
    from nnscaler_cst.plan.pipeline import find_trunk
    trunk = find_trunk(graph)
    assert trunk.container == "transformer.h"
    assert trunk.blocks == BLOCKS
    assert trunk.function.name.value == "forward"
    # before the loop: b, t, pos, tok_emb, pos_emb, x; only x is read by the loop or after it
    assert trunk.handoff == ["x"]


@pytest.mark.parametrize("pp", [2, 4])
def test_stages_are_contiguous_block_ranges_covering_every_block_once(graph, pp):
    plan = stages(graph, pp)
    ranges = plan.block_ranges
    assert len(ranges) == pp and plan.stages == pp
    assert ranges[0][0] == 0 and ranges[-1][1] == N_BLOCKS
    for (a, b), (c, _) in zip(ranges, ranges[1:]):
        assert b == c, ranges
    assert all(b > a for a, b in ranges), ranges
    covered = [block for a, b in ranges for block in range(a, b)]
    assert covered == list(range(N_BLOCKS))


def test_four_stages_get_one_block_each(graph):
    assert stages(graph, 4).block_ranges == [(0, 1), (1, 2), (2, 3), (3, 4)]


def test_two_stages_split_the_identical_blocks_evenly(graph):
    """The blocks cost the same; the prologue (two embedding lookups) and the epilogue (a norm,
    a 64x128 head and the loss) each cost less than one block (a block holds 64x192, 64x64,
    64x256 and 256x64 matmuls plus attention), so 2 + 2 beats 1 + 3 and 3 + 1."""
    assert stages(graph, 2).block_ranges == [(0, 2), (2, 4)]


def test_stages_option_cuts_where_the_user_says(graph):
    assert stages(graph, 2, [1]).block_ranges == [(0, 1), (1, 4)]
    assert stages(graph, 2, [3]).block_ranges == [(0, 3), (3, 4)]
    assert stages(graph, 4, [1, 2, 3]).block_ranges == [(0, 1), (1, 2), (2, 3), (3, 4)]


@pytest.mark.parametrize("pp, cuts", [(2, [0]), (2, [4]), (2, [1, 2]), (4, [1, 3, 2]), (4, [1, 1, 2])])
def test_stages_option_refuses_cuts_that_do_not_make_the_stages(graph, pp, cuts):
    with pytest.raises(UserError, match="--stages"):
        stages(graph, pp, cuts)


def test_more_stages_than_blocks_is_refused(graph):
    with pytest.raises(UserError, match="4 blocks cannot fill 5 pipeline stages"):
        stages(graph, 5)


SHARED_LAYERS = textwrap.dedent("""
    import torch
    from torch import nn


    class Shared(nn.Module):
        # ALBERT's shape: one layer, its weights shared, called once per depth
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(8, 8)
            self.head = nn.Linear(8, 2)

        def forward(self, x):
            for _ in range(4):
                x = torch.tanh(self.layer(x))
            return self.head(x).sum()


    def build():
        return Shared()


    def example_inputs():
        return {"x": torch.randn(4, 8)}
""")


def test_layers_sharing_one_module_are_cut_between_the_loops_iterations(tmp_path):
    # (tests/test_shared_layer_loop.py: the stages, the rank files, a gloo run)
    from nnscaler_cst.analysis import analyze
    from nnscaler_cst.plan.pipeline import find_trunk
    (tmp_path / "shared.py").write_text(SHARED_LAYERS)
    trunk = find_trunk(analyze(tmp_path / "shared.py").graph)
    assert trunk.iterations and trunk.container == "layer" and trunk.blocks == ["layer"] * 4


NESTED_SHARED = textwrap.dedent("""
    import torch
    from torch import nn


    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return torch.tanh(self.fc(x))


    class Group(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([Layer()])

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x


    class Shared(nn.Module):
        # ALBERT's shape: a group of layers, its weights shared, called once per depth
        def __init__(self):
            super().__init__()
            self.groups = nn.ModuleList([Group()])
            self.head = nn.Linear(8, 2)

        def forward(self, x):
            for i in range(4):
                x = self.groups[0](x)
            return self.head(x).sum()


    def build():
        return Shared()


    def example_inputs():
        return {"x": torch.randn(4, 8)}
""")


def test_a_shared_group_of_layers_is_cut_where_the_loop_calls_it(tmp_path):
    """Not at the linear inside it that runs as often: the loop calling the group runs the iterations."""
    from nnscaler_cst.analysis import analyze
    from nnscaler_cst.plan.pipeline import plan_stages
    (tmp_path / "nested.py").write_text(NESTED_SHARED)
    plan = plan_stages(analyze(tmp_path / "nested.py").graph, 2)
    assert plan.trunk.container == "groups.0" and plan.trunk.blocks == ["groups.0"] * 4
    assert plan.block_ranges == [(0, 2), (2, 4)]
    assert sorted(name for group in plan.shared for name in group) == [
        "groups.0.layers.0.fc.bias", "groups.0.layers.0.fc.weight"]


FORWARD_CALLED = textwrap.dedent("""
    import torch
    from torch import nn


    class Blocks(nn.Module):
        # SqueezeBERT's shape: each block's forward called directly, no module call for the trace
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

        def forward(self, x):
            for layer in self.layers:
                x = torch.tanh(layer.forward(x))
            return x.sum()


    def build():
        return Blocks()


    def example_inputs():
        return {"x": torch.randn(4, 8)}
""")


def test_blocks_whose_forward_is_called_directly_are_refused_with_a_location(tmp_path):
    from nnscaler_cst.analysis import analyze
    from nnscaler_cst.plan.pipeline import find_trunk
    (tmp_path / "forward_called.py").write_text(FORWARD_CALLED)
    with pytest.raises(UserError, match="not called as modules") as refused:
        find_trunk(analyze(tmp_path / "forward_called.py").graph)
    assert refused.value.location is not None and "block.forward(x)" in refused.value.hint


LOOP_WITH_LAYERDROP = textwrap.dedent("""
    def forward(self, x, mask):
        h = self.embed(x)
        seen = 0
        for layer in self.layers:
            if self.training:
                p = torch.rand([])
                if p < self.layerdrop:
                    continue
            h = layer(h, mask)
            seen = seen + 1
            scaled = h * 2
            h[0] = scaled[0]
        return self.norm(h), seen
""")


def test_only_values_live_when_a_stage_starts_are_handed_on():
    """`p` is set under a condition and read after that in the same pass, `scaled` is set then
    read: a stage may never have set either, so handing them on would raise UnboundLocalError
    (BART's `dropout_probability`). `h` and `seen` are read before they are set in a pass."""
    import libcst as cst
    from nnscaler_cst.plan.pipeline import handoff_variables
    function = cst.parse_module(LOOP_WITH_LAYERDROP).body[0]
    assert handoff_variables(function, 2) == ["h", "seen"]


def test_an_attribute_the_prologue_stores_hands_on_no_module():
    """`self.pe = self.pe.to(h.dtype)` before the loop (transformers' CTRL) binds no variable: neither
    `self` (stage 1 was handed stage 0's module, whose final norm it does not hold) nor `pe` (an
    attribute's name, no local) is handed on. A write by index still hands on what it changed."""
    import libcst as cst
    from nnscaler_cst.plan.pipeline import handoff_variables
    function = cst.parse_module(
        "def forward(self, h, mask):\n"
        "    self.pe = self.pe.to(h.dtype)\n"
        "    h = h + self.pe\n"
        "    mask[:, 0] = 1\n"
        "    for layer in self.layers:\n"
        "        h = layer(h, mask, self.pe)\n"
        "    return self.norm(h)\n").body[0]
    assert handoff_variables(function, 3) == ["h", "mask"]


def test_every_op_runs_on_the_stage_of_its_block_the_prologue_first_the_epilogue_last(graph):
    plan = stages(graph, 2, [1])
    stage_of_block = {0: 0, 1: 1, 2: 1, 3: 1}

    def block_of(node):
        path = node.module_path or ""
        return next((b for b, p in enumerate(BLOCKS) if path == p or path.startswith(p + ".")), None)

    in_blocks = [n.index for n in graph.nodes if block_of(n) is not None]
    seen = set()
    for node in graph.nodes:
        stage = plan.node_stage[node.index]
        block = block_of(node)
        if block is not None:
            assert stage == stage_of_block[block], (node.index, node.module_path, stage)
        elif node.index < min(in_blocks):
            assert stage == 0, (node.index, node.callee_path)
        else:
            assert node.index > max(in_blocks) and stage == 1, (node.index, node.callee_path)
        seen.add((node.callee_path or node.module_path, stage))
    for path, stage in [("transformer.wte", 0), ("transformer.wpe", 0), ("transformer.h.0.mlp.c_fc", 0),
                        ("transformer.h.1.mlp.c_fc", 1), ("transformer.ln_f", 1), ("lm_head", 1)]:
        assert (path, stage) in seen, (path, stage)


@pytest.mark.parametrize("pp", [2, 4])
def test_the_first_stage_drops_the_head_and_final_norm_the_last_the_embeddings(graph, pp):
    plan = stages(graph, pp)
    assert sorted(plan.drop[0]) == ["lm_head", "transformer.ln_f"]
    assert sorted(plan.drop[pp - 1]) == ["transformer.wpe", "transformer.wte"]
    for middle in range(1, pp - 1):       # runs blocks only: holds none of the other modules
        assert sorted(plan.drop[middle]) == ["lm_head", "transformer.ln_f", "transformer.wpe", "transformer.wte"]
    for stage in range(pp):               # a stage never drops (part of) a block it runs
        assert not any(d.startswith("transformer.h") for d in plan.drop[stage])


@pytest.mark.parametrize("pp", [2, 4])
def test_the_tied_embedding_and_head_weight_is_reported_tied(graph, pp):
    assert [sorted(group) for group in stages(graph, pp).tied] == [TIED]


# --------------------------------------------------------------------------------------------
# The emitted code, through the command line
# --------------------------------------------------------------------------------------------

CASES = {  # name -> rewrite options
    "pp2": ["--pp", 2, "--micro-batches", 4, "--schedule", "1f1b"],
    "pp2_stages1": ["--pp", 2, "--micro-batches", 4, "--schedule", "gpipe", "--stages", 1],
    "pp2_tp2": ["--pp", 2, "--tp", 2, "--micro-batches", 4, "--schedule", "1f1b"],
}

PROBE = r'''
import importlib, importlib.util, json, sys
sys.modules["nnscaler_cst"] = None          # the output must not need the tool
import torch

folder, entry_path, out_path = sys.argv[1:4]
sys.path.insert(0, folder.rsplit("/", 1)[0])
package = importlib.import_module(folder.rsplit("/", 1)[1])
spec = importlib.util.spec_from_file_location("entry", entry_path)
entry = importlib.util.module_from_spec(spec)
spec.loader.exec_module(entry)
torch.manual_seed(0)
reference = entry.build().state_dict()

report = {"reference": {k: list(v.shape) for k, v in reference.items()}, "ranks": []}
shards = []
for rank in range(package.WORLD_SIZE):
    module = package.rank_module(rank)
    model = package.build(rank)
    params = {}
    for key, p in model.named_parameters(remove_duplicate=False):
        local, _, rest = key.partition(".")
        stage = module.PIPELINE_STAGES[int(local)]
        params[package.global_key(rest, stage, module)] = list(p.shape)
    shard = package.shard_state_dict(reference, rank)
    shards.append(shard)
    problem = model.load_state_dict(shard, strict=True)
    loaded = model.state_dict()
    # every value this rank holds is the reference's, under the single-device name
    values = {}
    for key, t in loaded.items():
        local, _, rest = key.partition(".")
        name = package.global_key(rest, module.PIPELINE_STAGES[int(local)], module)
        full = reference[name]
        if tuple(t.shape) == tuple(full.shape):
            values[name] = "equal" if torch.equal(t, full) else "differs"
        else:
            tp = package.coords(rank)["tp"]
            dim, groups = package.TP_SPLITS[name]
            piece = full.unflatten(dim, (groups, -1)).chunk(package.TP_SIZE, dim + 1)[tp].flatten(dim, dim + 1)
            values[name] = "slice" if torch.equal(t, piece) else "differs"
    report["ranks"].append({
        "stages": module.PIPELINE_STAGES,
        "stage_blocks": {str(s): list(r) for s, r in module.STAGE_BLOCKS.items()},
        "stage_drops": {str(s): d for s, d in module.STAGE_DROPS.items()},
        "tied": module.TIED_PARAMETERS, "schedule": module.SCHEDULE, "pipeline_blocks": module.PIPELINE_BLOCKS,
        "params": params, "values": values, "coords": package.coords(rank),
    })
merged = package.merge_state_dicts(shards)
report["merged_keys"] = sorted(merged)
report["merged_exact"] = sorted(k for k in reference if k in merged and merged[k].dtype == reference[k].dtype
                                and torch.equal(merged[k], reference[k]))
json.dump(report, open(out_path, "w"))
'''


def rewrite_and_probe(root: Path, name: str) -> dict:
    folder = root / name
    result = run_cli(GPT, *CASES[name], "-o", folder)
    assert result.returncode == 0, result.stdout + result.stderr
    probe = root / f"probe_{name}.py"
    probe.write_text(PROBE)
    out = root / f"probe_{name}.json"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    run = subprocess.run([sys.executable, str(probe), str(folder), str(GPT), str(out)], cwd=root, env=env,
                         capture_output=True, text=True, timeout=TIMEOUT_S)
    assert run.returncode == 0, run.stdout + run.stderr
    return {"folder": folder, **json.loads(out.read_text())}


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline_outputs")
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(rewrite_and_probe, root, name) for name in CASES}
        yield {name: f.result() for name, f in futures.items()}


def forward_of(text: str, cls: str) -> str:
    """The source of `def forward` of class `cls`, dedented."""
    start = text.index(f"class {cls}(")
    body = text[start:]
    begin = body.index("    def forward(")
    rest = body[begin:].splitlines(keepends=True)
    lines = [rest[0]]
    for line in rest[1:]:
        if line.strip() and not line.startswith("        "):
            break
        lines.append(line)
    return textwrap.dedent("".join(lines)).rstrip() + "\n"


EXPECTED_FORWARD = '''\
def forward(self, idx, targets):
    if pp_first_stage():  # pipeline: the first stage runs what precedes the blocks
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)  # shape (t)
        tok_emb = self.transformer.wte(idx)  # token embeddings of shape (b, t, n_embd)
        pos_emb = self.transformer.wpe(pos)  # position embeddings of shape (t, n_embd)
        x = self.transformer.drop(tok_emb + pos_emb)
    else:
        x, = pp_receive()  # pipeline: from the previous stage
    for block in self.transformer.h:  # pipeline: this stage's blocks of transformer.h only
        x = block(x)
    pp_handoff(x)  # pipeline: every stage but the last hands these on and ends here
    x = self.transformer.ln_f(x)
    logits = self.lm_head(x)
    loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
    return loss
'''


@pytest.mark.slow
def test_rank0_forward_guards_the_prologue_receives_otherwise_and_hands_off_after_the_loop(outputs):
    text = (outputs["pp2"]["folder"] / "model_stage0.py").read_text()
    assert forward_of(text, "GPT") == EXPECTED_FORWARD
    assert re.search(r"^from \._comm import .*\bpp_first_stage\b", text, re.M)
    assert re.search(r"^from \._comm import .*\bpp_handoff\b", text, re.M)
    assert re.search(r"^from \._comm import .*\bpp_receive\b", text, re.M)


@pytest.mark.slow
def test_every_rank_runs_the_same_cut_forward_and_the_blocks_are_untouched(outputs):
    folder = outputs["pp2"]["folder"]
    original = GPT.read_text()
    for stage in range(2):
        text = (folder / f"model_stage{stage}.py").read_text()
        assert forward_of(text, "GPT") == EXPECTED_FORWARD
        assert forward_of(text, "Block") == forward_of(original, "Block")


@pytest.mark.slow
def test_each_rank_file_states_its_stage_blocks_drops_tied_weight_and_schedule(outputs):
    ranks = outputs["pp2_stages1"]["ranks"]
    assert [r["stages"] for r in ranks] == [[0], [1]]
    assert ranks[0]["stage_blocks"] == {"0": [0, 1]}          # --stages 1: block 0 alone on stage 0
    assert ranks[1]["stage_blocks"] == {"1": [1, 4]}
    assert sorted(ranks[0]["stage_drops"]["0"]) == ["lm_head", "transformer.ln_f"]
    assert sorted(ranks[1]["stage_drops"]["1"]) == ["transformer.wpe", "transformer.wte"]
    assert all(sorted(r["tied"]) == TIED and r["pipeline_blocks"] == "transformer.h" for r in ranks)
    # gpipe, 4 micro-batches: all forwards then all backwards
    assert ranks[0]["schedule"] == "0F0 0F1 0F2 0F3 0B0 0B1 0B2 0B3"
    assert ranks[1]["schedule"] == "1F0 1F1 1F2 1F3 1B0 1B1 1B2 1B3"


@pytest.mark.slow
def test_schedule_csv_holds_the_rank_files_schedules(outputs):
    for name in ("pp2", "pp2_stages1"):
        rows = (outputs[name]["folder"] / "schedule.csv").read_text().splitlines()
        assert [row.replace(",", " ") for row in rows] == [r["schedule"] for r in outputs[name]["ranks"]]
    # 1f1b, 2 ranks, 4 micro-batches: rank 0 warms up with one forward, rank 1 with none
    assert outputs["pp2"]["ranks"][0]["schedule"] == "0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3"
    assert outputs["pp2"]["ranks"][1]["schedule"] == "1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3"


@pytest.mark.slow
@pytest.mark.parametrize("name, blocks", [("pp2", [[0, 1], [2, 3]]), ("pp2_stages1", [[0], [1, 2, 3]])])
def test_each_rank_builds_only_its_stage_and_together_they_hold_the_model(outputs, name, blocks):
    report = outputs[name]
    reference = report["reference"]
    first, last = (r["params"] for r in report["ranks"])
    for rank, params in enumerate((first, last)):
        for key, shape in params.items():
            assert reference.get(key) == shape, (rank, key)
        held = sorted({int(k.split(".")[2]) for k in params if k.startswith("transformer.h.")})
        assert held == blocks[rank]
    # rank 0 holds the tied weight as the embedding, rank 1 as the head
    assert "transformer.wte.weight" in first and "lm_head.weight" not in first
    assert "lm_head.weight" in last and "transformer.wte.weight" not in last
    assert not (set(first) - set(TIED)) & (set(last) - set(TIED))
    assert set(first) | set(last) == set(reference)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["pp2", "pp2_stages1", "pp2_tp2"])
def test_shard_then_merge_state_dicts_is_exact(outputs, name):
    report = outputs[name]
    assert report["merged_keys"] == sorted(report["reference"])
    assert report["merged_exact"] == sorted(report["reference"])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["pp2", "pp2_stages1", "pp2_tp2"])
def test_each_shard_holds_the_reference_values_under_the_stage_names(outputs, name):
    """load_state_dict(strict=True) succeeded in the probe; here: the values are the right ones,
    e.g. rank 1's first local block is block 2 (pp2) or block 1 (--stages 1) of the model."""
    for rank, info in enumerate(outputs[name]["ranks"]):
        wrong = {k: v for k, v in info["values"].items() if v == "differs"}
        assert not wrong, (rank, wrong)


@pytest.mark.slow
def test_pp_by_tp_ranks_split_the_stage_parameters_between_tensor_parallel_ranks(outputs):
    report = outputs["pp2_tp2"]
    ranks = report["ranks"]
    assert [(r["coords"]["pp"], r["coords"]["tp"]) for r in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in ranks:
        slices = {k for k, v in r["values"].items() if v == "slice"}
        assert "transformer.h.{}.mlp.c_fc.weight".format(2 * r["coords"]["pp"]) in slices, slices
    assert ranks[0]["params"].keys() == ranks[1]["params"].keys()
    assert ranks[2]["params"].keys() == ranks[3]["params"].keys()
    fc = "transformer.h.0.mlp.c_fc.weight"
    assert ranks[0]["params"][fc][0] * 2 == report["reference"][fc][0]


STATE_SET_BEFORE_THE_LOOP = textwrap.dedent("""
    import torch
    from torch import nn


    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.scale = 1.0

        def forward(self, x):
            return x + self.scale * torch.tanh(self.fc(x))


    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(4, 8)
            self.blocks = nn.ModuleList([Block() for _ in range(4)])
            self.head = nn.Linear(8, 1)

        def forward(self, x):
            h = self.embed(x)
            if x.shape[1] < 16:       # BigBird switching its layers' attention type for short inputs
                for block in self.blocks:
                    block.scale = 0.5
            for block in self.blocks:
                h = block(h)
            return self.head(h).square().mean()


    def build():
        return Model()


    def example_inputs():
        return {"x": torch.randn(4, 4)}
""")


def test_module_state_set_by_code_only_the_first_stage_runs_is_refused_at_the_write(tmp_path):
    """The prologue (stage 0 only) changes an attribute of every block: stage 1's blocks would
    keep scale 1.0 and the pipeline would compute another model (no error, a wrong result)."""
    from nnscaler_cst.analysis import analyze
    (tmp_path / "state.py").write_text(STATE_SET_BEFORE_THE_LOOP)
    graph = analyze(tmp_path / "state.py").graph
    with pytest.raises(UserError, match=r"sets blocks\.2\.scale .*only stage 0 runs; stage 1 also holds") as refused:
        stages(graph, 2)
    where = refused.value.location
    assert (Path(where.path).name, where.line) == ("state.py", STATE_SET_BEFORE_THE_LOOP.splitlines().index(
        "                block.scale = 0.5") + 1)


def test_module_state_set_where_every_stage_runs_it_is_not_refused(tmp_path):
    """The same write inside each block's own forward runs on the stage holding the block."""
    source = STATE_SET_BEFORE_THE_LOOP.replace(
        "        return x + self.scale", "        self.scale = 0.5\n        return x + self.scale").replace(
        "        if x.shape[1] < 16:       # BigBird switching its layers' attention type for short inputs\n"
        "            for block in self.blocks:\n                block.scale = 0.5\n", "")
    assert source.count("self.scale = 0.5") == 1 and "block.scale" not in source
    from nnscaler_cst.analysis import analyze
    (tmp_path / "own.py").write_text(source)
    plan = stages(analyze(tmp_path / "own.py").graph, 2)
    assert plan.block_ranges == [(0, 2), (2, 4)]


# BigBird-Pegasus: the code before the block loop calls `self.set_attention_type("original_full")`
# for short inputs, which sets the encoder's attribute and swaps every layer's attention module.
# Stage 1 holds its own copies of those layers: it must run the call too.
STATE_SET_BY_A_METHOD_BEFORE_THE_LOOP = textwrap.dedent("""
    import torch
    from torch import nn


    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.act = nn.Tanh()
            self.scale = 1.0

        def set_scale(self, value):
            self.scale = value
            self.act = nn.Sigmoid()      # a module swapped for another: not a value one could send

        def forward(self, x):
            return x + self.scale * self.act(self.fc(x))


    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(4, 8)
            self.blocks = nn.ModuleList([Block() for _ in range(4)])
            self.head = nn.Linear(8, 1)
            self.scale = 1.0

        def set_scale(self, value):
            if value == self.scale:
                return
            self.scale = value
            for block in self.blocks:
                block.set_scale(value)

        def forward(self, x):
            h = self.embed(x)
            if x.shape[1] < 16:
                self.set_scale(0.5)
            for block in self.blocks:
                h = block(h)
            return self.head(h).square().mean()


    def build():
        return Model()


    def example_inputs():
        return {"x": torch.randn(4, 4)}
""")


def test_module_state_set_by_a_method_of_self_before_the_loop_is_replayed_on_later_stages(tmp_path):
    """The call is noted as one every later stage runs too (it was refused, as the write above)."""
    from nnscaler_cst.analysis import analyze
    (tmp_path / "method.py").write_text(STATE_SET_BY_A_METHOD_BEFORE_THE_LOOP)
    plan = stages(analyze(tmp_path / "method.py").graph, 2)
    line = STATE_SET_BY_A_METHOD_BEFORE_THE_LOOP.splitlines().index("            self.set_scale(0.5)") + 1
    assert [(span.line, span.col) for span in plan.trunk.replays] == [(line, 12)]


@pytest.mark.slow
def test_module_state_set_by_a_method_of_self_before_the_loop_verifies(tmp_path):
    (tmp_path / "method.py").write_text(STATE_SET_BY_A_METHOD_BEFORE_THE_LOOP)
    result = run_cli("verify", tmp_path / "method.py", "--pp", 2, "--micro-batches", 2, "-o", tmp_path / "out")
    assert result.returncode == 0 and "PASSED" in result.stdout, result.stdout + result.stderr
    stage1 = (tmp_path / "out" / "model_stage1.py").read_text()
    assert 'pp_replayed(self, "set_scale", 0.5)  # pipeline: later stages run this call too' in stage1
    assert "h, pp_calls = pp_receive()" in stage1 and "pp_replay(self, pp_calls)" in stage1
    assert "pp_handoff(h, pp_replays(self))" in stage1


# BigBird again, as transformers writes it: the switch comes before the embeddings and rebuilds
# each layer's attention (new modules given the old weights), so ops are traced under every
# block's path before the loop calls the first block. Those ops run where the prologue runs.
LAYERS_REBUILT_BEFORE_THE_EMBEDDING = STATE_SET_BY_A_METHOD_BEFORE_THE_LOOP.replace(
    "        self.act = nn.Sigmoid()      # a module swapped for another: not a value one could send\n",
    "        fc = nn.Linear(8, 8)         # rebuilt, then given the old weights\n"
    "        fc.weight, fc.bias = self.fc.weight, self.fc.bias\n"
    "        self.fc = fc\n").replace(
    "        h = self.embed(x)\n        if x.shape[1] < 16:\n            self.set_scale(0.5)\n",
    "        if x.shape[1] < 16:\n            self.set_scale(0.5)\n        h = self.embed(x)\n")


def test_ops_a_prologue_method_traces_inside_the_blocks_stay_on_the_first_stage(tmp_path):
    from nnscaler_cst.analysis import analyze
    assert LAYERS_REBUILT_BEFORE_THE_EMBEDDING.count("fc.weight, fc.bias") == 1
    assert LAYERS_REBUILT_BEFORE_THE_EMBEDDING.index("self.set_scale(0.5)") < \
        LAYERS_REBUILT_BEFORE_THE_EMBEDDING.index("h = self.embed(x)")
    (tmp_path / "rebuilt.py").write_text(LAYERS_REBUILT_BEFORE_THE_EMBEDDING)
    graph = analyze(tmp_path / "rebuilt.py").graph
    plan = stages(graph, 2)
    embed = [n for n in graph.nodes if n.callee_path == "embed"]
    assert embed and all(plan.node_stage[n.index] == 0 for n in embed)
    assert "embed" not in plan.drop[0] and "embed" in plan.drop[1]
    assert plan.block_ranges == [(0, 2), (2, 4)]


@pytest.mark.slow
def test_a_prologue_rebuilding_the_blocks_before_the_embedding_verifies(tmp_path):
    (tmp_path / "rebuilt.py").write_text(LAYERS_REBUILT_BEFORE_THE_EMBEDDING)
    result = run_cli("verify", tmp_path / "rebuilt.py", "--pp", 2, "--micro-batches", 2, "-o", tmp_path / "out")
    assert result.returncode == 0 and "PASSED" in result.stdout, result.stdout + result.stderr


DTYPE_READ_ABOVE_THE_CUT = textwrap.dedent("""
    import torch
    from torch import nn


    class Trunk(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(4)])

        def forward(self, h):
            for block in self.blocks:
                h = torch.tanh(block(h))
            return h


    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(4, 8)
            self.trunk = Trunk()
            self.head = nn.Linear(8, 1)

        def forward(self, x):
            # every stage runs this line; only the last holds the head (FSMT's causal_mask_dtype)
            dtype = self.head.weight.dtype
            h = self.trunk(self.embed(x.to(dtype)))
            return self.head(h).square().mean()


    def build():
        return Model()


    def example_inputs():
        return {"x": torch.randn(4, 4)}
""")

HOLLOW_PROBE = r'''
import importlib, sys
sys.modules["nnscaler_cst"] = None
import torch
folder = sys.argv[1]
sys.path.insert(0, folder.rsplit("/", 1)[0])
package = importlib.import_module(folder.rsplit("/", 1)[1])
stage0 = package.build(0)[0]
assert stage0.head.weight.dtype == torch.float32 and tuple(stage0.head.weight.shape) == (1, 8)
assert not any(k.startswith("head.") for k in stage0.state_dict())
assert not any(n.startswith("head.") for n, _ in stage0.named_parameters())
try:
    stage0.head(torch.randn(2, 8))
except RuntimeError as exc:
    assert "another pipeline stage holds" in str(exc), exc
else:
    raise AssertionError("computing with a module another stage holds did not raise")
print("ok")
'''


@pytest.mark.slow     # over 5 s: keeps the quick subset under 3 minutes
def test_a_stage_reads_the_dtype_of_a_module_another_stage_holds(tmp_path):
    """Code above the cut function runs on every stage and reads `self.head.weight.dtype`; the
    first stage does not hold the head. It keeps the head's dtype, shape and device (no storage,
    not in its state dict) instead of None, whose `.weight` raised in the dry run."""
    (tmp_path / "dtype_read.py").write_text(DTYPE_READ_ABOVE_THE_CUT)
    result = run_cli(tmp_path / "dtype_read.py", "--pp", 2, "--micro-batches", 2, "-o", tmp_path / "out")
    assert result.returncode == 0, result.stdout + result.stderr
    (tmp_path / "probe.py").write_text(HOLLOW_PROBE)
    run = subprocess.run([sys.executable, str(tmp_path / "probe.py"), str(tmp_path / "out")], cwd=tmp_path,
                         capture_output=True, text=True, timeout=TIMEOUT_S)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout + run.stderr


def test_blocks_that_are_leaf_modules_put_their_calls_on_their_stages(tmp_path):
    """Blocks that are torch layers (nn.Linear in a ModuleList) have no ops of their own, only
    their calls: those calls decide the stages (every op was put on the last stage, so the
    first dropped the embedding its prologue runs)."""
    from nnscaler_cst.analysis import analyze
    (tmp_path / "leaf_blocks.py").write_text(DTYPE_READ_ABOVE_THE_CUT)
    plan = stages(analyze(tmp_path / "leaf_blocks.py").graph, 2)
    assert plan.block_ranges == [(0, 2), (2, 4)]
    assert plan.drop[0] == ["head"] and plan.shadow[1] == ["embed"]


@pytest.mark.slow
def test_a_stage_reading_the_dtype_of_a_module_another_stage_holds_verifies(tmp_path):
    (tmp_path / "dtype_read.py").write_text(DTYPE_READ_ABOVE_THE_CUT)
    result = run_cli("verify", tmp_path / "dtype_read.py", "--pp", 2, "--micro-batches", 2, "-o", tmp_path / "out")
    assert result.returncode == 0 and "PASSED" in result.stdout, result.stdout + result.stderr


# A position bias made once, above the function whose block loop is cut, by a module with a
# parameter (CpmAnt's CpmAntSegmentPositionEmbedding, T5's relative attention bias): every stage
# runs that code, and every block adds its output to its scores.
SHARED_BIAS_ABOVE_THE_CUT = textwrap.dedent("""
    import torch
    from torch import nn


    class PositionBias(nn.Module):
        def __init__(self, seq):
            super().__init__()
            self.table = nn.Parameter(torch.randn(2 * seq - 1) * 0.5)
            self.seq = seq

        def forward(self, n):
            position = torch.arange(n)
            return self.table[position[None, :] - position[:, None] + self.seq - 1]


    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, h, bias):
            scores = h @ h.transpose(-1, -2) / 8 + bias
            return h + self.proj(scores.softmax(-1) @ h)


    class Trunk(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([Block() for _ in range(4)])

        def forward(self, h, bias):
            for block in self.blocks:
                h = block(h, bias)
            return h


    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(4, 8)
            self.bias = PositionBias(6)
            self.trunk = Trunk()
            self.head = nn.Linear(8, 1)

        def forward(self, x):
            bias = self.bias(x.shape[1])
            h = self.trunk(self.embed(x), bias)
            return self.head(h).square().mean()


    def build():
        return Model()


    def example_inputs():
        return {"x": torch.randn(4, 6, 4)}
""")


def test_a_shadow_whose_output_later_stages_compute_with_is_trained_on_every_stage(tmp_path):
    """The position bias runs on every stage (code above the cut function) and the blocks of
    every stage add it: its parameter is shared, trained on every stage with the gradients summed
    over the pipeline. The embedding, which later stages run only to have the value they replace
    by the one received, stays a frozen shadow."""
    from nnscaler_cst.analysis import analyze
    (tmp_path / "shared_bias.py").write_text(SHARED_BIAS_ABOVE_THE_CUT)
    graph = analyze(tmp_path / "shared_bias.py").graph
    for pp in (2, 3):
        plan = stages(graph, pp)
        assert all(plan.shadow[s] == ["bias", "embed"] for s in range(1, pp)), plan.shadow
        assert plan.shared == [["bias.table"]] and plan.tied == [], (plan.shared, plan.tied)
    (tmp_path / "dtype_read.py").write_text(DTYPE_READ_ABOVE_THE_CUT)
    plan = stages(analyze(tmp_path / "dtype_read.py").graph, 2)
    assert plan.shadow[1] == ["embed"] and plan.shared == []


@pytest.mark.slow
@pytest.mark.parametrize("pp, args", [
    (2, ("--micro-batches", 2)),
    (3, ("--micro-batches", 2)),
    (2, ("--micro-batches", 4, "--schedule", "interleaved")),    # two copies on each rank
    (2, ("--micro-batches", 2, "--dp", 2, "--zero", 1)),         # gradients are views of one buffer
], ids=["pp2", "pp3", "pp2-interleaved", "pp2xdp2-zero1"])
def test_a_bias_module_above_the_cut_that_every_block_reads_verifies(tmp_path, pp, args):
    """Each stage's blocks contribute to the bias table's gradient: frozen on the later stages,
    the gradient of their blocks was dropped (and their copy went stale after the first step),
    the cpmant PP=2 result differed from the single-device run."""
    (tmp_path / "shared_bias.py").write_text(SHARED_BIAS_ABOVE_THE_CUT)
    result = run_cli("verify", tmp_path / "shared_bias.py", "--pp", pp, *args, "-o", tmp_path / "out", "--json")
    outcome = json.loads(result.stdout[result.stdout.find("{"):])
    assert result.returncode == 0 and outcome["passed"] is True, outcome
    rank_files = sorted((tmp_path / "out").glob("model_stage*.py"))
    assert len(rank_files) == pp and all("SHARED_PARAMETERS = ['bias.table']" in f.read_text() for f in rank_files)


# The function whose block loop is cut sets a value before the loop only under a config flag
# (MVP's `if self.use_prompt: self_attn_prompt = self.self_attn_prompt(prompt_ids)`), and the loop
# passes it to every block under the same flag.
SET_UNDER_A_FLAG = textwrap.dedent("""
    import torch
    from torch import nn

    USE_PROMPT = {use_prompt}


    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, h, prompt=None):
            if prompt is not None:
                h = h + prompt
            return h + torch.tanh(self.proj(h))


    class Encoder(nn.Module):
        def __init__(self, use_prompt):
            super().__init__()
            self.embed = nn.Linear(4, 8)
            self.use_prompt = use_prompt
            if use_prompt:
                self.prompt = nn.Embedding(4, 8)
            self.blocks = nn.ModuleList([Block() for _ in range(4)])

        def forward(self, x):
            h = self.embed(x)
            if self.use_prompt:
                prompt = self.prompt(torch.arange(4))
            for idx, block in enumerate(self.blocks):
                h = block(h, prompt=(prompt[idx] if self.use_prompt else None))
            return h


    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = Encoder(USE_PROMPT)
            self.head = nn.Linear(8, 1)

        def forward(self, x):
            return self.head(self.encoder(x)).square().mean()


    def build():
        return Model()


    def example_inputs():
        return {{"x": torch.randn(4, 4)}}
""")


def test_a_value_set_before_the_loop_only_under_a_flag_is_bound_to_none_first():
    import libcst as cst
    from nnscaler_cst.plan.pipeline import handoff_variables, maybe_unset
    encoder = next(c for c in cst.parse_module(SET_UNDER_A_FLAG.format(use_prompt=False)).body
                   if isinstance(c, cst.ClassDef) and c.name.value == "Encoder")
    function = next(f for f in encoder.body.body if f.name.value == "forward")
    handoff = handoff_variables(function, 2)
    assert "prompt" in handoff and maybe_unset(function, 2, handoff) == ["prompt"]
    # set on every path (both branches, or a branch that raises), or a parameter: nothing to bind
    both = textwrap.dedent("""
        def forward(self, h, mask=None):
            if self.flag:
                p = 1
            elif mask is None:
                raise ValueError("no mask")
            else:
                p = 2
            for block in self.blocks:
                h, mask = block(h, p, mask)
            return h
    """)
    function = cst.parse_module(both).body[0]
    handoff = handoff_variables(function, 1)
    assert set(handoff) >= {"p", "mask", "h"} and maybe_unset(function, 1, handoff) == []


def test_a_pipeline_cut_of_a_loop_reading_a_value_set_under_a_false_flag_writes(tmp_path):
    """The first stage hands on what the code before the loop set; under a false flag that
    value was never set, and the hand-off raised UnboundLocalError in the dry run (MVP at PP=2)."""
    (tmp_path / "flag.py").write_text(SET_UNDER_A_FLAG.format(use_prompt=False))
    result = run_cli(tmp_path / "flag.py", "--pp", 2, "--micro-batches", 2, "-o", tmp_path / "out")
    assert result.returncode == 0, result.stdout + result.stderr
    stage0 = (tmp_path / "out" / "model_stage0.py").read_text()
    assert stage0.count("prompt = None  # pipeline: set before the hand-off only under a condition") == 1


@pytest.mark.slow
@pytest.mark.parametrize("use_prompt", [False, True])
def test_a_value_set_under_a_flag_before_the_loop_verifies(tmp_path, use_prompt):
    (tmp_path / "flag.py").write_text(SET_UNDER_A_FLAG.format(use_prompt=use_prompt))
    result = run_cli("verify", tmp_path / "flag.py", "--pp", 2, "--micro-batches", 2, "-o", tmp_path / "out")
    assert result.returncode == 0 and "PASSED" in result.stdout, result.stdout + result.stderr


SHARED_BY_THE_EARLY_BLOCKS = '''
import torch
from torch import nn


class PosConv(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        return x + self.proj(x)


class Pre(nn.Module):
    def __init__(self, dim, shared_pos):
        super().__init__()
        self.pos = shared_pos          # one module object under every early block's name (CoaT's cpe)
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        return x + self.fc(self.pos(x))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.pos = PosConv(8)
        self.pre = nn.ModuleList([Pre(8, self.pos) for _ in range(2)])
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(4)])

    def forward(self, x):
        for layer in self.pre:
            x = layer(x)
        for block in self.blocks:
            x = x + torch.relu(block(x))
        return x.square().mean()


def build():
    return Model()


def example_inputs():
    return (torch.randn(4, 8),)
'''


def test_a_module_shared_by_the_blocks_before_the_cut_is_dropped_once_by_later_stages(tmp_path):
    """One module object sits at the model's top and in every early block (CoaT's shared
    convolutional position encoding); only the early blocks call it, before the pipelined
    blocks. The later stage drops it under all its names: it was taken for code above the cut
    (its top-level name's holder is the model), kept as a shadow and also dropped, and the
    second name's unlink raised in build() (`proj` is not an nn.Module)."""
    from nnscaler_cst.analysis import analyze
    (tmp_path / "shared_early.py").write_text(SHARED_BY_THE_EARLY_BLOCKS)
    plan = stages(analyze(tmp_path / "shared_early.py").graph, 2)
    assert plan.shadow[1] == [] and {"pos.proj", "pre.0.pos.proj", "pre.1.pos.proj"} <= set(plan.drop[1])
    result = run_cli(tmp_path / "shared_early.py", "--pp", 2, "--micro-batches", 2, "-o", tmp_path / "out")
    assert result.returncode == 0, result.stdout + result.stderr
