"""Pipeline stages cut a forward written as a chain of statements (ResNet's and DLA's
`x = self.layer1(x)`, `x = self.layer2(x)`, ...; a UNet's down blocks whose outputs are kept for
the up blocks) between two of its top-level statements, and an nn.Sequential of stages called
inside a statement (timm's VoVNet: `return self.stages(x)`) as `x = self.stages(x)` first.

Was: "pipeline stages need a model built from repeated blocks ... this model has neither", and
"pipelining cuts the call of stages into stages, so it must be a statement of its own".
Quick tests check the cut and the rewritten text; the slow one runs verify on gloo.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from nnscaler_cst.analysis import analyze
from nnscaler_cst.errors import UserError
from nnscaler_cst.plan.pipeline import plan_stages
from nnscaler_cst.rewrite import PlanRequest, rewrite

# a ResNet-like forward: no block repeats, no nn.Sequential; the skips are kept in a list that a
# statement after the cut reads
CHAIN = '''
import torch
import torch.nn as nn
import torch.nn.functional as F


class Down(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, 2, 1)
        self.bn = nn.BatchNorm2d(cout)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x)))


class Up(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, 1, 1)

    def forward(self, x):
        return F.relu(self.conv(F.interpolate(x, scale_factor=2.0)))


class Net(nn.Module):
    """A ResNet-like forward written as a chain of statements, skips kept in a list."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, 1, 1)
        self.bn1 = nn.BatchNorm2d(8)
        self.relu = nn.ReLU()
        self.layer1 = Down(8, 16)
        self.layer2 = Down(16, 32)
        self.up1 = Up(32, 16)
        self.up2 = Up(16, 8)
        self.fc = nn.Linear(8, 10)

    def forward(self, images, labels):
        skips = []
        x = self.conv1(images)
        x = self.bn1(x)
        x = self.relu(x)
        skips.append(x)
        x = self.layer1(x)
        skips.append(x)
        x = self.layer2(x)
        x = self.up1(x) + skips.pop()
        x = self.relu(x)
        x = self.up2(x) + skips[0]
        x = torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)
        return F.cross_entropy(self.fc(x), labels)


def build():
    return Net()


def example_inputs():
    return torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))
'''

# DLA's style: the chain is in forward_features, which forward calls before the head
FEATURES = CHAIN.replace("""    def forward(self, images, labels):
        skips = []
        x = self.conv1(images)""", """    def forward(self, images, labels):
        x = self.forward_features(images)
        return F.cross_entropy(self.fc(x), labels)

    def forward_features(self, images):
        skips = []
        x = self.conv1(images)""").replace("""        x = torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)
        return F.cross_entropy(self.fc(x), labels)""", """        return torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)""")

# a helper function defined in the forward and called after every place a cut could go
LOCAL_FUNCTION = CHAIN.replace("""        skips = []
        x = self.conv1(images)""", """        skips = []

        def act(t):
            return self.relu(t)
        x = self.conv1(images)""").replace("        x = self.relu(x)\n        x = self.up2(x)",
                                            "        x = act(x)\n        x = self.up2(x)").replace(
    "self.fc(x), labels)", "self.fc(act(x)), labels)")

# VoVNet's style: the stages' nn.Sequential called in the return statement
SEQUENTIAL = '''
import torch
import torch.nn as nn
import torch.nn.functional as F


def conv(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, 2, 1), nn.ReLU())


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, 1, 1)
        self.stages = nn.Sequential(conv(8, 8), conv(8, 16), conv(16, 16))
        self.fc = nn.Linear(16, 10)

    def forward_features(self, x):
        x = self.stem(x)
        return self.stages(x)

    def forward(self, images, labels):
        x = self.forward_features(images)
        return F.cross_entropy(self.fc(x.mean(dim=(2, 3))), labels)


def build():
    return Net()


def example_inputs():
    return torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))
