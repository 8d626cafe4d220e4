"""Co-shard: n = C·|tp| pieces of an op, C consecutive ones on each device, run one after
another and recomputed in backward (nnScaler's coshard plan).

The constraint is written in a plan table (`rules/plans/coshard.toml`, or a user's own) or
as a `# nnscaler: coshard=C` annotation; the plan IR carries it as op_trans n = C·|tp|,
op_assign of C pieces per device and op_order between them; the rewrite emits
`coshard(fn, C, in_dims=..., out_dims=...)(args)`, whose pieces `_comm.coshard` runs under
activation checkpointing. The gloo runs are marked slow.
"""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from nnscaler_cst.errors import Location
from nnscaler_cst.plan.tables import pieces_per_device
from nnscaler_cst.runtime._comm import coshard

REPO = Path(__file__).resolve().parents[1]
GPT = REPO / "fixtures" / "gpt.py"


def cli(*args, cwd: Path = REPO) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200", "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "nnscaler_cst.cli", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


def line_with(path: Path, needle: str) -> tuple[int, str]:
    found = [(i, line) for i, line in enumerate(path.read_text().splitlines(), 1) if needle in line]
    assert len(found) == 1, f"{needle!r} on {len(found)} lines of {path.name}"
    return found[0]


# ---- the runtime piece ------------------------------------------------------------------------
def _attend(q, k, v):
    """Attention written out: its T×T scores are what co-sharding keeps from piling up."""
    scores = (q @ k.transpose(-2, -1)) / q.size(-1) ** 0.5
    return scores.softmax(-1) @ v


