"""Spec of ZeRO-3's root unit between its uses and of a ZeRO-3 model's state dict
(nnscaler_cst/runtime/_comm.py ZeroShards), in one process: a data-parallel axis of one rank
gathers by copying, so the gathers, frees and hooks run as on many ranks, without processes.

The root unit (what lies outside the ModuleList's blocks: embedding, final norm, head) is freed
while the blocks run, forward and backward, and gathered for what uses it; where a block reads it
(a parameter the blocks share), it stays whole. `model.state_dict()` hands back the whole
parameters (with storage), `load_state_dict()` writes them into the shard.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from nnscaler_cst.runtime import _comm


class Block(nn.Module):
    def __init__(self, width, shared=None):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)
        self.shared = shared        # a parameter of the root module, read inside every block

    def forward(self, x):
        y = self.fc(self.norm(x))
        if self.shared is not None:
            y = y * self.shared[0]
        return x + torch.tanh(y)


class TinyLM(nn.Module):
    """Embedding, blocks, final norm and a head tied to the embedding."""

    def __init__(self, shared_in_blocks=False, vocab=11, width=8, depth=3):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.scale = nn.Parameter(torch.ones(1, width)) if shared_in_blocks else None
        self.blocks = nn.ModuleList(Block(width, self.scale) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return nn.functional.cross_entropy(self.head(self.norm(x)).flatten(0, 1), tokens.flatten())


def zero3(model):
    return _comm.zero_shards(model, _comm.Axis("dp"), stage=3, average=True)


def step(model, shards, optimizer, tokens):
    """One step as the generated ZeRO-3 package runs it (forward_backward .. optimizer_step)."""
    _comm.all_gather_params(shards, shards.axis, units="root")
    loss = model(tokens)
    loss.backward()
    _comm.reduce_scatter_grads(shards, shards.axis)
    _comm.free_params(shards)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def whole(unit) -> bool:
    return unit.flat.untyped_storage().nbytes() > 0


@pytest.mark.parametrize("shared", [False, True])
def test_the_root_unit_is_freed_while_the_blocks_run_unless_a_block_reads_it(shared):
    torch.manual_seed(0)
    model = TinyLM(shared_in_blocks=shared)
    reference = copy.deepcopy(model)
    shards = zero3(model)
    optimizer = torch.optim.AdamW(shards.chunks, lr=1e-2)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    # per block forward and backward, whether the root unit is whole (its flag: a probe reading the
    # buffer would count as a block reading it); the last block's forward issues its gather, and its
    # backward hook runs before the unit's own, which frees the root
    root_whole = []
    for block in model.blocks:
        block.register_forward_pre_hook(lambda m, a: root_whole.append(shards.root.whole))
        block.register_full_backward_pre_hook(lambda m, g: root_whole.append(shards.root.whole))
    for k in range(3):
        tokens = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(k))
        root_whole.clear()
        loss = step(model, shards, optimizer, tokens)
        expected = reference(tokens)
        expected.backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad(set_to_none=True)
        assert loss == pytest.approx(expected.item(), abs=1e-6), k
    assert root_whole == ([True] * 6 if shared else [False, False, True, True, False, False]), root_whole
    assert shards.root_between is (not shared)
    with torch.no_grad():       # a forward outside the step (evaluation): the hooks gather what it reads
        assert model(tokens).item() == pytest.approx(reference(tokens).item(), abs=1e-6)
    state = model.state_dict()
    for key, value in reference.state_dict().items():
        assert torch.allclose(state[key], value, atol=1e-6), key


def test_a_zero3_state_dict_holds_the_whole_parameters_and_loads_into_the_shard():
    torch.manual_seed(0)
    model = TinyLM()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    shards = zero3(model)
    assert not any(whole(u) for u in shards.units if u is not shards.root)     # blocks freed at once
    _comm.free_params(shards)
    state = model.state_dict()
    assert state.keys() == expected.keys()
    for key, value in expected.items():
        assert state[key].untyped_storage().nbytes() > 0 and torch.equal(state[key], value), key
    assert not any(whole(u) for u in shards.units)     # freed again after the call
    torch.save(state, __import__("io").BytesIO())       # what a user does with it
    changed = {k: v + 1 for k, v in expected.items()}
    model.load_state_dict(changed)
    assert not any(whole(u) for u in shards.units)
    for key, value in model.state_dict().items():
        assert torch.equal(value, changed[key]), key
    assert _comm.state_dict_keys(model) == list(expected) and not any(whole(u) for u in shards.units)
