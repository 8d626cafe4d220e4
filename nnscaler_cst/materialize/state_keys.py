"""The tensor-parallel split of state-dict keys that modules' state_dict() hooks write.

A module may save its parameters under other names and layouts than it holds them
(torchtitan's FusedQKVLinear holds one fused `wqkv` and saves `wq`, `wk`, `wv`; its
load_state_dict pre-hook fuses them back). The output's shard_state_dict and
merge_state_dicts slice and join state dicts by key, so each such key needs its own split.
It is found by running the hooks on each rank's share: the single-device model is built, each
hooked module's split parameters are cut to one rank's slice at a time (its size attributes
made local, as the rank's build does), and each key it then saves is matched with a slice of
the same key saved whole. Decides splits only; writes no source.
"""
from __future__ import annotations

import torch

from ..errors import Location, UserError, display_path
from ..plan.layouts import R, Layout


def hooked_key_splits(analysis, param_layout: dict[str, Layout], n: int) -> dict[str, tuple[int, int]]:
    """State-dict key -> (dim, fused blocks) of each key a hooked module writes split; keys
    saved whole are left out. Raises where a saved key is no slice of the whole one."""
    hooked = analysis.trace.state_dict_hooked
    params = analysis.trace.params
    splits = {(path, name): param_layout[name] for path in hooked for name in params
              if name.startswith(f"{path}." if path else "") and param_layout.get(name, R).kind == "S"}
    if not splits:
        return {}
    model = analysis.entry.build_fn()
    found: dict[str, tuple[int, int]] = {}
    for path in hooked:
        mine = {name[len(path) + 1 if path else 0:]: layout for (p, name), layout in splits.items() if p == path}
        if not mine:
            continue
        module = model.get_submodule(path)
        prefix = f"{path}." if path else ""
        with torch.no_grad():
            generator = torch.Generator().manual_seed(0)
            for p in module.parameters():     # distinct values: no two slices alike (a zero init)
                p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float64).to(p.dtype))
            whole = module.state_dict(prefix=prefix)
            ranks = [_saved_by_rank(analysis, module, mine, n, r, prefix) for r in range(n)]
        own = {prefix + k for k, _ in module.named_parameters()} | {prefix + k for k, _ in module.named_buffers()}
        groups = sorted({layout.groups for layout in mine.values()})
        for key, tensor in whole.items():
            if key in own:
                continue
            split = _matching_slice(tensor, [saved[key] for saved in ranks], groups)
            if split is None:
                raise UserError(f"the state dict of {path or 'the model'} ({type(module).__qualname__}) saves {key} "
                                "in a layout no slice of the whole one gives, once its parameters are split",
                                Location(display_path(analysis.entry.path)),
                                hint="keep this module's parameters whole (a [[op]] rule pinning it replicated)")
            if split != "whole":
                found[key] = split
    return found


def _saved_by_rank(analysis, module, layouts: dict[str, Layout], n: int, rank: int, prefix: str) -> dict:
    """What `module.state_dict()` saves with its split parameters cut to `rank`'s slice."""
    sizes = analysis.rules.size_attributes
    kept = []
    try:
        for name, layout in layouts.items():
            owner_name, _, attr = name.rpartition(".")
            owner = module.get_submodule(owner_name)
            whole = owner._parameters[attr]
            info = analysis.trace.params.get(prefix + name)
            per_dim = sizes(info.module_type).get(attr, []) if info is not None else []
            names = per_dim[layout.dim] if layout.dim < len(per_dim) else ()
            attributes = {a: getattr(owner, a) for a in names if getattr(owner, a, None) == whole.shape[layout.dim]}
            kept.append((owner, attr, whole, attributes))
            owner._parameters[attr] = torch.nn.Parameter(_slice(whole, layout.dim, layout.groups, n, rank))
            for a in attributes:
                setattr(owner, a, whole.shape[layout.dim] // n)
        return module.state_dict(prefix=prefix)
    finally:
        for owner, attr, whole, attributes in reversed(kept):
            owner._parameters[attr] = whole
            for a, value in attributes.items():
                setattr(owner, a, value)


def _slice(t: torch.Tensor, dim: int, groups: int, n: int, rank: int) -> torch.Tensor:
    """The output's shard(): `rank`'s slice of every one of the `groups` blocks of `dim`."""
    dim %= t.dim()
    blocks = t.unflatten(dim, (groups, t.shape[dim] // groups))
    return blocks.chunk(n, dim=dim + 1)[rank].flatten(dim, dim + 1)


def _matching_slice(whole: torch.Tensor, saved: list[torch.Tensor], groups: list[int]):
    """(dim, groups) such that each rank saved that slice of the whole key, "whole" when each
    saved it whole, or None."""
    n = len(saved)
    if all(s.shape == whole.shape and torch.equal(s, whole) for s in saved):
        return "whole"
    for dim in range(whole.dim()):
        for g in [1, *groups]:
            if whole.shape[dim] % (g * n):
                continue
            if all(s.shape == _slice(whole, dim, g, n, r).shape and torch.equal(s, _slice(whole, dim, g, n, r))
                   for r, s in enumerate(saved)):
                return dim, g
    return None
