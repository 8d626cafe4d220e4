"""Modules the traced step never runs, under a pipeline (issue 26: torchtitan's Kimi K2.7).

A vision-language model trained on text alone never calls its vision tower; a head may hold a
projection only some inputs use. No stage runs such a module, yet its parameters belong to the
model: the merged state dict (what `verify` compares, what a checkpoint saves) must have them.
One stage holds each: the first one whose program holds its parent.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

TEXT_ONLY_VLM = textwrap.dedent('''
    import torch
    import torch.nn as nn


    class Block(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.fc = nn.Linear(d, d)

        def forward(self, x):
            return x + torch.tanh(self.fc(x))


    class Vision(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.pos_embed = nn.Parameter(torch.zeros(4, d))
            self.patch = nn.Linear(3, d)

        def forward(self, pixels):
            return self.patch(pixels) + self.pos_embed


    class Head(nn.Module):
        def __init__(self, d, vocab):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(d))
            self.proj = nn.Linear(d, vocab)
            self.image_proj = nn.Linear(d, d)     # used with pixels only

        def forward(self, x):
            return self.proj(x * self.scale)


    class Model(nn.Module):
        def __init__(self, vocab=16, d=8, n=4):
            super().__init__()
            self.vision = Vision(d)
            self.embed = nn.Embedding(vocab, d)
            self.blocks = nn.ModuleList([Block(d) for _ in range(n)])
            self.head = Head(d, vocab)

        def forward(self, tokens, pixels=None):
            x = self.embed(tokens)
            if pixels is not None:
                x = torch.cat([self.vision(pixels), x], dim=1)
            for block in self.blocks:
                x = block(x)
            return self.head(x)


    def build():
        return Model()


    def example_inputs():
        return (torch.randint(0, 16, (4, 6)),)


    def loss(output):
        return output.square().mean()
''')

ROUND_TRIP = '''
import importlib, sys, torch
sys.path.insert(0, sys.argv[1])
package = importlib.import_module("out")
entry = importlib.import_module("text_only_vlm")
torch.manual_seed(0)
reference = entry.build().state_dict()
shards = [package.shard_state_dict(reference, rank) for rank in range(2)]
merged = package.merge_state_dicts(shards)
print(sorted(set(reference) - set(merged)))
'''


def test_a_module_no_stage_runs_is_held_by_the_first_stage_holding_its_parent(tmp_path):
    """The vision tower: the model holds it on every stage, so stage 0 keeps it; the head's image
    projection: only the last stage holds the head, so that stage keeps it."""
    from nnscaler_cst.analysis import analyze
    from nnscaler_cst.plan.pipeline import plan_stages
    (tmp_path / "text_only_vlm.py").write_text(TEXT_ONLY_VLM)
    plan = plan_stages(analyze(tmp_path / "text_only_vlm.py").graph, 2)
    assert "vision" not in plan.drop[0] and "vision" in plan.drop[1]
    assert "head" in plan.drop[0] and "head.image_proj" not in plan.drop[1]


@pytest.mark.slow
def test_the_merged_state_dict_of_a_pipeline_has_the_unused_modules(tmp_path):
    (tmp_path / "text_only_vlm.py").write_text(TEXT_ONLY_VLM)
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    rewrite = subprocess.run([sys.executable, "-m", "nnscaler_cst.cli", "text_only_vlm.py", "--pp", "2",
                              "--micro-batches", "2", "-o", "out"], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=300)
    assert rewrite.returncode == 0, rewrite.stdout + rewrite.stderr
    (tmp_path / "round_trip.py").write_text(ROUND_TRIP)
    probe = subprocess.run([sys.executable, "round_trip.py", str(tmp_path)], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=300)
    assert probe.returncode == 0, probe.stdout + probe.stderr
    assert probe.stdout.strip() == "[]"
