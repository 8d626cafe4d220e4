"""Spec: a library class the rewrite changes is built as the rewritten class whatever route reaches it.

litgpt's Config holds its layers' classes as values resolved from names at run time
(`config.norm_class` is `partial(RMSNorm, ...)`, `config.mlp_class` is `getattr(litgpt.model,
name)`), and its Block builds `config.norm_class(...)` and `config.mlp_class(config)`. The
Block's code, copied into the output, still reaches the installed classes that way: each rank's
build() must nevertheless construct the rewritten, sharded ones. A tiny package of this module's
own in that pattern, rewritten at --tp 2 in-process; the dry run builds every rank.
"""
from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest

from nnscaler_cst.analysis import analyze
from nnscaler_cst.emit.output import write_output
from nnscaler_cst.rewrite import PlanRequest, rewrite

WIDTH, HIDDEN = 16, 32

CONFIG = """
    from functools import partial


    class Config:
        def __init__(self, width={WIDTH}, hidden={HIDDEN}, mlp_class_name="GatedMLP"):
            self.width = width
            self.hidden = hidden
            self.mlp_class_name = mlp_class_name

        @property
        def mlp_class(self):
            from . import model
            return getattr(model, self.mlp_class_name)

        @property
        def norm_class(self):
            from .model import Norm
            return partial(Norm, eps=1e-5)
"""

LAYERS = """
    import torch
    import torch.nn as nn


    class Norm(nn.Module):
        def __init__(self, size, eps):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(size))
            self.eps = eps

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


    class GatedMLP(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.fc_1 = nn.Linear(config.width, config.hidden, bias=False)
            self.fc_2 = nn.Linear(config.width, config.hidden, bias=False)
            self.proj = nn.Linear(config.hidden, config.width, bias=False)

        def forward(self, x):
            return self.proj(torch.nn.functional.silu(self.fc_1(x)) * self.fc_2(x))
"""

MODEL = """


    class Block(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.norm = config.norm_class(config.width)
            self.mlp = config.mlp_class(config)

        def forward(self, x):
            return x + self.mlp(self.norm(x))


    class Model(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.blocks = nn.ModuleList(Block(config) for _ in range(2))
            self.head = nn.Linear(config.width, 1)

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return self.head(x).pow(2).mean()
"""

ENTRY = """
    import torch
    from {package}.config import Config
    from {package}.model import Model


    def build():
        return Model(Config())


    def example_inputs():
        return (torch.randn(4, 8, {WIDTH}),)
"""

FILES = {"config.py": CONFIG.format(WIDTH=WIDTH, HIDDEN=HIDDEN), "model.py": LAYERS + MODEL}


def _dedent(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


@pytest.fixture(scope="module")
def output(tmp_path_factory):
    """The package's output at --tp 2, imported."""
    root = tmp_path_factory.mktemp("by_reference")
    (root / "refs_lib").mkdir()
    (root / "refs_lib" / "__init__.py").write_text("")
    for name, text in FILES.items():
        (root / "refs_lib" / name).write_text(_dedent(text))
    entry = root / "entry_refs.py"
    entry.write_text(_dedent(ENTRY.format(package="refs_lib", WIDTH=WIDTH)))
    sys.path.insert(0, str(root))
    cwd = Path.cwd()
    os.chdir(root)
    try:
        write_output(root / "out_refs", rewrite(analyze(entry), PlanRequest(tp=2)).files)
    finally:
        os.chdir(cwd)
    yield __import__("out_refs")
    sys.path.remove(str(root))
    for name in [m for m in sys.modules if m.split(".")[0] in ("refs_lib", "out_refs")]:
        del sys.modules[name]


def test_a_class_a_config_resolves_is_built_rewritten_and_split(output):
    for rank in range(output.WORLD_SIZE):
        mlp = output.build(rank).blocks[0].mlp
        assert type(mlp) is output.rank_module(rank).GatedMLP
        assert mlp.fc_1.weight.shape == (HIDDEN // 2, WIDTH) and mlp.fc_2.weight.shape == (HIDDEN // 2, WIDTH)
        assert mlp.proj.weight.shape == (WIDTH, HIDDEN // 2)


def test_the_installed_classes_are_left_as_they_were(output):
    output.build(0)
    model = sys.modules["refs_lib.model"].Model(sys.modules["refs_lib.config"].Config())
    assert type(model.blocks[0].mlp).__module__ == "refs_lib.model"
    assert model.blocks[0].mlp.fc_1.weight.shape == (HIDDEN, WIDTH)
