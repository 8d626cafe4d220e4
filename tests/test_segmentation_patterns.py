"""Patterns of segmentation models (torchvision's FCN, LRASPP, DeepLab) written in any library:

- a head that subclasses nn.Sequential with its own constructor (`Head(in_channels, channels)`),
  cut where a collective goes between its layers: a slice `self.head[2:]` rebuilds the class
  from a dict of layers, which that constructor does not take, so its layers are called one by
  one (was: internal error, the dry run raised "Head.__init__() missing 1 required positional
  argument");
- a backbone that calls its children in a loop and keeps some outputs (torchvision's
  IntermediateLayerGetter: `for name, module in self.items(): x = module(x)`): each call from the
  loop's one line is a node of its own (was: consecutive calls from one instruction were merged
  into one node, the stem's conv with its BatchNorm), and the layers that line calls run whole,
  since one line holds one conversion of their input for layers of every class (was: "instances
  of torch.nn.ReLU need different conversions of their argument"); pipeline stages cut between
  its children, each stage running its iterations of the loop over the whole ModuleDict (the
  other stages' children hollow), the outputs it collected handed on (was: refused, "the loop
  calling the blocks of backbone.layer2 iterates over their names");
- a forward that keeps a list of tensors on the module (RAFT's `self.corr_pyramid =
  [corr_volume]`): the trace's check whether the attribute changed compared the old list with the
  new by ==, which ran Tensor.__eq__, recorded as the model's op at that line (was: "the rewrite
  found no node for a planned edit here").

Quick tests rewrite in process (the rewrite's dry run runs the emitted code).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from nnscaler_cst.analysis import analyze
from nnscaler_cst.rewrite import PlanRequest, rewrite


def _write(tmp_path, source: str):
    path = tmp_path / "model.py"
    path.write_text(source)
    return path


SEQUENTIAL_HEAD = '''
import torch
import torch.nn as nn


class Head(nn.Sequential):
    def __init__(self, in_channels, channels):
        inter = in_channels // 2
        super().__init__(nn.Conv2d(in_channels, inter, 3, padding=1, bias=False), nn.BatchNorm2d(inter),
                         nn.ReLU(), nn.Conv2d(inter, channels, 1))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.head = Head(8, 4)

    def forward(self, x):
        return self.head(torch.relu(self.stem(x))).pow(2).mean()


def build():
    return Net()


def example_inputs():
    return (torch.randn(4, 3, 8, 8),)
'''


def test_a_sequential_subclass_with_its_own_constructor_is_cut_layer_by_layer(tmp_path):
    text = rewrite(analyze(_write(tmp_path, SEQUENTIAL_HEAD)), PlanRequest(dp=2)).files["model.py"]
    assert "self.head[3](self.head[2](dp_batch_norm(self.head[0](" in text
    assert "self.head[2:]" not in text


GETTER = '''
from collections import OrderedDict

import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1 = nn.Conv2d(c, 2 * c, 3, padding=1)
        self.conv2 = nn.Conv2d(2 * c, c, 3, padding=1)

    def forward(self, x):
        return x + self.conv2(torch.relu(self.conv1(x)))


class Getter(nn.ModuleDict):
    def __init__(self, layers, keep):
        super().__init__(layers)
        self.keep = keep

    def forward(self, x):
        out = OrderedDict()
        for name, module in self.items():
            x = module(x)
            if name in self.keep:
                out[self.keep[name]] = x
        return out


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = Getter(OrderedDict(stem=nn.Conv2d(3, 8, 3, padding=1), norm=nn.BatchNorm2d(8),
                                           act=nn.ReLU(), layer1=nn.Sequential(Block(8), Block(8)),
                                           layer2=nn.Sequential(Block(8))), {"layer1": "aux", "layer2": "out"})
        self.head = nn.Conv2d(8, 4, 1)

    def forward(self, x):
        features = self.backbone(x)
        return (self.head(features["out"]) + features["aux"].mean()).pow(2).mean()


def build():
    return Net()


def example_inputs():
    return (torch.randn(4, 3, 8, 8),)
'''


def test_each_call_of_a_loop_over_a_models_children_is_a_node_of_its_own(tmp_path):
    graph = analyze(_write(tmp_path, GETTER)).graph
    called = [node.callee_path for node in graph.nodes if node.callee_kind == "module"]
    assert called[:3] == ["backbone.stem", "backbone.norm", "backbone.act"]


def test_a_loop_over_a_models_children_runs_the_layers_it_calls_whole_and_splits_the_blocks(tmp_path):
    result = rewrite(analyze(_write(tmp_path, GETTER)), PlanRequest(tp=2))
    assert result.plan.params["backbone.stem.weight"]["tp"] == "R"
    assert "self.conv1 = nn.Conv2d(c, 2 * c // 2, 3, padding=1)" in result.files["model.py"]
    assert any("calls layers of different classes in turn" in w for w in result.plan.warnings)


# the getter's two outputs reach the head per sample (a mean over the batch would mix micro-batches)
PIPELINED_GETTER = GETTER.replace('features["aux"].mean()', 'features["aux"].mean(1, keepdim=True)').replace(
    "layer2=nn.Sequential(Block(8))", "layer2=nn.Sequential(Block(8), Block(8))")


def test_pipeline_stages_cut_a_loop_over_a_models_children_between_them(tmp_path):
    result = rewrite(analyze(_write(tmp_path, PIPELINED_GETTER)), PlanRequest(pp=2))    # its dry run runs each stage
    first, last = result.files["model_stage0.py"], result.files["model_stage1.py"]
    assert "for name, module in pp_iterations(self.items()):" in first
    assert "pp_handoff(out, x)" in first
    assert "STAGE_BLOCKS = {0: (0, 4)}" in first and "STAGE_BLOCKS = {1: (4, 5)}" in last
    assert "STAGE_DROPS = {1: ['backbone.stem', 'backbone.norm', 'backbone.act', 'backbone.layer1']}" in last


@pytest.mark.slow
def test_the_pipelined_loop_over_a_models_children_verifies(tmp_path):
    _write(tmp_path, PIPELINED_GETTER)
    env = {**os.environ, "COLUMNS": "200", "PYTHONWARNINGS": "ignore"}
    result = subprocess.run([sys.executable, "-m", "nnscaler_cst.cli", "verify", "model.py", "--pp", "2",
                             "--micro-batches", "2", "-o", "out"], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PASSED" in result.stdout


# a ModuleList of a stem layer, then the blocks, whose loop keeps outputs by their index
STEM_IN_LIST = '''
import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class Net(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, d), Block(d), Block(d), Block(d), Block(d)])
        self.keep = (2, 4)

    def forward(self, x):
        outs = []
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i in self.keep:
                outs.append(x)
        return (outs[0] * outs[1]).pow(2).mean()


def build():
    return Net()


def example_inputs():
    return (torch.randn(4, 4),)
'''


def test_pipeline_stages_cut_a_list_holding_a_stem_and_the_blocks_between_its_layers(tmp_path):
    """The stages hold layers of the list, stem included, not the blocks counted from the list's
    start (was: internal error, the sharded state dict named a block the stage did not hold)."""
    result = rewrite(analyze(_write(tmp_path, STEM_IN_LIST)), PlanRequest(pp=2))    # its dry run runs each stage
    assert "for i, layer in pp_iterations(enumerate(self.layers)):" in result.files["model_stage0.py"]
    assert "STAGE_DROPS = {1: ['layers.0', 'layers.1', 'layers.2']}" in result.files["model_stage1.py"]


KEPT_LIST = '''
import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 32)
        self.down = nn.Linear(32, 8)
        self.levels = []

    def forward(self, x):
        h = self.up(x)
        self.levels = [h]
        self.levels = [h * 2]
        return self.down(self.levels[0]).pow(2).mean()


def build():
    return Net()


def example_inputs():
    return (torch.randn(4, 8),)
'''


def test_a_list_of_tensors_kept_on_the_module_is_no_op_of_the_model(tmp_path):
    graph = analyze(_write(tmp_path, KEPT_LIST)).graph
    assert [node.callee for node in graph.nodes if node.span.line == 16] == ["Tensor.mul"]
