"""Gradient accumulation without a pipeline (`--micro-batches M` at pp = 1): forward_backward runs
this rank's share of the batch as M slices of dim 0, one after another, each slice's loss scaled
so that they add up to the share's, and the gradients are reduced once a step (ZeRO-2 and 3
reduce-scatter each slice's into the shard's gradient, which adds them up). BatchNorm normalises
each micro-batch by its own statistics, as under a pipeline, and verify compares with one device
accumulating alike. `--plan auto` searches M at pp = 1 too, trading time for activations.
A count M that does not divide the per-rank batch is refused (tests/test_bad_input.py).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO_ROOT as REPO
from nnscaler_cst import cli
from test_stage_chains import MIXED


def verify(*args) -> dict:
    env = {**os.environ, "COLUMNS": "200", "PYTHONWARNINGS": "ignore"}
    result = subprocess.run([sys.executable, "-m", "nnscaler_cst.cli", "verify", *map(str, args), "--json"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    start = result.stdout.find("{")
    assert start >= 0, f"no JSON report; exit {result.returncode}\n{result.stdout}\n{result.stderr[-3000:]}"
    outcome = json.loads(result.stdout[start:])
    assert result.returncode == 0 and outcome["passed"] is True, outcome
    return outcome


def test_a_searched_plan_that_needs_less_memory_accumulates_and_the_output_runs_the_micro_batches(tmp_path, capsys):
    """Just below the fastest plan's memory, --plan auto keeps the mesh and runs 2 micro-batches
    (half the activations); the rewrite emits what it chose."""
    from nnscaler_cst.analysis import analyze
    from nnscaler_cst.plan.auto import search_auto
    from nnscaler_cst.plan.cost import load_cluster
    fastest = search_auto(analyze(REPO / "fixtures" / "mlp.py").graph, 2, load_cluster("cpu-gloo"), [], None)
    assert fastest.config.micro_batches == 1
    code = cli.main([str(REPO / "fixtures" / "mlp.py"), "--plan", "auto", "--devices", "2",
                     "--memory-budget", str(int(fastest.best.memory) - 1), "-o", str(tmp_path / "out")])
    assert code in (0, None), capsys.readouterr()
    train = (tmp_path / "out" / "__init__.py").read_text()
    assert "pp=1,micro-batches=2" in train.splitlines()[1] and "\nMICRO_BATCHES = 2\n" in train
    assert "    for inputs in micro_batches(batch_share(batch)):" in train
    assert "grad_buckets(model)" not in train      # reduced once, after the last micro-batch


@pytest.mark.slow
def test_zero_2_reduce_scatters_every_micro_batch_into_the_shard_and_trains_like_one_device(tmp_path):
    outcome = verify("fixtures/gpt.py", "--dp", 2, "--zero", 2, "--micro-batches", 2, "-o", tmp_path / "out")
    for rank in outcome["collectives"]:     # each step: 2 backwards' reduce-scatters, 1 gather of the shards
        assert rank["reduce_scatter"] == 2 * rank["all_gather"] > 0, rank


@pytest.mark.slow
def test_batch_norm_under_tensor_parallel_accumulation_normalises_each_micro_batch_like_one_device(tmp_path):
    """Each micro-batch's own statistics: a step that ran the share in one pass would differ from
    the reference (which accumulates over the same micro-batches) in gradients and running stats."""
    model = tmp_path / "model.py"
    model.write_text(MIXED.lstrip())
    outcome = verify(model, "--tp", 2, "--micro-batches", 2, "-o", tmp_path / "out")
    assert outcome["max_buffer_error"] is not None
    train = (tmp_path / "out" / "__init__.py").read_text()
    assert "\nMICRO_BATCHES = 2\n" in train and "\nBATCH_STATISTICS_PER_MICRO_BATCH = True" in train
