"""Spec: blocks held in an nn.ModuleDict and run by a loop the model inherits from a base class in
another file are pipelined like a ModuleList's.

torchtitan's Llama3Model (llama3/model.py) subclasses a Decoder (common/decoder.py) whose
__init__ fills `self.layers = ModuleDict()` under "0", "1", ... and whose forward runs
`for layer in self.layers.values(): h = layer(h, ...)`. The base class's file is the model's own
code (the loop is there), and each stage keeps its blocks in the ModuleDict, numbered from 0 as a
ModuleList's would be. A tiny package of this module's own in that pattern, its base class in a
file of its own, rewritten at --pp 2 in-process (the dry run builds both stages and loads their
shards); one tiny gloo run verifies it (slow).
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from nnscaler_cst.analysis import analyze
from nnscaler_cst.emit.output import write_output
from nnscaler_cst.rewrite import PlanRequest, rewrite

WIDTH, LAYERS = 8, 4

PACKAGE = {
    "__init__.py": "",
    "base.py": """
        import torch.nn as nn


        class Decoder(nn.Module):
            def __init__(self, width, layers):
                super().__init__()
                self.embed = nn.Linear(width, width)
                self.layers = nn.ModuleDict()
                for i in range(layers):
                    self.layers[str(i)] = self.make_block(width)
                self.head = nn.Linear(width, 1)

            def forward(self, x):
                h = self.embed(x)
                for layer in self.layers.values():
                    h = layer(h)
                return self.head(h).pow(2).mean()
    """,
    "model.py": """
        import torch
        import torch.nn as nn

        from .base import Decoder


        class Block(nn.Module):
            def __init__(self, width):
                super().__init__()
                self.fc = nn.Linear(width, width)

            def forward(self, x):
                return x + torch.tanh(self.fc(x))


        class TinyDecoder(Decoder):
            def make_block(self, width):
                return Block(width)
    """,
}

ENTRY = f"""
    import torch
    from dictpkg.model import TinyDecoder


    def build():
        torch.manual_seed(0)
        return TinyDecoder({WIDTH}, {LAYERS})


    def example_inputs():
        return (torch.randn(4, 3, {WIDTH}, generator=torch.Generator().manual_seed(1)),)
"""


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    root = tmp_path_factory.mktemp("inherited_loop")
    (root / "dictpkg").mkdir()
    for name, text in PACKAGE.items():
        (root / "dictpkg" / name).write_text(textwrap.dedent(text).lstrip("\n"))
    (root / "entry.py").write_text(textwrap.dedent(ENTRY).lstrip("\n"))
    sys.path.insert(0, str(root))
    yield root
    sys.path.remove(str(root))
    for name in [m for m in sys.modules if m.split(".")[0] in ("dictpkg", "out_dict")]:
        del sys.modules[name]


def test_each_stage_keeps_its_blocks_of_the_module_dict(project):
    cwd = Path.cwd()
    os.chdir(project)
    try:
        write_output(project / "out_dict", rewrite(analyze(project / "entry.py"), PlanRequest(pp=2)).files)
    finally:
        os.chdir(cwd)
    out = __import__("out_dict")
    loop = (project / "out_dict" / "dictpkg" / "base.py").read_text()
    assert "for layer in self.layers.values():  # pipeline: this stage's blocks of layers only" in loop
    for rank in range(out.WORLD_SIZE):
        (stage,) = out.build(rank)
        assert type(stage.layers).__name__ == "ModuleDict" and list(stage.layers) == ["0", "1"]


@pytest.mark.slow
def test_the_pipelined_module_dict_verifies(project):
    env = {**os.environ, "COLUMNS": "200", "PYTHONWARNINGS": "ignore"}
    result = subprocess.run([sys.executable, "-m", "nnscaler_cst.cli", "verify", "entry.py", "--pp", "2",
                             "-o", "out_verify"], cwd=project, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PASSED" in result.stdout
