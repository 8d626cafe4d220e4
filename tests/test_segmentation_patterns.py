"""Patterns of segmentation models (torchvision's FCN, LRASPP, DeepLab) written in any library:

- a head that subclasses nn.Sequential with its own constructor (`Head(in_channels, channels)`),
  cut where a collective goes between its layers: a slice `self.head[2:]` rebuilds the class
  from a dict of layers, which that constructor does not take, so its layers are called one by
  one (was: internal error, the dry run raised "Head.__init__() missing 1 required positional
  argument");

Quick tests rewrite in process (the rewrite's dry run runs the emitted code).
"""
from __future__ import annotations

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
