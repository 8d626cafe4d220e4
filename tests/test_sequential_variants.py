"""A line calling nn.Sequentials of unlike layers in unlike instances of its class (MobileNet's
inverted residual: `self.conv(x)` runs expand / depthwise / project in most blocks, depthwise /
project where the expansion ratio is 1). One line cannot hold the collectives between the layers
of both lists, so the layers ran whole on every rank. Now the instances are grouped by the layers
their call runs (plan/instances.py), and each group's call is cut apart in a variant of the class:
the pointwise expand split by output channels, the depthwise conv by channels, the project by
input channels, BatchNorm following the split."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from nnscaler_cst.analysis import analyze
from nnscaler_cst.rewrite import PlanRequest, rewrite

INVERTED_RESIDUALS = textwrap.dedent('''
    import torch
    from torch import nn


    class ConvBNAct(nn.Sequential):
        def __init__(self, cin, cout, k=1, groups=1, act=True):
            layers = [nn.Conv2d(cin, cout, k, padding=k // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)]
            if act:
                layers.append(nn.ReLU6())
            super().__init__(*layers)


    class InvertedResidual(nn.Module):
        def __init__(self, cin, cout, expand):
            super().__init__()
            hidden = cin * expand
            self.residual = cin == cout
            layers = [ConvBNAct(cin, hidden)] if expand != 1 else []
            layers += [ConvBNAct(hidden, hidden, 3, groups=hidden), nn.Conv2d(hidden, cout, 1, bias=False),
                       nn.BatchNorm2d(cout)]
            self.conv = nn.Sequential(*layers)

        def forward(self, x):
            if self.residual:
                return x + self.conv(x)
            else:
                return self.conv(x)


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.features = nn.Sequential(
                ConvBNAct(3, 8, 3),
                nn.Sequential(InvertedResidual(8, 4, 1)),
                nn.Sequential(InvertedResidual(4, 8, 2), InvertedResidual(8, 8, 2)))
            self.head = nn.Linear(8, 4)

        def forward(self, x):
            return self.head(self.features(x).mean((2, 3)))


    def build():
        torch.manual_seed(0)
        return Net()


    def example_inputs():
        return (torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(1)),)


    def loss(output):
        return output.square().mean()
''')


def _model(tmp_path):
    path = tmp_path / "mobile.py"
    path.write_text(INVERTED_RESIDUALS)
    return path


def test_inverted_residuals_with_and_without_expansion_split_their_layers_like_megatron(tmp_path):
    result = rewrite(analyze(_model(tmp_path)), PlanRequest(plan="megatron", tp=2))
    params = result.plan.params
    block = {name: info for name, info in params.items() if name.startswith("features.1.") or
             name.startswith("features.2.")}
    numel = lambda info: torch_numel(info["shape"])  # noqa: E731
    split = sum(numel(info) for info in block.values() if info["tp"].startswith("S"))
    assert split / sum(numel(info) for info in block.values()) >= 0.9, block
    layouts = {name: info["tp"] for name, info in block.items()}
    for b in ("features.2.0", "features.2.1"):       # expand by output channels, project by input channels
        assert layouts[f"{b}.conv.0.0.weight"] == "S(0)", layouts
        assert layouts[f"{b}.conv.0.1.weight"] == "S(0)", layouts
        assert layouts[f"{b}.conv.1.0.weight"] == "S(0)", layouts
        assert layouts[f"{b}.conv.2.weight"] == "S(1)", layouts
    assert layouts["features.1.0.conv.0.0.weight"] == "S(0)", layouts     # the depthwise conv by channels
    assert layouts["features.1.0.conv.1.weight"] == "S(1)", layouts
    assert not [w for w in result.plan.warnings if "keeps its weights whole" in w], result.plan.warnings
    text = result.files["model.py"]
    assert "class InvertedResidual_1(InvertedResidual):" in text, text
    assert "self.conv[2](self.conv[1][2](self.conv[1][1](self.conv[1][0](" in text, text    # cut in each kind
    assert "self.conv[3](tp_reduce(self.conv[2](" in text, text


def torch_numel(shape):
    n = 1
    for size in shape:
        n *= size
    return n


@pytest.mark.slow
def test_inverted_residuals_with_and_without_expansion_train_like_one_device(tmp_path):
    _model(tmp_path)
    result = subprocess.run([sys.executable, "-m", "nnscaler_cst.cli", "verify", "mobile.py", "--tp", "2", "-o", "out",
                             "--json"], cwd=tmp_path, capture_output=True, text=True, timeout=900)
    start = result.stdout.find("{")
    outcome = json.loads(result.stdout[start:]) if start >= 0 else None
    assert result.returncode == 0 and outcome and outcome["passed"] is True, result.stdout + result.stderr


SEQUENTIAL_BLOCKS_IN_A_LOOP = textwrap.dedent('''
    import torch
    from torch import nn


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(
                nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.ReLU()) for _ in range(4))
            self.head = nn.Linear(16, 4)

        def forward(self, x, target):
            for block in self.blocks:
                x = block(x)
            return nn.functional.cross_entropy(self.head(x), target)


    def build():
        torch.manual_seed(0)
        return Net()


    def example_inputs():
        torch.manual_seed(1)
        return torch.randn(4, 16), torch.randint(0, 4, (4,))
''')


@pytest.mark.slow
def test_a_loop_over_blocks_that_are_each_an_nn_sequential_pipelines_like_one_device(tmp_path):
    """`x = block(x)` where each block is an nn.Sequential is a call of one block, not of an
    nn.Sequential holding the blocks: the stages cut the loop (it was refused as a nested loop)."""
    (tmp_path / "loop.py").write_text(SEQUENTIAL_BLOCKS_IN_A_LOOP)
    result = subprocess.run([sys.executable, "-m", "nnscaler_cst.cli", "verify", "loop.py", "--pp", "2",
                             "--micro-batches", "2", "-o", "out", "--json"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=600)
    start = result.stdout.find("{")
    outcome = json.loads(result.stdout[start:]) if start >= 0 else None
    assert result.returncode == 0 and outcome and outcome["passed"] is True, result.stdout + result.stderr
    assert json.loads((tmp_path / "out" / "plan.json").read_text())["mesh"]["pp"] == 2
    assert (tmp_path / "out" / "model_stage1.py").exists()


MODEL_LOOPING_OVER_ITS_OWN_CHILDREN = textwrap.dedent('''
    import torch
    from torch import nn
    import torch.nn.functional as F


    class Block(nn.Module):
        def __init__(self, d=16):
            super().__init__()
            self.fc1 = nn.Linear(d, 4 * d)
            self.fc2 = nn.Linear(4 * d, d)
            self.norm = nn.LayerNorm(d)

        def forward(self, x):
            return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


    class Net(nn.Sequential):
        def __init__(self):
            super().__init__(*[Block() for _ in range(4)], nn.Linear(16, 4))

        def forward(self, x, target):
            for module in self:
                x = module(x)
            return F.cross_entropy(x.mean(1), target)


    def build():
        torch.manual_seed(0)
        return Net()


    def example_inputs():
        torch.manual_seed(1)
        return torch.randn(4, 8, 16), torch.randint(0, 4, (4,))
''')


def _verify(tmp_path, *options):
    result = subprocess.run([sys.executable, "-m", "nnscaler_cst.cli", "verify", "net.py", *options, "-o", "out",
                             "--json"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    start = result.stdout.find("{")
    return result, json.loads(result.stdout[start:]) if start >= 0 else None


@pytest.mark.slow
def test_a_line_calling_blocks_and_a_head_in_turn_keeps_the_head_whole(tmp_path):
    """`x = module(x)` runs four blocks (their ops on lines of their own) and a Linear head. A
    split head needs a conversion at that line's argument, which every block's call would take
    too (their gradients summed twice over): the head runs whole, and the blocks still split."""
    (tmp_path / "net.py").write_text(MODEL_LOOPING_OVER_ITS_OWN_CHILDREN)
    result, outcome = _verify(tmp_path, "--tp", "2")
    assert result.returncode == 0 and outcome and outcome["passed"] is True, result.stdout + result.stderr
    params = json.loads((tmp_path / "out" / "plan.json").read_text())["params"]
    assert params["4.weight"]["tp"] == "R" and params["0.fc1.weight"]["tp"] == "S(0)", params


def test_a_statement_cut_that_leaves_a_stage_no_parameter_is_not_taken(tmp_path):
    """The only cut between that forward's statements puts the loss alone on a stage, whose
    rank's optimizer would get no parameter: refused with exit 2, and nothing written."""
    (tmp_path / "net.py").write_text(MODEL_LOOPING_OVER_ITS_OWN_CHILDREN)
    result = subprocess.run([sys.executable, "-m", "nnscaler_cst.cli", "net.py", "--pp", "2", "-o", "out"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "net.py:" in result.stderr and "pipeline stages need" in result.stderr, result.stderr
    assert not (tmp_path / "out").exists()


LOOP_OVER_A_SLICE = textwrap.dedent('''
    import torch
    from torch import nn


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(
                nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.ReLU()) for _ in range(5))
            self.head = nn.Linear(16, 4)

        def forward(self, x, target):
            x = self.blocks[0](x)
            for block in self.blocks[1:-1]:
                x = block(x)
            x = self.blocks[-1](x)
            return {"loss": nn.functional.cross_entropy(self.head(x), target)}


    def build():
        torch.manual_seed(0)
        return Net()


    def example_inputs():
        torch.manual_seed(1)
        return torch.randn(4, 16), torch.randint(0, 4, (4,))
''')


@pytest.mark.slow
def test_a_loop_over_a_slice_of_the_blocks_pipelines_the_blocks_it_runs(tmp_path):
    """`self.blocks[0](x)`, a loop over `self.blocks[1:-1]`, `self.blocks[-1](x)`: the stages cut
    the loop's blocks; the first and last run with the code before and after it (the dry run
    used to fail: the loop ran 3 iterations, the stages were cut for 5). The output is a dict
    holding the loss, as the trace reads it."""
    (tmp_path / "net.py").write_text(LOOP_OVER_A_SLICE)
    result, outcome = _verify(tmp_path, "--pp", "2", "--micro-batches", "2")
    assert result.returncode == 0 and outcome and outcome["passed"] is True, result.stdout + result.stderr
