"""Megatron's sequence parallelism (`--sequence-parallel`, issue 9): the plan table
rules/plans/sequence_parallel.toml runs the norms on slices of the sequence between tensor-parallel
regions; a row-parallel result leaves its region by a reduce-scatter and a column-parallel layer is
entered by an all-gather, each one named collective in the emitted code. Other plans keep their
all-reduces. The gloo verify is slow.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from nnscaler_cst.analysis import analyze
from nnscaler_cst.materialize.conversions import Step, conversion, fused_collectives
from nnscaler_cst.plan.layouts import P, R, shard
from nnscaler_cst.rewrite import PlanRequest, rewrite

REPO = Path(__file__).resolve().parents[1]
GPT = REPO / "fixtures" / "gpt.py"
TIMEOUT_S = 600


def run_cli(*args) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200", "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "nnscaler_cst.cli", *map(str, args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S)


def model_source(files: dict[str, str]) -> str:
    return next(text for name, text in sorted(files.items()) if name.startswith("model") and name.endswith(".py"))


def test_a_partial_sum_to_a_slice_is_one_reduce_scatter_when_the_plan_fuses():
    with fused_collectives(True):
        assert conversion(P, shard(1), consumer_split=False, requires_grad=True) == [Step("reduce_scatter", 1)]
        assert conversion(shard(1), R, consumer_split=True, requires_grad=True) == [Step("all_gather", 1)]
        # fused q|k|v blocks keep the pair
        assert conversion(P, shard(1, 3), consumer_split=False, requires_grad=True) == [
            Step("reduce"), Step("scatter", 1, 3)]
    assert conversion(P, shard(1), consumer_split=False, requires_grad=True) == [Step("reduce"), Step("scatter", 1)]
    assert conversion(shard(1), R, consumer_split=True, requires_grad=True) == [Step("gather", 1), Step("copy")]


@pytest.fixture(scope="module")
def gpt():
    return analyze(GPT)


@pytest.mark.slow
def test_norms_run_on_sequence_slices_between_reduce_scatter_and_all_gather(gpt):
    result = rewrite(gpt, PlanRequest(tp=2, sequence_parallel=True))
    assert result.plan.describe() == "sequence_parallel tp=2 dp=1 pp=1"
    text = model_source(result.files)
    # LayerNorm runs on this rank's tokens; the column-parallel layers after it get them all
    assert "return tp_all_gather(F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5), TP, dim=1)" \
           "  # tp_all_gather: fwd: all-gather, bwd: reduce-scatter" in text
    # the row-parallel projections leave by a reduce-scatter along the sequence, bias added once after it
    assert "x = tp_reduce_scatter(torch.nn.functional.linear(x, self.c_proj.weight), TP, dim=1) + self.c_proj.bias" in text
    assert "tp_reduce_scatter(torch.nn.functional.linear(y, self.c_proj.weight), TP, dim=1) + self.c_proj.bias" in text
    assert "tp_reduce(" not in text and "tp_copy(" not in text
    # the norms' weights and the biases added on slices see a slice of the tokens: summed after backward
    partial = re.search(r"TP_PARTIAL_GRADS = (\[.*\])", result.files["__init__.py"]).group(1)
    assert "'transformer.h.0.ln_1.weight'" in partial and "'transformer.h.3.mlp.c_proj.bias'" in partial


@pytest.mark.slow
def test_megatron_keeps_its_all_reduces(gpt):
    text = model_source(rewrite(gpt, PlanRequest(tp=2)).files)
    assert "tp_reduce_scatter(" not in text and "tp_all_gather(" not in text
    assert "tp_reduce(torch.nn.functional.linear(x, self.c_proj.weight), TP) + self.c_proj.bias" in text


@pytest.mark.slow
def test_sequence_parallel_without_tensor_parallel_is_refused(tmp_path):
    out = tmp_path / "out"
    result = run_cli(GPT, "--sequence-parallel", "-o", out)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith("error: --sequence-parallel needs --tp N with N > 1"), result.stderr
    assert "hint:" in result.stderr
    assert not out.exists()


@pytest.mark.slow
def test_sequence_parallel_trains_like_the_single_device_model(tmp_path):
    folder = tmp_path / "gpt_sp"
    result = run_cli("verify", GPT, "--tp", 2, "--sequence-parallel", "-o", folder, "--json", "--steps", 2)
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads(result.stdout)["passed"]
    text = "".join(p.read_text() for p in folder.glob("model*.py"))
    assert "tp_reduce_scatter(" in text and "tp_all_gather(" in text