def _saved_bytes(fn, *args) -> tuple[torch.Tensor, int]:
    """Bytes autograd keeps for backward while `fn` runs (distinct storages, counted once)."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    return out, sum(storages.values())


@pytest.mark.parametrize("chunks", [2, 4])
def test_coshard_pieces_compute_the_same_values_and_gradients(chunks):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 8, 16, 8, requires_grad=True) for _ in range(3))
    whole = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    pieces = coshard(F.scaled_dot_product_attention, chunks, in_dims=(1, 1, 1), out_dims=1)(q, k, v, is_causal=True)
    torch.testing.assert_close(pieces, whole)
    for a, b in zip(torch.autograd.grad(whole.square().sum(), (q, k, v)),
                    torch.autograd.grad(pieces.square().sum(), (q, k, v))):
        torch.testing.assert_close(a, b)


def test_tuple_results_are_joined_and_none_passes_through():
    x = torch.randn(2, 6, 4)
    out, extra = coshard(lambda t: (t * 2, None), 3, in_dims=(1,), out_dims=1)(x)
    torch.testing.assert_close(out, x * 2)
    assert extra is None


def test_coshard_keeps_only_the_inputs_for_backward_measured():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 8, 64, 8, requires_grad=True) for _ in range(3))
    whole, whole_bytes = _saved_bytes(_attend, q, k, v)
    pieces, piece_bytes = _saved_bytes(coshard(_attend, 2, in_dims=(1, 1, 1), out_dims=1), q, k, v)
    torch.testing.assert_close(pieces, whole)
    inputs = 3 * q.numel() * q.element_size()
    scores = 2 * 8 * 64 * 64 * 4                                # one (b, h, T, T) float tensor
    assert whole_bytes >= inputs + scores                       # the probabilities are kept for `@ v`
    assert piece_bytes <= inputs                                # only the pieces' inputs (views of q, k, v)


# ---- the plan ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gpt_coshard(tmp_path_factory):
    out = tmp_path_factory.mktemp("coshard") / "out"
    result = cli("rewrite", GPT, "--plan", "coshard", "--tp", "2", "-o", out)
    assert result.returncode == 0, result.stderr
    return out


@pytest.mark.slow
def test_the_plan_ir_holds_cpieces_per_device_in_order(gpt_coshard):
    plan = json.loads((gpt_coshard / "plan.json").read_text())
    number, _ = line_with(GPT, "F.softmax(")
    softmax = [t for t in plan["op_trans"] if t["callee"] == "torch.nn.functional.softmax"]
    assert len(softmax) == 1 and softmax[0]["n"] == 4 and softmax[0]["site"].startswith(f"fixtures/gpt.py:{number}:")
    site = softmax[0]["site"]
    assert [(a["piece"], a["devices"]) for a in plan["op_assign"] if a["site"] == site] == [
        (0, [0]), (1, [0]), (2, [1]), (3, [1])]
    assert [(o["before"], o["after"], o["device"]) for o in plan["op_order"] if o["before"].startswith(site)] == [
        (f"{site}#0", f"{site}#1", 0), (f"{site}#2", f"{site}#3", 1)]
    others = [t for t in plan["op_trans"] if t["n"] not in (1, 2) and t["site"] != site]
    assert others == []                                         # everything else stays Megatron


@pytest.mark.slow
def test_the_attention_core_runs_as_a_local_function_in_pieces(gpt_coshard):
    """From the softmax the region grows over the statements that work head by head: the scores,
    the mask, the softmax, dropout and `att @ v`; the view with a local size stops it."""
    source = (gpt_coshard / "model.py").read_text()
    start = source.index("        def _y_in_pieces(")
    block = source[start:source.index("\n", source.index("= coshard(_y_in_pieces", start))].splitlines()
    assert block[0].startswith("        def _y_in_pieces(k, q, v):  # coshard: 2 pieces per device")
    assert [line.strip().split(" = ")[0] for line in block[1:-1]] == ["att", "att", "att", "att", "y", "return y"]
    assert block[-1].strip() == "y = coshard(_y_in_pieces, 2, in_dims=(1, 1, 1), out_dims=1)(k, q, v)"
    ast.parse(source)


@pytest.mark.slow
def test_a_source_annotation_co_shards_its_line(tmp_path):
    model = tmp_path / "gpt_model.py"
    text = GPT.read_text()
    _, line = line_with(GPT, "F.softmax(")
    model.write_text(text.replace(line, line + "  # nnscaler: coshard=2"))
    out = tmp_path / "out"
    result = cli("rewrite", model, "--tp", "2", "-o", out, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    source = (out / "model.py").read_text()
    assert "y = coshard(_y_in_pieces, 2, in_dims=(1, 1, 1), out_dims=1)(k, q, v)" in source
    _, rewritten = line_with(out / "model.py", "F.softmax")
    assert "# nnscaler: coshard=2" in rewritten                  # the user's comment is kept


@pytest.mark.slow
def test_a_region_that_needs_communication_is_refused(tmp_path):
    model = tmp_path / "gpt_model.py"
    _, line = line_with(GPT, "self.c_proj(y)")
    model.write_text(GPT.read_text().replace(line, line + "  # nnscaler: coshard=2", 1))
    result = cli("rewrite", model, "--tp", "2", "-o", tmp_path / "out", cwd=tmp_path)
    assert result.returncode == 2 and "gpt_model.py:" in result.stderr and "co-shard" in result.stderr, result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_too_many_pieces_for_the_heads_are_refused_with_the_numbers(tmp_path):
    model = tmp_path / "gpt_model.py"
    _, line = line_with(GPT, "F.softmax(")
    model.write_text(GPT.read_text().replace(line, line + "  # nnscaler: coshard=4"))   # 4 heads, tp=2
    result = cli("rewrite", model, "--tp", "2", "-o", tmp_path / "out", cwd=tmp_path)
    number, _ = line_with(model, "coshard=4")
    assert result.returncode == 2
    assert f"gpt_model.py:{number}:" in result.stderr and "2x4 pieces" in result.stderr and "has 2 along dim 1" in result.stderr, result.stderr
    assert not (tmp_path / "out").exists()


def test_n_is_written_aspieces_per_device_times_the_axis():
    where = Location("t.toml", 1)
    assert [pieces_per_device(n, "tp", where) for n in (None, "|tp|", "2*|tp|", "|tp| * 3", "2·|tp|")] == [
        1, 1, 2, 3, 2]


@pytest.mark.slow
@pytest.mark.parametrize("n, ok", [("2·|tp|", True), ("|tp|+1", False), ("2*|dp|", False)])
def test_n_is_one_or_cpieces_per_device(tmp_path, n, ok):
    table = tmp_path / "mine.toml"
    table.write_text(f'[plan]\nname = "mine"\naxes = ["tp"]\nextends = "megatron"\n\n[[constraint]]\n'
                     f'id = "pieces"\nselect = {{ callee = "torch.nn.functional.softmax" }}\n'
                     f'op_trans = {{ axis = "tp", algo = "split", n = "{n}" }}\n')
    result = cli("plan", GPT, "--plan", table, "--tp", "2", "--json", cwd=tmp_path)
    if ok:
        assert result.returncode == 0, result.stderr
        ops = json.loads(result.stdout[result.stdout.find("{"):])["ops"]
        softmax = next(op for op in ops if op["callee"] == "torch.nn.functional.softmax")
        assert softmax["n"] > 2 and softmax["n"] % 2 == 0
    else:
        assert result.returncode == 2 and "mine.toml:7:" in result.stderr and "n = C*|tp|" in result.stderr


# ---- proven on gloo -----------------------------------------------------------------------------
@pytest.mark.slow
# The GPT fixture's scores-to-`att @ v` region, and GPT-2's attention call inside an `else:`
# (a tuple result, read after the if/else).
@pytest.mark.parametrize("fixture", ["gpt.py", "hf_gpt2.py"])
def test_coshard_trains_like_the_single_device_run(tmp_path, fixture):
    result = cli("verify", REPO / "fixtures" / fixture, "--plan", "coshard", "--tp", "2", "-o", tmp_path / "out",
                 "--json")
    outcome = json.loads(result.stdout[result.stdout.find("{"):])
    assert result.returncode == 0 and outcome["passed"] is True, outcome
    assert "coshard(" in (tmp_path / "out" / "model.py").read_text()