'''


def _write(tmp_path, text: str):
    model = tmp_path / "model.py"
    model.write_text(text.lstrip())
    return model


def _line(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.lstrip().splitlines(), 1) if needle in line)


def test_a_chain_of_statements_is_cut_between_two_of_them(tmp_path):
    plan = plan_stages(analyze(_write(tmp_path, CHAIN)).graph, 2)
    trunk = plan.trunk
    assert trunk.container == "Net.forward" and trunk.statements is not None
    # balanced by the cost model: the stem and the down blocks at 16 x 16 and 8 x 8 on stage 0
    start = trunk.statements.starts[plan.block_ranges[1][0]]
    assert trunk.function.body.body[start].body[0].value.func.attr.value == "relu"   # `x = self.relu(x)`
    assert trunk.statements.crossing[start] == ["skips", "x"]     # the skip list goes on with x
    assert plan.drop == {0: ["fc", "up2.conv"], 1: ["bn1", "conv1", "layer1.bn", "layer1.conv", "layer2.bn",
                                                    "layer2.conv", "up1.conv"]}


def test_each_stage_runs_its_statements_and_hands_on_what_later_ones_read(tmp_path):
    text = rewrite(analyze(_write(tmp_path, CHAIN)), PlanRequest(pp=2)).files["model_stage0.py"]
    assert """    def forward(self, images, labels):
        if pp_stage() == 0:  # pipeline: stage 0 runs these statements
            skips = []
            x = self.conv1(images)""" in text
    assert """            x = self.up1(x) + skips.pop()
            pp_handoff(skips, x)  # pipeline: stage 0 hands these on and ends here
        skips, x = pp_receive()  # pipeline: stage 1 starts here, from what stage 0 handed on
        x = self.relu(x)""" in text


def test_the_function_holding_the_chain_is_found_below_forward(tmp_path):
    plan = plan_stages(analyze(_write(tmp_path, FEATURES)).graph, 2)
    assert plan.trunk.container == "Net.forward_features"
    assert "fc" in plan.drop[0] and "conv1" in plan.drop[1]


def test_a_function_handed_across_every_cut_is_refused_where_it_is_defined(tmp_path):
    model = _write(tmp_path, LOCAL_FUNCTION)
    with pytest.raises(UserError, match="a cut here hands `act` on to the next stage: a function") as caught:
        plan_stages(analyze(model).graph, 2)
    assert caught.value.location.line == _line(LOCAL_FUNCTION, "def act(t):")


def test_a_sequential_called_in_a_return_is_cut_on_a_line_of_its_own(tmp_path):
    text = rewrite(analyze(_write(tmp_path, SEQUENTIAL)), PlanRequest(pp=2)).files["model_stage0.py"]
    assert """            x, = pp_receive()  # pipeline: from the previous stage
        x = self.stages(x)  # pipeline: this stage's blocks of stages only
        pp_handoff(x)  # pipeline: every stage but the last hands these on and ends here
        return x  # pipeline: the call of self.stages moved to the line above, which the stages cut""" in text


@pytest.mark.parametrize("statement", ["return self.stages(x) * x.mean()", "return x.mean() + self.stages(x)"],
                         ids=["input-read-again", "call-evaluated-before"])
def test_a_sequential_the_cut_cannot_move_out_of_its_statement_is_refused(tmp_path, statement):
    model = _write(tmp_path, SEQUENTIAL.replace("return self.stages(x)", statement))
    with pytest.raises(UserError, match="must be a statement of its own or one the cut can move") as caught:
        plan_stages(analyze(model).graph, 2)
    assert caught.value.location.line == _line(SEQUENTIAL, "return self.stages(x)")


@pytest.mark.slow
def test_a_chain_of_statements_with_a_skip_list_trains_like_one_device(tmp_path):
    model = _write(tmp_path, CHAIN)
    result = subprocess.run([sys.executable, "-m", "nnscaler_cst.cli", "verify", str(model), "--pp", "2",
                             "--micro-batches", "2", "-o", str(tmp_path / "out"), "--json"],
                            capture_output=True, text=True, timeout=900)
    start = result.stdout.find("{")
    outcome = json.loads(result.stdout[start:]) if start >= 0 else None
    assert result.returncode == 0 and outcome and outcome["passed"] is True, result.stdout + result.stderr
