"""Per-instance splits (docs/per-instance-splits.md): one block class built as a depthwise and as a
pointwise conv (timm's ConvNormAct in LCNetV2 and LowFormer, torchvision's Conv2dNormActivation)
runs both from one `x = self.conv(x)`. Their splits share no layout, so the line ran whole on every
rank. Now the class's instances are planned per group, and the rewrite writes one variant subclass
per group's forward, set as each instance's class after build()."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import libcst as cst
import pytest

from nnscaler_cst.analysis import analyze
from nnscaler_cst.emit.variants import _variant_class
from nnscaler_cst.rewrite import PlanRequest, rewrite

CONV_BN_ACT = textwrap.dedent('''
    import torch
    from torch import nn


    class ConvBNAct(nn.Module):
        def __init__(self, cin, cout, k=1, groups=1):
            super().__init__()
            self.conv = nn.Conv2d(cin, cout, k, padding=k // 2, groups=groups, bias=False)
            self.bn = nn.BatchNorm2d(cout)

        def forward(self, x):
            x = self.conv(x)
            return torch.relu(self.bn(x))


    class Net(nn.Module):
        def __init__(self, c=8, hidden=16):
            super().__init__()
            self.dw1 = ConvBNAct(c, c, 3, groups=c)
            self.pw1 = ConvBNAct(c, hidden)
            self.dw2 = ConvBNAct(hidden, hidden, 3, groups=hidden)
            self.pw2 = ConvBNAct(hidden, c)

        def forward(self, x):
            return self.pw2(self.dw2(self.pw1(self.dw1(x)))).square().mean()


    def build():
        return Net()


    def example_inputs():
        return (torch.randn(2, 8, 6, 6),)
''')


def _model(tmp_path):
    path = tmp_path / "convbnact.py"
    path.write_text(CONV_BN_ACT)
    return path


def _package(tmp_path):
    """The same model as a package, the block class in a file of its own (timm's layers): the
    variant goes into the block file's mirror, and the program imports it for its table."""
    blocks, net = CONV_BN_ACT.split("class Net(nn.Module):")
    net, entry = net.split("def build():")
    (tmp_path / "convpkg").mkdir()
    (tmp_path / "convpkg" / "__init__.py").write_text("")
    (tmp_path / "convpkg" / "blocks.py").write_text(blocks)
    (tmp_path / "convpkg" / "net.py").write_text("from torch import nn\n\nfrom .blocks import ConvBNAct\n\n\n"
                                                 "class Net(nn.Module):" + net)
    (tmp_path / "entry.py").write_text("import torch\n\nfrom convpkg.net import Net\n\n\ndef build():" + entry)
    return tmp_path / "entry.py"


def _cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "nnscaler_cst.cli", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=900)


def test_a_block_class_built_as_depthwise_and_pointwise_convs_gets_a_variant_per_kind(tmp_path):
    result = rewrite(analyze(_model(tmp_path)), PlanRequest(plan="megatron", tp=2))
    layouts = {name: axes["tp"] for name, axes in result.plan.params.items()}
    assert all(layouts[f"{m}.conv.weight"].startswith("S(") for m in ("dw1", "pw1", "dw2", "pw2")), layouts
    text = result.files["model.py"]
    # the class keeps the first instance's (a depthwise conv's) forward; the pointwise convs run the variant
    assert "class ConvBNAct_1(ConvBNAct):\n    def forward(self, x):\n" in text, text
    assert "INSTANCE_CLASSES = {  # module: its class\n    'pw1': ConvBNAct_1,\n    'pw2': ConvBNAct_1,\n}\n" \
           "build = instance_classes(build, INSTANCE_CLASSES)\n" in text, text
    own, variant = text.split("class ConvBNAct_1(ConvBNAct):")
    own = own[own.index("class ConvBNAct(nn.Module):"):]
    assert "x = self.conv(x)" not in own and "x = self.conv(x)" not in variant.split("class Net")[0], text


def test_a_variant_method_calling_super_names_the_class_it_was_written_in():
    """`super().forward(x)` moved into the subclass would run the class's own (rewritten) forward."""
    method = cst.parse_module("def forward(self, x):\n    return super().forward(x) + 1\n").body[0]
    variant = cst.Module([_variant_class("Block_1", "Block", [method], ["b.1"])]).code
    assert "class Block_1(Block):\n    def forward(self, x):\n        return super(Block, self).forward(x) + 1\n" \
        in variant, variant


@pytest.mark.slow
@pytest.mark.parametrize("model,mesh", [(_model, ("--tp", "2")), (_model, ("--dp", "2", "--tp", "2")),
                                        (_package, ("--tp", "2"))], ids=["tp2", "dp2xtp2", "package-tp2"])
def test_depthwise_and_pointwise_instances_of_one_class_train_like_one_device(tmp_path, model, mesh):
    result = _cli("verify", model(tmp_path), "--plan", "megatron", *mesh, "-o", "out", "--json", cwd=tmp_path)
    start = result.stdout.find("{")
    outcome = json.loads(result.stdout[start:]) if start >= 0 else None
    assert result.returncode == 0 and outcome and outcome["passed"] is True, result.stdout + result.stderr
    program = (tmp_path / "out" / "model.py").read_text()
    assert "    'pw1': ConvBNAct_1,\n    'pw2': ConvBNAct_1,\n" in program, program
    if model is _package:       # the variant sits beside its class in the mirror, the program imports it
        mirror = (tmp_path / "out" / "convpkg" / "blocks.py").read_text()
        assert "class ConvBNAct(nn.Module):" in mirror and "class ConvBNAct_1(ConvBNAct):" in mirror, mirror
        assert "from .convpkg.blocks import ConvBNAct_1\nINSTANCE_CLASSES = {" in program, program
