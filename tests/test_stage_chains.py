"""Models built as a chain of differently-shaped stages (CNNs, hierarchical ViTs: timm's
`stages`, a stem before them), as the coverage sweep of timm met them:

- timm's BatchNormAct2d calls torch.nn.functional.batch_norm with its own buffers: under data
  parallelism it sums the statistics over the ranks, as the BatchNorm layers do
  (`dp_functional_batch_norm`), instead of refusing the data-parallel plan;
- an nn.Sequential of stages of different classes (a block, then two stages of another class):
  pipeline stages cut it between its children, balanced by the cost model (was: "stages is an
  nn.Sequential holding more than its 2 blocks"), also when no class repeats at all;
- one line calling a layer that is a BatchNorm in some instances of its class and nn.Identity in
  others (timm's LowFormer ConvLayer, `norm=None`): dp_batch_norm runs the other layer as it is
  (was: the dry run raised "'Identity' object has no attribute 'momentum'");
- one call line running an nn.Sequential in some instances of its class and another module in
  others (LowFormer's ResidualBlock: `self.main(x)` over an MLP Sequential, an attention, an
  MBConv), where the plan needs collectives between the Sequential's layers: no one unrolling of
  the line serves every instance, so the plan is solved again with those layers whole (was: the
  internal error "the rewrite found no node for a planned edit here");
- a plan solved again with some parameters kept whole (timm's FastViT: one LayerScale2d
  constructor builds the token mixer's gamma, left whole, and the MLP's, split) kept "split every
  weight matrix" blanket: a conv whose sizes do not divide (a stem over 3 channels) runs whole
  with a warning, as in the first plan (was: unsatisfiable, and the first error reported);
- the same with a BatchNorm inside the nn.Sequential under data parallelism (DLA's `self.project`:
  conv and BatchNorm, or nn.Identity): no one unrolling shows the BatchNorm's call, so the line
  calls `dp_layers(self.project, x, DP)`, which runs each BatchNorm it meets synced (was: internal
  error, "'Identity' object is not subscriptable" in the dry run);
- a parameter of the model itself read after the blocks (XCiT's cls_token, concatenated before its
  class-attention blocks): the last stage holds it and the first drops it; a stage dropping the
  model's own parameters hollows those only (was: every stage dropped them and none hollowed them,
  so the first stage's stale copy was merged back: a WRONG result that only verify caught);
- the model's own parameters read on different stages (CaiT: pos_embed before the blocks,
  cls_token after them): both stages hold both, tied, and each has no gradient for the one it
  does not read; it sums a zero there (was: each stage's bucket of tied gradients left out a
  different one, and gloo aborted both ranks on the size mismatch);
- BatchNorm under a pipeline's micro-batches: each micro-batch is normalised by its own statistics
  (GPipe's and torch.distributed.pipelining's semantics), with a warning at the BatchNorm line;
  the output says so (BATCH_STATISTICS_PER_MICRO_BATCH) and verify compares it with one device
  accumulating gradients over the same micro-batches, running statistics included (was: refused,
  "2 micro-batches would not match the single-device run").

Quick tests check the plans and the rewritten text; the slow one runs verify on gloo.
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

CNN = '''
import torch
import torch.nn as nn
import torch.nn.functional as F


class BatchNormAct(nn.BatchNorm2d):
    """A BatchNorm whose forward calls the functional form with its own buffers."""

    def forward(self, x):
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
        x = F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, self.training, factor,
                         self.eps)
        return torch.relu(x)


class ConvNormAct(nn.Module):
    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn = BatchNormAct(cout)

    def forward(self, x):
        return self.bn(self.conv(x))


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.conv = ConvNormAct(dim, dim)
        self.gamma = nn.Parameter(1e-1 * torch.ones(dim, 1, 1))

    def forward(self, x):
        return x + self.conv(x) * self.gamma


class Stage(nn.Module):
    def __init__(self, cin, cout, depth):
        super().__init__()
        self.down = ConvNormAct(cin, cout, stride=2)
        self.blocks = nn.Sequential(*[Block(cout) for _ in range(depth)])

    def forward(self, x):
        return self.blocks(self.down(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = ConvNormAct(3, 8)
        self.stages = nn.Sequential(STAGES)
        self.head = nn.Linear(32, 10)

    def forward(self, images, labels):
        x = self.stem(images)
        x = self.stages(x)
        return F.cross_entropy(self.head(x.mean(dim=(2, 3))), labels)


def build():
    return Net()


def example_inputs():
    return torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))
'''

# a block, then two stages of another class; or no class twice (nothing repeats)
MIXED = CNN.replace("STAGES", "Block(8), Stage(8, 16, 1), Stage(16, 32, 2)")
UNIQUE = CNN.replace("STAGES", "Block(8), Stage(8, 16, 1), ConvNormAct(16, 32, stride=2)")


def _line(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.lstrip().splitlines(), 1) if needle in line)


def _write(tmp_path, text: str):
    model = tmp_path / "model.py"
    model.write_text(text.lstrip())
    return model


def test_functional_batch_norm_under_data_parallelism_sums_its_statistics_over_the_ranks(tmp_path):
    text = rewrite(analyze(_write(tmp_path, MIXED)), PlanRequest(dp=2)).files["model.py"]
    assert "x = dp_functional_batch_norm(x, DP, self.running_mean, self.running_var, self.weight, self.bias, " \
           "self.training, factor, self.eps)  # batch statistics summed over the data-parallel ranks" in text


# the cost model balances them: the stem and the first block at 16 x 16 cost about what the last
# stage costs at 8 x 8 and 4 x 4 (MIXED); a last stage of one conv at 4 x 4 goes with the one before
@pytest.mark.parametrize("source, ranges", [(MIXED, [(0, 2), (2, 3)]), (UNIQUE, [(0, 1), (1, 3)])],
                         ids=["repeated-class-among-others", "no-class-repeats"])
def test_a_sequential_of_unlike_stages_is_cut_between_its_children(tmp_path, source, ranges):
    graph = analyze(_write(tmp_path, source)).graph
    plan = plan_stages(graph, 2)
    assert plan.trunk.container == "stages" and plan.blocks == ["stages.0", "stages.1", "stages.2"]
    assert plan.block_ranges == ranges
    assert plan.drop[0] == ["head"] and plan.drop[1] == ["stem.bn", "stem.conv"]


def test_batch_norm_under_micro_batches_normalises_each_by_its_own_statistics(tmp_path):
    out = rewrite(analyze(_write(tmp_path, MIXED)), PlanRequest(pp=2, micro_batches=2))
    line = next(i for i, text in enumerate(MIXED.lstrip().splitlines(), 1) if "F.batch_norm(" in text)
    warning = next(w for w in out.plan.warnings if "micro-batches by its own batch statistics" in w)
    assert warning.startswith(f"{tmp_path / 'model.py'}:{line}:13: warning: torch.nn.functional.batch_norm ")
    assert "accumulating gradients over 2 micro-batches" in warning
    assert "\nBATCH_STATISTICS_PER_MICRO_BATCH = True" in out.files["__init__.py"]


@pytest.mark.slow
@pytest.mark.parametrize("name, plan", [("MIXED", ("--dp", "2")), ("MIXED", ("--pp", "2", "--micro-batches", "2")),
                                        ("PROJECTED", ("--dp", "2")), ("CLS_AFTER_BLOCKS", ("--pp", "2")),
                                        ("POS_BEFORE_CLS_AFTER", ("--pp", "2"))],
                         ids=["dp2", "pp2", "dp2-sequential-or-identity", "pp2-cls-token-after-the-blocks",
                              "pp2-tied-parameters-each-stage-uses-one-of"])
def test_cnns_with_batch_norm_train_like_one_device(tmp_path, name, plan):
    model = _write(tmp_path, globals()[name])
    result = subprocess.run([sys.executable, "-m", "nnscaler_cst.cli", "verify", str(model), *plan,
                             "-o", str(tmp_path / "out"), "--json"], capture_output=True, text=True, timeout=900)
    start = result.stdout.find("{")
    outcome = json.loads(result.stdout[start:]) if start >= 0 else None
    # the state compared holds the running statistics (pipelined: moved once per micro-batch)
    assert result.returncode == 0 and outcome and outcome["passed"] is True, result.stdout + result.stderr


NORM_OR_IDENTITY = '''
import torch
import torch.nn as nn


class ConvLayer(nn.Module):
    def __init__(self, cin, cout, norm=True):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1)
        self.norm = nn.BatchNorm2d(cout) if norm else nn.Identity()

    def forward(self, x):
        x = self.conv(x)
        x = self.norm(x)
        return torch.relu(x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = ConvLayer(3, 8)
        self.second = ConvLayer(8, 8, norm=False)

    def forward(self, x):
        return self.second(self.first(x)).pow(2).mean()


def build():
    return Net()


def example_inputs():
    return (torch.randn(4, 3, 8, 8),)
'''


def test_a_line_calling_batch_norm_in_one_instance_and_identity_in_another_runs_each(tmp_path):
    text = rewrite(analyze(_write(tmp_path, NORM_OR_IDENTITY)), PlanRequest(dp=2)).files["model.py"]
    assert "x = dp_batch_norm(x, self.norm, DP)" in text        # the dry run ran both instances


MIXED_RESIDUALS = '''
import torch
import torch.nn as nn


class Residual(nn.Module):
    def __init__(self, main):
        super().__init__()
        self.main = main

    def forward(self, x):
        return x + self.main(x)


class Mixer(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        return torch.tanh(self.proj(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.mix = Residual(Mixer(16))
        self.mlp = Residual(nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)))

    def forward(self, x):
        return self.mlp(self.mix(x)).pow(2).mean()


def build():
    return Net()


def example_inputs():
    return (torch.randn(4, 8, 16),)
'''


def test_a_call_line_running_a_sequential_in_one_instance_and_another_module_in_another(tmp_path):
    # each instance is a kind of its own (plan/instances.py): the nn.Sequential's MLP is cut apart
    # in its variant and split as Megatron's, the other module runs its own forward (verified by
    # hand: `verify --tp 2` passes)
    out = rewrite(analyze(_write(tmp_path, MIXED_RESIDUALS)), PlanRequest(plan="megatron", tp=2))
    assert not [w for w in out.plan.warnings if "keeps its weights whole" in w], out.plan.warnings
    assert out.plan.params["mlp.main.1.weight"]["tp"] == "S(0)" and out.plan.params["mlp.main.3.weight"]["tp"] == "S(1)"
    text = out.files["model.py"]
    assert "return x + (tp_reduce(torch.nn.functional.linear(self.main[1:3](tp_copy(self.main[0](x), TP))" in text
    assert "class Residual_1(Residual):\n    def forward(self, x):\n        return x + self.main(x)\n" in text, text


LAYER_SCALE = '''
import torch
import torch.nn as nn


class LayerScale(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.gamma = nn.Parameter(1e-1 * torch.ones(dim, 1, 1))

    def forward(self, x):
        return x * self.gamma


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.fc1 = nn.Conv2d(dim, 4 * dim, 1)
        self.fc2 = nn.Conv2d(4 * dim, dim, 1)
        self.layer_scale = LayerScale(dim)

    def forward(self, x):
        return x + self.layer_scale(self.fc2(torch.relu(self.fc1(x))))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.mix = nn.Conv2d(3, 3, 1)
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.blocks = nn.ModuleList([Block(16) for _ in range(2)])
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        x = self.stem(self.mix(x))
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=(2, 3))).pow(2).mean()


def build():
    return Net()


def example_inputs():
    return (torch.randn(4, 3, 8, 8),)
'''


def test_a_plan_solved_again_with_parameters_kept_whole_leaves_unsplittable_convs_whole(tmp_path):
    gammas = ("blocks.0.layer_scale.gamma", "blocks.1.layer_scale.gamma")
    out = rewrite(analyze(_write(tmp_path, LAYER_SCALE)), PlanRequest(plan="megatron", tp=2), whole_params=gammas)
    assert any("mix.weight" in w and "keeps its weights whole" in w for w in out.plan.warnings), out.plan.warnings
    assert "self.mix = nn.Conv2d(3, 3, 1)\n" in out.files["model.py"]
    assert "self.gamma = nn.Parameter(1e-1 * torch.ones(dim, 1, 1))\n" in out.files["model.py"]


def test_a_parameter_kept_whole_in_one_instance_leaves_the_line_whole_in_all(tmp_path):
    # one instance's fc2 cannot be built split (a plan solved again): its line is one site for
    # both blocks, so Megatron's "split every matrix" leaves that site be rather than conflict
    # with the parameter kept whole (diffusers' UNet2DModel re-plan was unsatisfiable)
    kept = ("blocks.0.fc2.bias", "blocks.0.fc2.weight")
    out = rewrite(analyze(_write(tmp_path, LAYER_SCALE)), PlanRequest(plan="megatron", tp=2), whole_params=kept)
    assert out.plan.params["blocks.0.fc2.weight"]["tp"] == "R"
    assert out.plan.params["blocks.1.fc2.weight"]["tp"] == "R"
    assert out.plan.params["blocks.1.fc1.weight"]["tp"] == "S(0)"


PROJECTED = '''
import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1)
        self.project = nn.Sequential(nn.Conv2d(cin, cout, 1), nn.BatchNorm2d(cout)) if cin != cout else nn.Identity()

    def forward(self, x):
        shortcut = self.project(x)
        return torch.relu(self.conv(x)) + shortcut


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = Block(3, 8)
        self.second = Block(8, 8)

    def forward(self, x):
        return self.second(self.first(x)).pow(2).mean()


def build():
    return Net()


def example_inputs():
    return (torch.randn(4, 3, 8, 8),)
'''


def test_batch_norm_in_a_sequential_other_instances_replace_runs_synced_through_the_whole_call(tmp_path):
    text = rewrite(analyze(_write(tmp_path, PROJECTED)), PlanRequest(dp=2)).files["model.py"]
    assert "shortcut = dp_layers(self.project, x, DP)  # each BatchNorm it runs sums its statistics over the " \
           "data-parallel ranks" in text


STATEMENTS = '''
import torch
import torch.nn as nn


class Wide(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        return torch.relu(self.conv(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 1), nn.ReLU())
        self.layer1 = Wide(8)
        self.layer2 = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        x = self.stem(x)
        x = self.layer1(x)
        x = self.layer2(x)
        return x.pow(2).mean()


def build():
    return Net()


def example_inputs():
    return (torch.randn(4, 3, 8, 8),)
'''


def test_a_small_sequential_before_a_chain_of_statements_is_not_cut(tmp_path):
    plan = plan_stages(analyze(_write(tmp_path, STATEMENTS)).graph, 2)
    # the stem's conv and activation are not the model's stages: the forward's statements are cut
    assert plan.trunk.statements is not None and plan.trunk.container == "Net.forward"
    assert plan.drop == {0: ["layer2"], 1: ["layer1.conv", "stem.0"]}


CLS_AFTER_BLOCKS = '''
import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.blocks = nn.ModuleList([Block(16) for _ in range(2)])
        self.cls_token = nn.Parameter(torch.randn(1, 1, 16))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        return self.head(x[:, 0]).pow(2).mean()


def build():
    return Net()


def example_inputs():
    return (torch.randn(4, 6, 8),)
'''


# CaiT's shape: a position embedding of the model itself read before the blocks, a class token
# read after them. The model's own parameters go together: both stages hold both, tied.
POS_BEFORE_CLS_AFTER = CLS_AFTER_BLOCKS.replace(
    "        self.cls_token = nn.Parameter(torch.randn(1, 1, 16))\n",
    "        self.cls_token = nn.Parameter(torch.randn(1, 1, 16))\n"
    "        self.pos_embed = nn.Parameter(torch.randn(1, 6, 16))\n").replace(
    "        x = self.embed(x)\n", "        x = self.embed(x) + self.pos_embed\n")


def test_the_models_own_parameter_read_after_the_blocks_is_held_by_the_last_stage(tmp_path):
    plan = plan_stages(analyze(_write(tmp_path, CLS_AFTER_BLOCKS)).graph, 2)
    assert plan.drop == {0: ["", "head"], 1: ["embed"]}



# torchvision's ConvNeXt and Swin: one nn.Sequential called once, `x = self.features(x)`, over a stem,
# groups of blocks (each an nn.Sequential) and a norm + conv downsample between them; the most
# repeated blocks are the second group's, inside the outer nn.Sequential
NESTED_GROUPS = '''
import torch
import torch.nn as nn


class ChannelNorm(nn.LayerNorm):
    def forward(self, x):
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.conv = nn.Conv2d(dim, dim, 3, padding=1, groups=dim)
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        return x + self.fc(self.conv(x).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class Net(nn.Module):
    def __init__(self, dims=(4, 8), depths=(1, 5)):
        super().__init__()
        layers = [nn.Sequential(nn.Conv2d(3, dims[0], 2, stride=2), ChannelNorm(dims[0]))]
        for i, (dim, depth) in enumerate(zip(dims, depths)):
            if i:
                layers.append(nn.Sequential(ChannelNorm(dims[i - 1]), nn.Conv2d(dims[i - 1], dim, 2, stride=2)))
            layers.append(nn.Sequential(*[Block(dim) for _ in range(depth)]))
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(dims[-1], 10)

    def forward(self, x):
        x = self.features(x)
        return self.head(x.mean((2, 3))).pow(2).mean()


def build():
    return Net()


def example_inputs():
    return (torch.randn(2, 3, 8, 8),)
'''


def test_blocks_grouped_in_a_sequential_inside_the_one_called_are_cut_between_its_children(tmp_path):
    """Cutting the blocks' own nn.Sequential left each stage running the whole outer one: stage 0
    ran the downsample's norm after its blocks, whose weights stage 1 held (the dry run raised
    "native_layer_norm computes with features.2.0.weight, which another pipeline stage holds")."""
    analysis = analyze(_write(tmp_path, NESTED_GROUPS))
    plan = plan_stages(analysis.graph, 2)
    assert plan.trunk.container == "features"
    assert plan.blocks == ["features.0", "features.1", "features.2", "features.3"]
    assert plan.drop[0] == ["head"]
    rewrite(analysis, PlanRequest(pp=2))        # the dry run: each stage holds what its forward reads


ACTIVATION_CALLED_TWICE = STATEMENTS.replace(
    "        self.layer2 = nn.Conv2d(8, 8, 3, padding=1)\n",
    "        self.layer2 = nn.Conv2d(8, 8, 3, padding=1)\n        self.act = nn.ReLU()\n").replace(
    "        x = self.layer2(x)\n",
    "        x = self.act(self.layer2(self.act(x)))\n")


def test_an_activation_called_twice_is_not_called_shared_weights(tmp_path):
    # one ReLU called twice holds no weights to share (DLA's tree1.relu): the statements are cut
    plan = plan_stages(analyze(_write(tmp_path, ACTIVATION_CALLED_TWICE)).graph, 2)
    assert plan.trunk.statements is not None and not plan.tied


# ALBERT's shape: one layer whose weights every iteration of a loop shares
SHARED_IN_A_LOOP = '''
import torch
import torch.nn as nn


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.layer = Layer()
        self.head = nn.Linear(8, 8)

    def forward(self, x):
        h = self.embed(x)
        for _ in range(4):
            h = self.layer(h)
        return self.head(h).pow(2).mean()


def build():
    return Net()


def example_inputs():
    return (torch.randn(4, 8),)
'''


# swin3d's `x = self.features(x)`: an nn.Sequential of stages (Sequentials of blocks) and patch
# merging layers, the largest stage's blocks nested inside it
BLOCKS_NESTED_IN_STAGES = '''
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return x + self.fc(self.norm(x))


class Merge(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.proj = nn.Linear(d, 2 * d)

    def forward(self, x):
        return self.proj(self.norm(x))


class Model(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.features = nn.Sequential(nn.Sequential(Block(d), Block(d)), Merge(d),
                                      nn.Sequential(*[Block(2 * d) for _ in range(4)]), Merge(2 * d),
                                      nn.Sequential(Block(4 * d)))
        self.head = nn.Linear(4 * d, 3)

    def forward(self, x):
        x = self.features(x)
        return self.head(x)


def build():
    torch.manual_seed(0)
    return Model()


def example_inputs():
    return (torch.randn(4, 5, 8, generator=torch.Generator().manual_seed(1)),)


def loss(output):
    return (output - 1).pow(2).mean()
'''


def test_blocks_nested_in_a_sequential_of_stages_are_cut_between_its_children(tmp_path):
    """A cut between the nested blocks ran the layers after them on the first stage too, whose
    weights the next stage holds (was: internal error, the dry run's layer norm met hollow weights)."""
    result = rewrite(analyze(_write(tmp_path, BLOCKS_NESTED_IN_STAGES)), PlanRequest(pp=2, micro_batches=2))
    assert 'PIPELINE_BLOCKS = "features"' in result.files["model_stage0.py"]


def test_a_loop_calling_one_shared_layer_is_cut_between_its_iterations(tmp_path):
    # (tests/test_shared_layer_loop.py: the rank files and a gloo run)
    plan = plan_stages(analyze(_write(tmp_path, SHARED_IN_A_LOOP)).graph, 2)
    assert plan.trunk.blocks == ["layer"] * 4 and plan.block_ranges == [(0, 2), (2, 4)]
    assert sorted(name for group in plan.shared for name in group) == ["layer.fc.bias", "layer.fc.weight"]
