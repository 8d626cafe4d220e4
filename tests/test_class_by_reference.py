"""Spec: a library class the rewrite changes is built as the rewritten class whatever route reaches it.

litgpt's Config holds its layers' classes as values resolved from names at run time
(`config.norm_class` is `partial(RMSNorm, ...)`, `config.mlp_class` is `getattr(litgpt.model,
name)`), and its Block builds `config.norm_class(...)` and `config.mlp_class(config)`. The
Block's code, copied into the output, still reaches the installed classes that way: each rank's
build() must nevertheless construct the rewritten, sharded ones. A tiny package of this module's
own in that pattern, its layers in one file or in two (the output holds them as the modeling file
or as mirrors), rewritten at --tp 2 in-process; the dry run builds every rank.
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
            from . import {layers}
            return getattr({layers}, self.mlp_class_name)

        @property
        def norm_class(self):
            from .{layers} import Norm
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
    import torch.nn as nn
    {imports}


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

# layout -> the package's files: the layers with the model (the output's model file holds them) or
# in a file of their own (the output mirrors both files)
LAYOUTS = {
    "one-file": {"config.py": CONFIG.format(WIDTH=WIDTH, HIDDEN=HIDDEN, layers="model"),
                 "model.py": LAYERS + MODEL.format(imports="")},
    "two-files": {"config.py": CONFIG.format(WIDTH=WIDTH, HIDDEN=HIDDEN, layers="layers"),
                  "layers.py": LAYERS,
                  "model.py": MODEL.format(imports="")},
}


def _dedent(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """layout -> its output package at --tp 2, imported."""
    root = tmp_path_factory.mktemp("by_reference")
    sys.path.insert(0, str(root))
    made = {}

    def get(layout: str):
        if layout not in made:
            package = f"refs_{layout.replace('-', '_')}"
            (root / package).mkdir()
            (root / package / "__init__.py").write_text("")
            for name, text in LAYOUTS[layout].items():
                (root / package / name).write_text(_dedent(text))
            entry = root / f"entry_{package}.py"
            entry.write_text(_dedent(ENTRY.format(package=package, WIDTH=WIDTH)))
            cwd = Path.cwd()
            os.chdir(root)
            try:
                write_output(root / f"out_{package}", rewrite(analyze(entry), PlanRequest(tp=2)).files)
            finally:
                os.chdir(cwd)
            made[layout] = (__import__(f"out_{package}"), package)
        return made[layout]
    yield get
    sys.path.remove(str(root))
    for name in [m for m in sys.modules if m.split(".")[0].startswith(("refs_", "out_refs_"))]:
        del sys.modules[name]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_class_a_config_resolves_is_built_rewritten_and_split(outputs, layout):
    out, package = outputs(layout)
    for rank in range(out.WORLD_SIZE):
        model = out.build(rank)
        mlp = model.blocks[0].mlp
        assert not type(mlp).__module__.startswith(package), type(mlp)      # the rewritten class
        assert mlp.fc_1.weight.shape == (HIDDEN // 2, WIDTH) and mlp.fc_2.weight.shape == (HIDDEN // 2, WIDTH)
        assert mlp.proj.weight.shape == (WIDTH, HIDDEN // 2)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_installed_classes_are_left_as_they_were(outputs, layout):
    out, package = outputs(layout)
    out.build(0)
    config = sys.modules[f"{package}.config"].Config()
    model = sys.modules[f"{package}.model"].Model(config)
    assert type(model.blocks[0].mlp).__module__.startswith(package)
    assert model.blocks[0].mlp.fc_1.weight.shape == (HIDDEN, WIDTH)
