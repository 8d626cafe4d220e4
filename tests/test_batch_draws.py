"""A random draw shaped by the batch (PhiMoE's Gumbel sampling of experts, `rand_like(best)`):
one generator fills the whole batch on one device, so no slice of the batch draws the numbers
its samples get there; refused at its line under --dp and micro-batches.
"""
from __future__ import annotations

import textwrap

from nnscaler_cst.analysis import analyze
from nnscaler_cst.plan.batch import batch_split_problem

ROUTER = textwrap.dedent('''
    import torch
    import torch.nn as nn


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.router = nn.Linear(8, 4)
            self.out = nn.Linear(8, 8)

        def forward(self, x):
            scores = torch.softmax(self.router(x), dim=-1)
            best = scores.amax(dim=-1, keepdim=True)
            agree = (best > 0.5).float()
            return (self.out(x) * best * agree).pow(2).mean()


    def build():
        return Net()


    def example_inputs():
        return (torch.randn(4, 8),)
''')

DRAW = "        agree = agree * (torch.rand_like(best) > 0.75)"


def _problem(tmp_path, source):
    path = tmp_path / "router.py"
    path.write_text(source)
    return batch_split_problem(analyze(path).graph, "data parallel (--dp 2)")


def test_the_router_without_a_draw_splits(tmp_path):
    assert _problem(tmp_path, ROUTER) is None


def test_a_random_draw_shaped_by_the_batch_is_refused_at_its_line(tmp_path):
    anchor = "        agree = (best > 0.5).float()\n"
    problem = _problem(tmp_path, ROUTER.replace(anchor, anchor + DRAW + "\n"))
    assert problem is not None and "torch.rand_like draws random numbers" in problem.message
    assert problem.location.line == ROUTER.replace(anchor, anchor + DRAW + "\n").splitlines().index(DRAW) + 1


# the network every router model here sits in: the router, then a Linear and a loss
NET_AROUND_ROUTER = textwrap.dedent('''
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.router = Router()
            self.out = nn.Linear(8, 8)

        def forward(self, x):
            return self.out(self.router(x)).pow(2).mean()


    def build():
        return Net()


    def example_inputs():
        return (torch.randn(4, 8),)
''')


INSIDE_A_ROUTER = textwrap.dedent('''
    import torch
    import torch.nn as nn


    class Router(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(8, 4)

        def forward(self, x):
            scores = self.gate(x)
            top = scores.max(dim=-1).indices
            jitter = torch.rand_like(scores)
            pick = (scores + jitter).argmax(dim=-1)
            return x * (pick == top).float().unsqueeze(-1)

''') + NET_AROUND_ROUTER


def test_a_draw_inside_a_module_the_probe_finds_keeps_samples_apart_is_still_refused(tmp_path):
    """The batch probe runs the module on half the batch with the same seed: the first half of the
    same numbers, which no second rank or micro-batch draws (PhiMoE PP=2 verified wrong)."""
    problem = _problem(tmp_path, INSIDE_A_ROUTER)
    assert problem is not None and "torch.rand_like draws random numbers" in problem.message


GUMBEL = textwrap.dedent('''
    import torch
    import torch.nn as nn


    class Router(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(8, 4)

        def forward(self, x):
            scores = self.gate(x)
            picked = (
                scores - torch.empty_like(scores).exponential_().log()
            ).max(dim=-1)[1].unsqueeze(-1)
            gates = torch.softmax(scores, dim=-1)
            best, best_at = gates.max(dim=-1, keepdim=True)
            keep = torch.logical_or(picked == best_at, torch.rand_like(best) > 0.75)
            return x * gates.gather(-1, picked) * keep.float()

''') + NET_AROUND_ROUTER


def test_a_draw_into_a_tensor_only_shaped_like_the_batch_is_refused_at_its_line(tmp_path):
    """PhiMoE's Gumbel sampling, `empty_like(scores).exponential_()`: the draw reads only the shape
    of the batch, and is the op to name, not the `max` over the numbers drawn a few lines on."""
    path = tmp_path / "gumbel.py"
    path.write_text(GUMBEL)
    problem = batch_split_problem(analyze(path).graph, "micro-batches (--pp 2)", across_ranks=False)
    assert problem is not None and "Tensor.exponential_ draws random numbers" in problem.message
    assert problem.location.line == GUMBEL.splitlines().index(
        "            scores - torch.empty_like(scores).exponential_().log()") + 1


ARGMAX = textwrap.dedent('''
    import torch
    import torch.nn as nn


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(8, 4)
            self.out = nn.Linear(8, 8)

        def forward(self, x):
            scores = self.gate(x)
            picked = scores.argmin(dim=-1, keepdim=True)
            best, best_at = torch.softmax(scores, dim=-1).max(dim=-1, keepdim=True)
            keep = (picked == best_at).float()
            return self.out(x * best * keep).pow(2).mean()


    def build():
        return Net()


    def example_inputs():
        return (torch.randn(4, 8),)
''')


def test_the_indices_of_a_max_over_a_dim_keep_the_samples_apart(tmp_path):
    """`best, best_at = gates.max(dim=-1)`: both results are rows of the batch; the indices read
    later are no value hidden inside the call."""
    path = tmp_path / "argmax.py"
    path.write_text(ARGMAX)
    assert batch_split_problem(analyze(path).graph, "data parallel (--dp 2)") is None


def test_a_stochastic_depth_mask_drawn_into_a_tensor_shaped_like_the_batch_still_splits(tmp_path):
    """timm's DropPath, `x.new_empty((b, 1)).bernoulli_(keep)`: a dropout, switched off in both runs
    of a verify, not a draw the batch check refuses."""
    path = tmp_path / "drop_path.py"
    path.write_text(ARGMAX.replace(
        "        return self.out(x * best * keep).pow(2).mean()\n",
        "        drop = x.new_empty((x.shape[0], 1)).bernoulli_(0.9)\n"
        "        return self.out(x * best * keep * drop).pow(2).mean()\n"))
    assert "bernoulli_" in path.read_text()
    assert batch_split_problem(analyze(path).graph, "data parallel (--dp 2)") is None
