"""A library's subclass of a torch layer that only fixes its constructor's arguments (torchvision's
video ResNets: `class Conv3DSimple(nn.Conv3d)` and `Conv3DNoTemporal(nn.Conv3d)`, one per stage,
built by one `conv_builder(...)` line of the block) runs that layer's forward, so it splits as that
layer: the blocks' `nn.Sequential(conv_builder(...), norm, act)` run the same layers in every
instance, and the conv pairs split Megatron-style.

Was: each subclass counted as a layer of its own, so the line calling `self.conv1` ran different
layers in different blocks (a mixed container) and every conv of the blocks ran whole (mc3_18: 0%).
"""
from __future__ import annotations

import textwrap

import pytest
import torch

from nnscaler_cst.analysis import analyze
from nnscaler_cst.rewrite import PlanRequest, build_plan
from nnscaler_cst.trace.naming import layer_type

BUILDER_BLOCKS = textwrap.dedent('''
    import torch
    from torch import nn


    class FullConv(nn.Conv2d):
        def __init__(self, in_planes, out_planes):
            super().__init__(in_channels=in_planes, out_channels=out_planes, kernel_size=3, padding=1, bias=False)

        @staticmethod
        def stride_of(stride):
            return stride, stride


    class RowConv(nn.Conv2d):
        def __init__(self, in_planes, out_planes):
            super().__init__(in_channels=in_planes, out_channels=out_planes, kernel_size=(1, 3), padding=(0, 1),
                             bias=False)


    class Block(nn.Module):
        def __init__(self, planes, conv_builder):
            super().__init__()
            self.conv1 = nn.Sequential(conv_builder(planes, 2 * planes), nn.BatchNorm2d(2 * planes), nn.ReLU())
            self.conv2 = nn.Sequential(conv_builder(2 * planes, planes), nn.BatchNorm2d(planes))

        def forward(self, x):
            out = self.conv1(x)
            out = self.conv2(out)
            return torch.relu(out + x)


    class Net(nn.Module):
        def __init__(self, planes=8):
            super().__init__()
            self.stem = nn.Conv2d(3, planes, 3, padding=1)
            self.layers = nn.Sequential(Block(planes, FullConv), Block(planes, RowConv))
            self.head = nn.Linear(planes, 4)

        def forward(self, x):
            x = self.layers(self.stem(x))
            return self.head(x.mean((2, 3)))


    def build():
        torch.manual_seed(0)
        return Net()


    def example_inputs():
        return (torch.randn(4, 3, 8, 8),)


    def loss(output):
        return output.pow(2).mean()
''')


def test_a_subclass_fixing_only_constructor_arguments_is_its_torch_layer():
    class Fixed(torch.nn.Conv3d):
        def __init__(self, c):
            super().__init__(c, c, 3)

        def extra_repr(self):
            return "fixed"

    class OwnForward(torch.nn.Conv2d):
        def _conv_forward(self, x, weight, bias):
            return super()._conv_forward(x, weight / weight.norm(), bias)

    class Stack(torch.nn.Sequential):
        pass

    assert layer_type(Fixed) is torch.nn.Conv3d
    assert layer_type(type("Deeper", (Fixed,), {})) is torch.nn.Conv3d
    assert layer_type(OwnForward) is OwnForward     # a weight-standardized conv is an op of its own
    assert layer_type(Stack) is Stack               # a container runs its layers, not one
    assert layer_type(torch.nn.Linear) is torch.nn.Linear


@pytest.mark.slow     # over 5 s: keeps the quick subset under 3 minutes
def test_blocks_built_with_different_conv_subclasses_split_their_conv_pairs(tmp_path):
    path = tmp_path / "builder_blocks.py"
    path.write_text(BUILDER_BLOCKS)
    analysis = analyze(path)
    assert not analysis.trace.mixed_containers
    plan, _ = build_plan(analysis, PlanRequest(tp=2))
    layouts = {name: str(axes.get("tp")) for name, axes in plan.params.items()}
    for block in ("0", "1"):     # FullConv's blocks and RowConv's
        assert layouts[f"layers.{block}.conv1.0.weight"] == "S(0)", layouts
        assert layouts[f"layers.{block}.conv1.1.weight"] == "S(0)", layouts
        assert layouts[f"layers.{block}.conv2.0.weight"] == "S(1)", layouts
