"""Source of the generated __init__.py and train.py. Torch only: the output never imports
nnscaler_cst. Filled with str.format; literal braces are doubled.
"""

INIT = '''"""{title}

build(rank)                 this rank's model (its source: the program program(rank) names)
shard_state_dict(sd, rank)  a single-device state dict -> this rank's share of it
merge_state_dicts(sds)      every rank's state dict -> one single-device state dict

Training in your own loop (train.py is one such loop; docs: docs/training.md of nnscaler-rewrite):
setup()                                 process groups of this mesh (torchrun's RANK, WORLD_SIZE)
optimizer_params(model)                 what the optimizer steps (ZeRO: this rank's shard)
forward_backward(model, batch)          this rank's share of the full batch, forward and backward
                                        (a pipeline: its whole schedule); the full batch's loss
finish_backward(model)                  every gradient sync the plan needs
clip_grad_norm(model, max_norm)         the single-device model's gradient norm, clipped
optimizer_step(model, optimizer)        the step, gradients cleared
save_checkpoint / load_checkpoint       torch.distributed.checkpoint, keyed by single-device names
merged_state_dict(model)                the single-device state dict, on every rank
"""
import importlib
import os
from collections import OrderedDict

import torch
import torch.distributed as dist

from . import _comm

WORLD_SIZE = {world}
TP_SIZE = {tp}  # rank = (pp_rank * DP_SIZE + dp_rank) * TP_SIZE + tp_rank: tp varies fastest
DP_SIZE = {dp}
PP_SIZE = {pp}

# Parameters (and the buffers built with them) split over the tensor-parallel axis: name -> (dim, groups). A dim with
# groups > 1 holds that many fused blocks (q|k|v), each split alike. All others are whole.
TP_SPLITS = {{
{splits}}}

# Parameters reachable by several names (an embedding shared by encoder, decoder and head):
# every name -> all of them. A pipeline stage may hold such a parameter under any one name.
PARAMETER_ALIASES = {{
{aliases}}}

# Interlaced pipeline: parameters split on dim 0 (the vocabulary) over every tp x pp device,
# piece pp * TP_SIZE + tp on the device at pipeline index pp, tensor-parallel index tp.
PP_VOCAB_SPLITS = {vocab_splits!r}


def vocab_piece(rank):
    """The piece of a PP_VOCAB_SPLITS parameter that `rank` holds."""
    return coords(rank)["pp"] * TP_SIZE + coords(rank)["tp"]


def coords(rank):
    return {{"tp": rank % TP_SIZE, "dp": rank // TP_SIZE % DP_SIZE, "pp": rank // (TP_SIZE * DP_SIZE)}}


# The program (a module of this package) each pipeline rank runs. Tensor- and data-parallel
# peers run the same one: it reads their coordinates from _comm's process groups at run time.
PROGRAMS = {programs!r}


def program(rank):
    """The name of the module `rank` runs."""
    return PROGRAMS[coords(rank)["pp"]]


def rank_module(rank):
    return importlib.import_module(f"{{__name__}}.{{program(rank)}}")


def build(rank):
    """This rank's model; with pipeline stages, a ModuleList of the stages it runs."""
    module = rank_module(rank)
    if PP_SIZE == 1:
        return module.build()
    stages = torch.nn.ModuleList(keep_stage(module.build(), stage, module) for stage in module.PIPELINE_STAGES)
    if getattr(module, "VOCAB_MODULES", None):   # interlaced: split on the vocabulary over tp x pp
        from ._comm import vocab_split
        for stage in stages:
            vocab_split(stage, module.VOCAB_MODULES, getattr(module, "VOCAB_LOSSES", ()))
    return stages


def keep_stage(model, stage, module):
    """Keep only what one pipeline stage runs: its range of blocks, none of the dropped modules."""
    for path, (start, stop) in stage_blocks(module, stage).items():
        parent_name, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_name)
        blocks = getattr(parent, name)
        if isinstance(blocks, torch.nn.ModuleDict):    # keyed "0", "1", ...: renumbered as a list's, its type kept
            kept = list(blocks.values())[start:stop]
            blocks.clear()
            blocks.update((str(index), block) for index, block in enumerate(kept))
            continue
        kept = list(blocks)[start:stop]
        setattr(parent, name, torch.nn.Sequential(*kept) if isinstance(blocks, torch.nn.Sequential)
                else torch.nn.ModuleList(kept))
    if not isinstance(module.STAGE_BLOCKS[stage], dict):     # mirrored files count blocks from here
        from ._comm import PIPE
        PIPE.first_blocks[stage] = module.STAGE_BLOCKS[stage][0]
        if getattr(module, "PIPELINE_ITERATIONS", None):     # the loop's iterations this stage runs
            PIPE.iterations[stage], PIPE.iteration_count = module.STAGE_BLOCKS[stage], module.PIPELINE_ITERATIONS
    if hasattr(module, "PIPELINE_CUT_OWNER"):     # this module's call of the cut function is the one cut
        model.get_submodule(module.PIPELINE_CUT_OWNER).pp_cut_here = True
    returned = {{}}     # chained trunks: what each trunk returned on this stage, handed on with the activations
    for owner, part in getattr(module, "STAGE_TRUNKS", {{}}).get(stage, {{}}).items():
        trunk = model.get_submodule(owner)
        trunk.pp_owner, trunk.pp_trunk, trunk.pp_returned = owner, part, returned
        for path, count in getattr(module, "PIPELINE_ITERATIONS", {{}}).items():   # its loop's iterations in all
            if path.startswith(owner + "."):
                trunk.pp_iteration_count = count
    iterated = getattr(module, "PIPELINE_ITERATIONS", {{}})     # lists whose loop counts every entry
    iterated = iterated if isinstance(iterated, dict) else {{module.PIPELINE_BLOCKS: iterated}}
    # each dropped path resolved before any is unlinked: one object can sit under several of
    # them (a module shared by blocks, under each block's name), and is dropped once
    drops = {{path: (model.get_submodule(path.rpartition(".")[0]), model.get_submodule(path))
             for path in module.STAGE_DROPS[stage] if path}}
    dropped = set()
    for path in module.STAGE_DROPS[stage]:
        if not path:      # the model's own parameters (a cls_token), not its submodules
            hollow(model, path, own_only=True)
            continue
        owner_name, _, attr = path.rpartition(".")
        owner, sub = drops[path]
        if id(sub) in dropped:      # dropped under another name already: unlink this name too
            setattr(owner, attr, None)
            continue
        dropped.add(id(sub))
        if isinstance(owner, torch.nn.ModuleDict) and owner_name not in iterated:
            del owner[attr]
        elif shared_outside(model, path):     # a module object also registered elsewhere: unlink only
            setattr(owner, attr, None)
        else:
            hollow(sub, path)
    for path in getattr(module, "STAGE_SHADOWS", {{}}).get(stage, []):   # run here, trained where owned
        # "": the model's own parameters (a pos_embedding read above the cut function), not its submodules'
        for name, param in model.get_submodule(path).named_parameters(prefix=path, recurse=bool(path)):
            if name not in module.TIED_PARAMETERS and name not in getattr(module, "SHARED_PARAMETERS", ()):
                param.requires_grad_(False)
    return model


class Hollow(torch.Tensor):
    """What a stage keeps of a parameter or buffer another stage holds: its dtype, shape and
    device, for code every stage runs that reads them (`self.decoder.embed_tokens.weight.dtype`).
    No storage; computing with it raises."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, like, name):
        hollow = torch.Tensor._make_wrapper_subclass(cls, like.shape, dtype=like.dtype, device=like.device)
        hollow.held_elsewhere = name
        return hollow

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        names = [a.held_elsewhere for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, Hollow)]
        raise RuntimeError(f"{{func}} computes with {{', '.join(names)}}, which another pipeline stage holds: "
                           "this stage keeps only its dtype, shape and device")

    def __repr__(self):
        return f"Hollow({{self.held_elsewhere}}, shape={{tuple(self.shape)}}, dtype={{self.dtype}})"


def shared_outside(model, path):
    """Whether a module under `path` is also registered under another path (one object, two names)."""
    inside = {{id(m) for m in model.get_submodule(path).modules()}}
    return any(id(m) in inside for name, m in model.named_modules(remove_duplicate=False)
               if name != path and not name.startswith(path + "."))


def hollow(dropped, path, own_only=False):
    """A module this stage does not run: its parameters and buffers become Hollow attributes,
    outside the state dict and the optimizer; calling it raises. `own_only`: only the module's
    own parameters and buffers, not its submodules' (the model's cls_token)."""
    for prefix, sub in [(path, dropped)] if own_only else dropped.named_modules(prefix=path):
        for store in (sub._parameters, sub._buffers):
            for name, value in list(store.items()):
                del store[name]
                if value is not None:
                    object.__setattr__(sub, name, Hollow(value, f"{{prefix}}.{{name}}" if prefix else name))
        # nor does it read the state dict: BatchNorm's loading adds num_batches_tracked to a state
        # dict saved without versions (a shard), which would be an unexpected key here
        object.__setattr__(sub, "_load_from_state_dict", lambda *args, **kwargs: None)


def stage_blocks(module, stage):
    """{{block list: (first, stop)}}: the blocks of each list one stage holds (several lists when
    the stages cut a chain of them: an encoder's blocks, then a decoder's)."""
    iterated = getattr(module, "PIPELINE_ITERATIONS", None)    # lists kept whole, the others' blocks hollow
    blocks = module.STAGE_BLOCKS[stage]
    if not isinstance(blocks, dict):
        return {{}} if iterated else {{module.PIPELINE_BLOCKS: blocks}}
    return {{path: kept for path, kept in blocks.items() if path not in (iterated or {{}})}}


def stage_key(name, stage, module):
    """A single-device parameter name as one stage of `module` calls it, or None if not held."""
    for path, (start, stop) in stage_blocks(module, stage).items():
        prefix = path + "."
        if name.startswith(prefix):
            index, _, rest = name[len(prefix):].partition(".")
            return f"{{prefix}}{{int(index) - start}}.{{rest}}" if start <= int(index) < stop else None
    if any(name == d or name.startswith(d + ".") or (not d and "." not in name) for d in module.STAGE_DROPS[stage]):
        return None
    return name


def global_key(key, stage, module):
    for path, (start, _) in stage_blocks(module, stage).items():
        prefix = path + "."
        if key.startswith(prefix):
            index, _, rest = key[len(prefix):].partition(".")
            return f"{{prefix}}{{int(index) + start}}.{{rest}}"
    return key


def shard(tensor, dim, groups, tp_rank):
    """This tensor-parallel rank's slice of every block of `dim`."""
    blocks = tensor.unflatten(dim, (groups, tensor.shape[dim] // groups))
    return blocks.chunk(TP_SIZE, dim=dim + 1)[tp_rank].flatten(dim, dim + 1).clone()


def unshard(pieces, dim, groups):
    blocks = [p.unflatten(dim, (groups, p.shape[dim] // groups)) for p in pieces]
    return torch.cat(blocks, dim=dim + 1).flatten(dim, dim + 1)


def shard_state_dict(state_dict, rank):
    """This rank's share: its stages' parameters (renamed as the stage calls them), TP-sliced."""
    tp_rank = coords(rank)["tp"]

    def share(name, t):
        if name in PP_VOCAB_SPLITS:     # interlaced: this device's rows of the vocabulary
            return t.chunk(PP_SIZE * TP_SIZE, dim=0)[vocab_piece(rank)].clone()
        return shard(t, *TP_SPLITS[name], tp_rank) if name in TP_SPLITS else t.clone()

    # each module's entry of the state dict's metadata (its `version`, which a layer's own
    # _load_from_state_dict may require) goes with it
    metadata = getattr(state_dict, "_metadata", None)
    if PP_SIZE == 1:
        out = OrderedDict((name, share(name, t)) for name, t in state_dict.items())
        if metadata is not None:
            out._metadata = OrderedDict(metadata)
        return out
    module = rank_module(rank)
    out = OrderedDict()
    if metadata is not None:
        out._metadata = OrderedDict()
    for local, stage in enumerate(module.PIPELINE_STAGES):
        for name, t in state_dict.items():
            for alias in PARAMETER_ALIASES.get(name, [name]):
                key = stage_key(alias, stage, module)
                if key is not None:
                    out[f"{{local}}.{{key}}"] = share(name, t)
        for prefix, meta in (metadata or {{}}).items():
            try:    # a module's path is a parameter's, less its last name
                key = stage_key(f"{{prefix}}.x" if prefix else "x", stage, module)
            except ValueError:      # a list of blocks itself: named alike on every stage
                key = f"{{prefix}}.x"
            if key is not None:
                out._metadata[f"{{local}}.{{key[:-2]}}" if key != "x" else str(local)] = meta
    return out


def merge_state_dicts(state_dicts):
    """The single-device state dict back from every rank's (data-parallel replica 0 suffices)."""
    merged = {{}}
    for pp in range(PP_SIZE):
        ranks = [pp * DP_SIZE * TP_SIZE + tp for tp in range(TP_SIZE)]
        module = rank_module(ranks[0])
        for key, t in state_dicts[ranks[0]].items():
            if PP_SIZE == 1:
                name = key
            else:
                local, _, rest = key.partition(".")
                name = global_key(rest, module.PIPELINE_STAGES[int(local)], module)
            if name in merged:
                continue  # a tied weight held by two stages: both copies are equal
            if name in PP_VOCAB_SPLITS:    # interlaced: every tp x pp device holds rows of it
                merged[name] = torch.cat([state_dicts[p * DP_SIZE * TP_SIZE + t][key] for p in range(PP_SIZE)
                                          for t in range(TP_SIZE)], dim=0)
                continue
            merged[name] = unshard([state_dicts[r][key] for r in ranks], *TP_SPLITS[name]) \
                if name in TP_SPLITS else t.clone()
    for name in list(merged):
        for alias in PARAMETER_ALIASES.get(name, []):
            merged.setdefault(alias, merged[name])
    return merged
{training}'''

TRAIN = '''"""torchrun entry for {source} ({plan}): a loop of the training API in __init__.py.

    torchrun --nproc-per-node {world} {folder}/train.py --steps 10

Initialises torch.distributed (NCCL and the local GPU when CUDA is there, gloo on CPU
otherwise), builds this rank's model, optionally loads its share of a single-device state dict
(--init) or resumes a sharded checkpoint (--resume), and trains on the entry file's
example_inputs() or on the batches a generator of yours yields (--data MODULE:FN).
"""
import argparse
import importlib
import os
import sys

import torch

if __package__ in (None, ""):  # run as a script: import the output folder as a package
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.dirname(_here))
    __package__ = os.path.basename(_here)
    importlib.import_module(__package__)

from . import PRECISIONS, build, clip_grad_norm, finish_backward, forward_backward, load_checkpoint
from . import optimizer_params, optimizer_step, rank_module, save_checkpoint, setup, shard_state_dict, use_precision
from . import _comm


def batch_for(module, step, seed, device):
    torch.manual_seed(seed + step)  # every rank draws the same full batch
    batch = module.example_inputs()
    return moved(batch, device)


def moved(batch, device):
    return _comm.map_tensors(lambda x: x.to(device), batch)


def user_batches(spec, start, device):
    """--data MODULE:FN: FN() yields full batches (the same on every rank), as example_inputs()
    returns one; a resumed run skips the batches of the steps already taken. MODULE is found from
    the working directory, as `python -m` finds it."""
    sys.path.insert(0, os.getcwd())
    module_name, _, function = spec.partition(":")
    batches = getattr(importlib.import_module(module_name), function)()
    for step, batch in enumerate(batches):
        if step >= start:
            yield moved(batch, device)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10, help="the step to stop before (a resumed run goes on)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--init", help="single-device state dict (torch.save) to start from")
    parser.add_argument("--precision", choices=sorted(PRECISIONS), help="forward's compute dtype (autocast); "
                        "default the one rewritten in")
    parser.add_argument("--max-grad-norm", type=float, help="clip the gradients' global norm to this")
    parser.add_argument("--save", help="write a sharded checkpoint (torch.distributed.checkpoint) here at the end")
    parser.add_argument("--resume", help="a checkpoint folder (--save) to go on from, under any plan")
    parser.add_argument("--data", help="MODULE:FN, a generator of full batches (default: example_inputs())")
    args = parser.parse_args()
    rank = setup()
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    if args.precision:
        use_precision(args.precision)
    module = rank_module(rank)
    torch.manual_seed(args.seed)
    model = build(rank)
    if args.init:
        model.load_state_dict(shard_state_dict(torch.load(args.init), rank))
    model.to(device).train()
    optimizer = torch.optim.AdamW(optimizer_params(model), lr=args.lr)
    progress = {{"step": 0}}
    if args.resume:
        load_checkpoint(args.resume, model, optimizer, progress)
    batches = user_batches(args.data, progress["step"], device) if args.data else None
    for step in range(progress["step"], args.steps):
        batch = next(batches, None) if batches else batch_for(module, step, args.seed, device)
        if batch is None:
            break
        loss = forward_backward(model, batch)
        finish_backward(model)
        if args.max_grad_norm is not None:
            clip_grad_norm(model, args.max_grad_norm)
        optimizer_step(model, optimizer)
        progress["step"] = step + 1
        if rank == 0:
            print(f"step {{step}} loss {{loss:.6f}}", flush=True)
    if args.save:
        save_checkpoint(args.save, model, optimizer, progress)
    _comm.teardown()


if __name__ == "__main__":
    main()
'''


# The micro-batches of a step: a pipeline's, or gradient accumulation's without one
MICRO_BATCHES_SPLIT = '''MICRO_BATCHES = {micro}


def micro_batches(batch):
    """The batch in MICRO_BATCHES equal slices of dim 0."""
    return [_comm.map_tensors(lambda x: x.chunk(MICRO_BATCHES, dim=0)[m] if x.dim() > 0 else x, batch)
            for m in range(MICRO_BATCHES)]
'''

PIPELINE_STEP = MICRO_BATCHES_SPLIT + '''

def replica_grads(stages, module):
    """Pipelines that are replicas (Chimera) hold each model stage on several stages: every copy
    of a single-device parameter, on this rank (one per stage it runs; a tied weight under each
    of its names) and on the ranks holding the same model stages (_comm.PP_REPLICA), ends with
    the sum of all their gradients."""
    copies = {{}}
    for key, param in stages.named_parameters():
        if not param.requires_grad:       # a shadow: trained on the stage that owns it
            continue
        local, _, rest = key.partition(".")
        if rest in getattr(module, "SHARED_PARAMETERS", ()):   # summed over every stage: shared_grads
            continue
        name = global_key(rest, module.PIPELINE_STAGES[int(local)], module)
        copies.setdefault(min(PARAMETER_ALIASES.get(name, [name])), []).append(param)
    firsts = []
    for name in sorted(copies):       # the same names, in the same order, on every rank of the group
        params = copies[name]
        grads = [p.grad for p in params if p.grad is not None]
        params[0].grad = torch.stack(grads).sum(0) if grads else torch.zeros_like(params[0])
        firsts.append(params[0])
    _comm.sync_grads(firsts, _comm.PP_REPLICA, average=False)
    for name in sorted(copies):
        for param in copies[name][1:]:
            param.grad = copies[name][0].grad.clone()


def shared_grads(stages, module):
    """Parameters of a module that code above the cut function runs on every stage, whose output
    later stages compute with (module.SHARED_PARAMETERS): each stage's copy holds that stage's
    share of the gradient; every copy, on this rank and on every other pipeline rank, ends with the
    sum, so that the copies stay equal after the optimizer step."""
    shared = getattr(module, "SHARED_PARAMETERS", ())
    if not shared:
        return
    copies = {{}}
    for key, param in stages.named_parameters():
        rest = key.partition(".")[2]
        if rest in shared:
            copies.setdefault(min(PARAMETER_ALIASES.get(rest, [rest])), []).append(param)
    firsts = []
    for name in sorted(copies):       # the same names, in the same order, on every pipeline rank
        params = copies[name]
        grads = [p.grad for p in params if p.grad is not None]
        total = torch.stack(grads).sum(0) if len(grads) > 1 else None
        if params[0].grad is None:
            params[0].grad = torch.zeros_like(params[0])
        if total is not None:
            params[0].grad.copy_(total)   # in place: under ZeRO-1 a gradient is a view of one buffer
        firsts.append(params[0])
    _comm.sync_grads(firsts, _comm.PP, average=False)
    for name in sorted(copies):
        for param in copies[name][1:]:
            if param.grad is None:
                param.grad = copies[name][0].grad.clone()
            else:
                param.grad.copy_(copies[name][0].grad)


def parse_action(action, passes=1):
    """"1F3" -> ("F", 1, 3, passes - 1): the forward (F) or backward (B) of stage 1 on micro-batch 3,
    in the last pass; "1F3r0" -> ("F", 1, 3, 0): its pass 0, without gradient (recycling, 3F1B);
    "1E3" and "1G3c1": the vocabulary step of the first call of a vocabulary-split module in that
    forward, of the second in that backward (call 1; interlaced)."""
    action, _, cycle = action.partition("r")
    action, _, call = action.partition("c")
    kind = next(k for k in "FBEG" if k in action)
    stage, m = (int(x) for x in action.split(kind))
    return kind, stage, m, int(cycle) if cycle else passes - 1, int(call or 0)


def pipeline_forward_backward(stages, batch, module):
    """This rank's schedule (module.SCHEDULE, e.g. "0F0 0F1 0B0 ...") on its share of the batch;
    the full batch's loss. Activations go forward and gradients back. After each action, its
    sends and the next action's receives are posted together (one batch_isend_irecv); an action
    waits only for its own receives, the sends are waited for at the end of the schedule."""
    micro = micro_batches(batch_share(batch))
    shapes = [_comm.shape_key(m) for m in micro]  # hand-off headers are sent once per input shapes
    pipeline = _comm.axis_ranks(_comm.PP)        # global ranks of this pipeline, by pipeline index
    # stage s runs model stage s % length: one pipeline of all stages, or several (Chimera)
    length = module.PIPELINE_LENGTH
    _comm.PIPE.stages = length
    local = {{stage: k for k, stage in enumerate(module.PIPELINE_STAGES)}}
    first = lambda stage: stage % length == 0
    last = lambda stage: stage % length == length - 1
    rank_of = lambda stage: pipeline[module.STAGE_RANKS[stage]]
    # recycling (3F1B): each micro-batch runs the forward PIPELINE_PASSES times, all but the last
    # pass without gradient; the last stage hands each earlier pass's values back to the first
    passes = _comm.PIPE.passes = getattr(module, "PIPELINE_PASSES", 1)
    tag = lambda m, cycle: m + MICRO_BATCHES * (passes - 1 - cycle)   # keeps the passes' hand-offs apart
    key = lambda m, cycle: shapes[m] if cycle == passes - 1 else (shapes[m], cycle)
    actions = [parse_action(action, passes) for action in module.SCHEDULE.split()]
    held, requests, loss_sum = {{}}, [], torch.zeros(())
    device_type = device_type_of(stages)

    vocab = set(getattr(module, "VOCAB_STAGES", ()))    # stages calling vocabulary-split modules
    deferred = getattr(module, "VOCAB_DEFERRED", {{}})    # their backward calls run as steps after the B
    inside = set()          # vocabulary steps an owner's step runs while it pauses at a call of its own

    def paused_at(i):
        """The vocabulary steps that owner step i runs where it makes its calls: those listed after
        it up to its last own call at which it pauses (the others, its embeddings' backward, later)."""
        kind, stage, m = actions[i][:3]
        share = "E" if kind == "F" else "G"
        mine = [j for j in range(i + 1, len(actions)) if actions[j][0] in "EG" and
                actions[j][:3] == (share, stage, m) and not (share == "G" and actions[j][4] in deferred.get(stage, ()))]
        entries = []
        for j in range(i + 1, max(mine, default=i) + 1):
            k, s, mm, _, call = actions[j]
            entries.append((k, s, mm, call, None if s in local else rank_of(s), j in mine))
            inside.add(j)
        return entries

    def receives(action):
        """What `action` will receive: activations from the stage before (or, for a later pass on
        the first stage, the recycled values from the last), gradients from the one after."""
        kind, stage, m, cycle, _ = action
        if kind in "EG":
            return None
        if kind == "F" and not first(stage):
            return _comm.activation_recvs(rank_of(stage - 1), stage, tag(m, cycle), key(m, cycle))
        if kind == "F" and cycle > 0:
            return _comm.activation_recvs(rank_of(stage + length - 1), stage, tag(m, cycle), key(m, cycle))
        if kind == "B" and not last(stage):
            return _comm.grad_recvs(held[(stage, m)][1], rank_of(stage + 1), stage + 1, m)
        return None

    incoming = receives(actions[0])
    _comm.post_p2p([], incoming)                 # the first action's receives
    for i, (kind, stage, m, cycle, call) in enumerate(actions):
        _comm.PIPE.stage = stage % length
        _comm.PIPE.cycle = cycle if passes > 1 else None
        if stage in local:      # (a vocabulary step may be another rank's)
            _comm.PIPE.model = stages[local[stage]]      # a module handed over is read from this stage's model
        before = rank_of(stage - 1) if not first(stage) else None
        after = rank_of(stage + 1) if not last(stage) else None
        sends = []
        if kind in "EG":    # a vocabulary step of every rank
            if i in inside:
                pass            # run inside an owner's step of this rank, paused at a call
            elif stage in local:
                _comm.vocab_deferred(stage, m, call)     # its embedding's backward, after its B
            else:
                _comm.vocab_share(kind, stage, m, rank_of(stage))   # this rank's rows of the vocabulary
        elif stage in vocab:
            _comm.vocab_begin(stage, m, paused_at(i))   # the owner of this step: its calls counted from 0
        if kind == "F":
            received = []
            if not first(stage):
                _comm.PIPE.inbox, received = _comm.wait_activations(incoming)
            elif cycle > 0:   # recycling: this pass starts from the last stage's values of the pass before
                _comm.PIPE.recycled, _ = _comm.wait_activations(incoming)
            inputs = micro[m]
            try:
                with autocast(device_type):
                    output = stages[local[stage]](**inputs) if isinstance(inputs, dict) \
                        else stages[local[stage]](*inputs)
                    loss = loss_of(module, output) / (MICRO_BATCHES if AVERAGE_SHARES else 1)
                loss_sum += loss.detach()
                sent = [loss]
            except _comm.StageBoundary as boundary:
                sends = _comm.activation_sends(boundary.values, after, stage + 1, tag(m, cycle), key(m, cycle))
                sent = _comm.flat_tensors(boundary.values)
            except _comm.RecycleBoundary as boundary:   # the end of a pass without gradient, on the last stage
                head = stage - length + 1                # to the first stage, for the next pass
                sends = _comm.activation_sends(boundary.values, rank_of(head), head, tag(m, cycle + 1),
                                               key(m, cycle + 1))
                sent = []
            _comm.PIPE.inbox, _comm.PIPE.recycled = (), None   # what was received lives on in `held` only
            if cycle == passes - 1:     # the pass with gradient keeps what its backward needs
                held[(stage, m)] = (received, sent)
            if stage in vocab:
                _comm.vocab_end(module.VOCAB_CALLS[stage])   # the step made the calls the other ranks serve
        elif kind == "B":
            received, sent = held.pop((stage, m))
            if last(stage):
                scaled(sent[0]).backward()
            else:
                outputs = [t for t in sent if t.requires_grad]
                torch.autograd.backward(outputs, _comm.wait_grads(incoming))
            if stage in vocab:
                _comm.vocab_end(module.VOCAB_CALLS[stage])
            if not first(stage):
                sends = _comm.grad_sends(received, before, stage, m)
            del received, sent
        incoming = receives(actions[i + 1]) if i + 1 < len(actions) else None
        requests += _comm.post_p2p(sends, incoming)  # this action's isends, the next one's irecvs
    for request in requests:
        request.wait()
    return full_loss(loss_sum)


def pipeline_grads(stages, module):
    """After the schedule: every copy of one single-device parameter that several stages hold
    ends with the sum of their gradients (replicated pipelines, tied and shared parameters)."""
    if module.PIPELINE_LENGTH < module.PIPELINE_STAGE_COUNT:    # replicated pipelines: every copy summed
        replica_grads(stages, module)
    else:
        tied = [p for key, p in stages.named_parameters() if key.partition(".")[2] in module.TIED_PARAMETERS]
        _comm.fill_missing_grads(tied, _comm.PP_ENDS)     # a stage holding one it does not use
        _comm.sync_grads(tied, _comm.PP_ENDS, average=False)    # the embedding and the head tied across stages
    shared_grads(stages, module)    # modules every stage runs and computes with: summed over the pipeline
'''


# The training API (__init__.py): the pieces of a step a user's own loop calls, for this plan.
TRAINING = """

# --- training: the API a training loop calls (train.py is one such loop) -------------------

# Whole parameters whose gradient each tensor-parallel rank holds only in part.
TP_PARTIAL_GRADS = [{partial}]
{loss_shares}
# Mixed precision: the forward and the loss run under torch.autocast in PRECISION (None: the
# parameters' own dtype); parameters, gradients, their reductions and the optimizer's state
# stay float32 (master weights).
PRECISIONS = {{"fp32": None, "tf32": None, "bf16": torch.bfloat16, "fp16": torch.float16}}
PRECISION = {precision}


def use_precision(name):
    \"\"\"Run the forward in another of PRECISIONS than the one this output was rewritten for.\"\"\"
    global PRECISION
    PRECISION = PRECISIONS[name]


def autocast(device_type):
    return torch.autocast(device_type, dtype=PRECISION, enabled=PRECISION is not None)


# fp16 has 5 exponent bits: small gradients underflow. With PRECISION float16 the loss is scaled
# up before the backward and the gradients down after it (dynamic loss scaling, as
# torch.amp.GradScaler does): a step whose gradients overflowed on any rank is skipped and the
# scale halved; after GROWTH_INTERVAL steps without overflow it is doubled.
LOSS_SCALE = {{"scale": 2.0 ** 16, "good_steps": 0, "skip": False}}
GROWTH_INTERVAL = 2000


def scaled(loss):
    return loss * LOSS_SCALE["scale"] if PRECISION is torch.float16 else loss


def unscale(grads):
    \"\"\"fp16: the gradients divided by the loss scale; whether any rank's overflowed.\"\"\"
    overflow = torch.zeros((), device=grads[0].device if grads else None)
    for grad in grads:
        grad.div_(LOSS_SCALE["scale"])
        overflow = torch.maximum(overflow, (~torch.isfinite(grad)).any().float())
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(overflow, op=dist.ReduceOp.MAX)
    LOSS_SCALE["skip"] = bool(overflow.item())


def update_loss_scale():
    if LOSS_SCALE["skip"]:
        LOSS_SCALE["scale"], LOSS_SCALE["good_steps"] = LOSS_SCALE["scale"] / 2, 0
    else:
        LOSS_SCALE["good_steps"] += 1
        if LOSS_SCALE["good_steps"] == GROWTH_INTERVAL:
            LOSS_SCALE["scale"], LOSS_SCALE["good_steps"] = LOSS_SCALE["scale"] * 2, 0
    LOSS_SCALE["skip"] = False


def device_type_of(model):
    return next(model.parameters()).device.type


def setup(backend=None):
    \"\"\"The process groups of this mesh (torchrun's RANK and WORLD_SIZE); returns this rank.\"\"\"
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    assert world == WORLD_SIZE, f"this output was generated for {{WORLD_SIZE}} processes, not {{world}}"
    module = rank_module(rank)
    _comm.setup(rank, world, tp=TP_SIZE, dp=DP_SIZE, pp=PP_SIZE, backend=backend,
                pp_replicas=module.PIPELINE_REPLICAS if PP_SIZE > 1 else None,
                pp_tied=getattr(module, "TIED_RANKS", None))
    return rank


def batch_share(batch):
    \"\"\"This data-parallel rank's share of a full batch: its slice of dim 0 of every tensor.\"\"\"
    if _comm.DP.size == 1:
        return batch
    return _comm.map_tensors(lambda x: x.chunk(_comm.DP.size, dim=0)[_comm.DP.rank] if x.dim() > 0 else x, batch)


def loss_of(module, output):
    if hasattr(module, "loss"):
        return module.loss(output)
    if isinstance(output, torch.Tensor):
        return output
    return output["loss"] if isinstance(output, dict) else output.loss
{optimizer_params}

def forward_backward(model, batch):
    \"\"\"Forward, loss and backward of this rank's share of `batch` (the full batch, the same on
    every rank; a pipeline runs its whole schedule); returns the full batch's loss.\"\"\"
    module = rank_module(_comm.GLOBAL_RANK)
{gather_before_forward}{forward_backward}

def full_loss(loss):
    \"\"\"The full batch's loss from this rank's share: the pipeline's last stage holds it, and the
    data-parallel shares combine as the loss combines its samples (AVERAGE_SHARES).\"\"\"
    full = loss.detach().to(torch.promote_types(loss.dtype, torch.float32)).clone()  # float64 stays float64
    if _comm.PP.size > 1:
        dist.all_reduce(full, group=_comm.PP.group)
    if _comm.DP.size > 1:
        dist.all_reduce(full, group=_comm.DP.group)
        if AVERAGE_SHARES:
            full /= _comm.DP.size
    return full.item()
{pipeline_step}

def single_device_names(model):
    \"\"\"{{this rank's parameter or buffer key: the single-device model's name of it}}.\"\"\"
    keys = _comm.state_dict_keys(model) + [k for k, _ in model.named_parameters()]
    if PP_SIZE == 1:
        return {{key: key for key in keys}}
    module = rank_module(_comm.GLOBAL_RANK)
    names = {{}}
    for key in keys:
        local, _, rest = key.partition(".")
        names[key] = global_key(rest, module.PIPELINE_STAGES[int(local)], module)
    return names


def tp_partial_params(model):
    \"\"\"This rank's parameters whose gradient each tensor-parallel rank holds only in part.\"\"\"
    names = single_device_names(model)
    return [param for key, param in model.named_parameters() if names[key] in TP_PARTIAL_GRADS]


def finish_backward(model, reduce_dtype=None):
    \"\"\"Every gradient sync the plan needs after forward_backward: copies of a parameter on several
    pipeline stages summed, tensor-parallel partial gradients summed, data-parallel gradients
    combined (where the backward already issued them: waited for); fp16: the loss scale taken
    out. `reduce_dtype` (torch.bfloat16): the data-parallel reduction's dtype, float32 when None;
    where the reduction overlaps the backward it applies from the next backward on.\"\"\"
    if PP_SIZE > 1:
        pipeline_grads(model, rank_module(_comm.GLOBAL_RANK))
{dp_finish}    if PRECISION is torch.float16:
        unscale(stepped_grads(model))
{stepped_grads}

def clip_grad_norm(model, max_norm):
    \"\"\"Scale the gradients so that the single-device model's gradient norm is at most `max_norm`
    (torch.nn.utils.clip_grad_norm_'s rule); returns that norm before clipping. Each single-device
    element counts once: a split parameter's shards on each tensor-parallel rank, a replicated one
    on one rank, a parameter held by several pipeline stages on one of them, the data-parallel
    ranks' gradients (equal after finish_backward; ZeRO: their shards) once.\"\"\"
    counted = norm_counted(model)
{clip_pieces}    squares = torch.zeros((), dtype=torch.float32, device=pieces[0].device if pieces else None)
    for piece, count in zip(pieces, counts):
        if count:
            squares += piece.float().pow(2).sum()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(squares)
    norm = squares.sqrt()
    coefficient = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for piece in pieces:
        piece.mul_(coefficient.to(piece.dtype))
    return norm.item()


def norm_counted(model):
    \"\"\"{{key of each trained parameter: whether this rank counts its gradient in the global norm}};
    computed once. A parameter several of this rank's stages hold is counted at its first key.\"\"\"
    if getattr(model, "grad_norm_counted", None) is None:
        names = single_device_names(model)
        counted, held = {{}}, set()
        for key, param in model.named_parameters():
            if param.requires_grad:
                name = min(PARAMETER_ALIASES.get(names[key], [names[key]]))
                counted[key] = name not in held
                held.add(name)
        holders = [held]
        if _comm.PP.size > 1:       # the first pipeline rank holding a parameter counts it
            holders = [None] * _comm.PP.size
            dist.all_gather_object(holders, sorted(held), group=_comm.PP.group)
        for key in counted:
            name = min(PARAMETER_ALIASES.get(names[key], [names[key]]))
            first = next(rank for rank, there in enumerate(holders) if name in there)
            split_pp = names[key] in PP_VOCAB_SPLITS    # every tp x pp device holds rows of it
            counted[key] = counted[key] and (split_pp or (first == _comm.PP.rank and
                                                          (names[key] in TP_SPLITS or _comm.TP.rank == 0)))
        model.grad_norm_counted = counted
    return model.grad_norm_counted


def optimizer_step(model, optimizer):
    \"\"\"The optimizer's step on what finish_backward left, then the gradients cleared (fp16: no
    step where the gradients overflowed, and the loss scale adapted).\"\"\"
    if not LOSS_SCALE["skip"]:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
{dp_after_step}    if PRECISION is torch.float16:
        update_loss_scale()


def train_step(model, optimizer, batch, max_grad_norm=None):
    \"\"\"One optimizer step on the full batch; returns its loss.\"\"\"
    loss = forward_backward(model, batch)
    finish_backward(model)
    if max_grad_norm is not None:
        clip_grad_norm(model, max_norm=max_grad_norm)
    optimizer_step(model, optimizer)
    return loss


def merged_state_dict(model):
    \"\"\"The single-device state dict, on every rank: every rank's state dict gathered and merged
    (merge_state_dicts). For exports and checks; a large model is better saved with save_checkpoint.\"\"\"
    with whole_parameters(model):
        state = {{key: t.detach().cpu().clone() for key, t in model.state_dict().items()}}
    everyone = [state]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, state)
    return merge_state_dicts(everyone)


class whole_parameters:
    \"\"\"ZeRO-3 holds only its shard between steps: inside this, every parameter is whole (gathered),
    and what is written into them is kept in the shard on the way out.\"\"\"

    def __init__(self, model):
        shards = getattr(model, "zero_shards", None)
        self.shards = shards if shards is not None and shards.stage == 3 else None

    def __enter__(self):
        if self.shards is not None:
            _comm.all_gather_params(self.shards, _comm.DP)

    def __exit__(self, *exc):
        if self.shards is not None:
            _comm.keep_params(self.shards)
            _comm.free_params(self.shards)


def tensor_chunks(name, local):
    \"\"\"(the single-device shape of `name`, this rank's pieces of it as [(offsets, view of local)]).\"\"\"
    dim, groups = TP_SPLITS.get(name, (None, 1))
    shape, base = list(local.shape), [0] * local.dim()
    if dim is not None:
        shape[dim] *= TP_SIZE
    if name in PP_VOCAB_SPLITS:     # interlaced: this device's rows of the vocabulary
        base[0] = _comm.PP_TP.rank * shape[0]
        shape[0] *= PP_SIZE * TP_SIZE
    if dim is None:
        return torch.Size(shape), [(tuple(base), local)]
    block = local.shape[dim] // groups          # this rank's part of each fused block
    pieces = []
    for group in range(groups):
        offsets = list(base)
        offsets[dim] += group * block * TP_SIZE + _comm.TP.rank * block
        pieces.append((tuple(offsets), local.narrow(dim, group * block, block)))
    return torch.Size(shape), pieces


def checkpoint_state(model, optimizer, template=None):
    \"\"\"What a checkpoint holds of this rank, keyed by single-device names: "model/NAME" (each
    parameter and buffer) and "optim/NAME/KEY" (its optimizer state: AdamW's step, exp_avg,
    exp_avg_sq), each a _comm.CheckpointChunks of views into this rank's tensors; and the copies
    of one of them that this rank holds too (a parameter of two stages it runs, Chimera), as
    (tensor, copy) pairs. `template`: a checkpoint's metadata, to allocate optimizer state not
    made yet (loading before any step).\"\"\"
    names = single_device_names(model)
    state, first, copies = {{}}, {{}}, []
    for key, tensor in model.state_dict().items():
        name = min(PARAMETER_ALIASES.get(names[key], [names[key]]))
        if name in first:
            copies.append((first[name], tensor))
            continue
        first[name] = tensor
        state[f"model/{{name}}"] = _comm.CheckpointChunks(*tensor_chunks(name, tensor))
    if optimizer is None:
        return state, copies
    shards = getattr(model, "zero_shards", None)
    if shards is not None:      # ZeRO: the shard's state, whole on every rank for the moment
        states = zero_optimizer_state(shards, optimizer, template, names, model)
    else:
        states = {{}}
        for key, param in model.named_parameters():
            name = min(PARAMETER_ALIASES.get(names[key], [names[key]]))
            if not param.requires_grad:
                continue
            if not optimizer.state[param] and template is not None:
                optimizer.state[param] = new_state(template, name, param.shape, param.device)
            if name in states:
                copies += [(states[name][1][what], value) for what, value in optimizer.state[param].items()]
            else:
                states[name] = (param, optimizer.state[param])
    for name, (param, values) in states.items():
        for what, value in values.items():
            chunks = tensor_chunks(name, value) if isinstance(value, torch.Tensor) and value.shape == param.shape \\
                else (value.shape, [((0,) * value.dim(), value)])
            state[f"optim/{{name}}/{{what}}"] = _comm.CheckpointChunks(*chunks)
    return state, copies


def new_state(template, name, shape, device):
    \"\"\"Zeroed optimizer state for `name` shaped as the checkpoint's (`template`) holds it.\"\"\"
    prefix = f"optim/{{name}}/"
    values = {{}}
    for key, meta in template.state_dict_metadata.items():
        if key.startswith(prefix):
            shaped = len(meta.size) > 0     # a moment, shaped as the parameter; else a count (step)
            values[key[len(prefix):]] = torch.zeros(shape if shaped else meta.size, dtype=meta.properties.dtype,
                                                    device=device if shaped else "cpu")
    return values


def zero_optimizer_state(shards, optimizer, template, names, model):
    \"\"\"ZeRO: {{name: (parameter, its whole optimizer state)}}, from this rank's shard of the state:
    each state tensor laid out as the flat buffer, gathered over the data-parallel ranks.\"\"\"
    keys = {{id(param): key for key, param in model.named_parameters()}}
    if not optimizer.state[shards.chunks[0]] and template is not None:
        name = names[keys[id(shards.params[0])]]
        for chunk in shards.chunks:
            optimizer.state[chunk].update(new_state(template, min(PARAMETER_ALIASES.get(name, [name])),
                                                    chunk.shape, shards.device))
    states = [optimizer.state[chunk] for chunk in shards.chunks]
    mine = {{what: torch.cat([state[what] for state in states]) if value.shape == shards.chunks[0].shape else value
            for what, value in states[0].items()}}
    whole = {{what: _comm.gather_whole(shards, value) for what, value in mine.items()
             if value.shape == shards.shard.shape}}
    shards.gathered_state = whole   # load_checkpoint hands this rank's shard back from it
    views = {{what: shards.views(flat) for what, flat in whole.items()}}
    states = {{}}
    for index, param in enumerate(shards.params):
        name = min(PARAMETER_ALIASES.get(names[keys[id(param)]], [names[keys[id(param)]]]))
        values = {{what: v for what, v in mine.items() if what not in whole}}
        values.update({{what: pieces[index] for what, pieces in views.items()}})
        states.setdefault(name, (param, values))
    return states


def save_checkpoint(path, model, optimizer=None, extra=None):
    \"\"\"Write this rank's share of the model and the optimizer state into the folder `path` with
    torch.distributed.checkpoint: every tensor under its single-device name, each piece at its
    offsets, so that a checkpoint written under one plan loads under another. `extra`: a dict of
    plain values (the step). Every rank calls it.\"\"\"
    import torch.distributed.checkpoint as dcp
    with whole_parameters(model):
        state, _ = checkpoint_state(model, optimizer)
        if extra:
            state["extra"] = dict(extra)
        dcp.save(state, checkpoint_id=path)


def load_checkpoint(path, model, optimizer=None, extra=None):
    \"\"\"Read a checkpoint save_checkpoint wrote, under this plan or another, into this rank's model
    and optimizer (in place); `extra`, a dict, gets the values saved with it. Every rank calls it.\"\"\"
    import torch.distributed.checkpoint as dcp
    template = dcp.FileSystemReader(path).read_metadata()
    with whole_parameters(model):
        state, copies = checkpoint_state(model, optimizer, template)
        if extra is not None:
            state["extra"] = extra
        dcp.load(state, checkpoint_id=path)
        for tensor, copy in copies:
            copy.copy_(tensor)
    shards = getattr(model, "zero_shards", None)
    if shards is not None and optimizer is not None:     # this rank's shard of the whole state read
        for what, flat in shards.gathered_state.items():
            for chunk, piece in zip(shards.chunks, _comm.shard_of(shards, flat).split([c.numel() for c in shards.chunks])):
                optimizer.state[chunk][what].copy_(piece)
        for chunk in shards.chunks[1:]:      # the rest (AdamW's step count) as the first chunk's
            for what, value in optimizer.state[shards.chunks[0]].items():
                if what not in shards.gathered_state:
                    optimizer.state[chunk][what].copy_(value)
    if shards is not None and shards.stage != 3:         # the parameters read whole: the shard from them
        _comm.keep_params(shards)
"""

FORWARD_BACKWARD = """    inputs = batch_share(batch)
    with autocast(device_type_of(model)):
        output = model(**inputs) if isinstance(inputs, dict) else model(*inputs)
        loss = loss_of(module, output)
    scaled(loss).backward()
    return full_loss(loss)
"""

PIPELINE_FORWARD_BACKWARD = """    return pipeline_forward_backward(model, batch, module)
"""

# Gradient accumulation (--micro-batches M without a pipeline): the share runs as M micro-batches one
# after another, their gradients adding up in .grad; finish_backward reduces the sums once a step
ACCUMULATE_FORWARD_BACKWARD = """    loss_sum = None
    for inputs in micro_batches(batch_share(batch)):   # one micro-batch's activations held at a time
        with autocast(device_type_of(model)):
            output = model(**inputs) if isinstance(inputs, dict) else model(*inputs)
            loss = loss_of(module, output) / (MICRO_BATCHES if AVERAGE_SHARES else 1)
        scaled(loss).backward()
        loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
        del output, loss
    return full_loss(loss_sum)
"""

OPTIMIZER_PARAMS = '''

def optimizer_params(model):
    """What the optimizer steps: every parameter, replicated on each data-parallel rank."""
    return model.parameters()
'''

# ZeRO (--zero 1|2|3): the optimizer steps this rank's shard of the parameters only.
ZERO_OPTIMIZER_PARAMS = '''
ZERO_STAGE = {stage}  # {what}


def optimizer_params(model):
    """What the optimizer steps: this data-parallel rank's chunk of every unit (each block of a
    ModuleList, and the root unit: the rest), each unit sharded over the ranks (_comm.ZeroShards),
    so its state is 1/DP_SIZE of the whole. Kept as model.zero_shards. Its
    hooks {hooks}."""
    model.zero_shards = _comm.zero_shards(model, _comm.DP, stage=ZERO_STAGE, average=AVERAGE_SHARES,
                                          overlap={overlap}, partial=tp_partial_params(model), partial_axis=_comm.TP)
    return model.zero_shards.chunks
'''

ZERO_HOOKS = {
    1: "reduce nothing in the backward: finish_backward reduce-scatters every unit",
    2: "reduce-scatter each unit's gradients as soon as the backward has produced\n    them, and drop them",
    3: "all-gather each block just before its forward and its backward (the next block's\n"
       "    gather issued ahead) and free it after, and reduce-scatter its gradients as the backward\n"
       "    leaves it; they free the root unit while the blocks run (forward and backward) and gather it\n"
       "    again for the head and where the backward unpacks it. model.state_dict() and load_state_dict()\n"
       "    gather the whole parameters for the call (every data-parallel rank calls them)",
}

ZERO_WHAT = {
    1: "ZeRO-1: optimizer state sharded over the data-parallel ranks",
    2: "ZeRO-2: optimizer state and gradients sharded over the data-parallel ranks",
    3: "ZeRO-3: optimizer state, gradients and parameters sharded over the data-parallel ranks",
}

ZERO_GATHER = """    # ZeRO-3: the root unit (embedding, head) gathered for the embedding; the hooks free it while the
    # blocks run and gather it again for the head and for the backward (ZeroShards), and gather each block
    _comm.all_gather_params(model.zero_shards, _comm.DP, units="root")
"""

# Plain data parallelism: gradient buckets all-reduced from the backward's hooks (DDP)
DP_OVERLAP = """    grad_buckets(model)  # data parallel: each gradient bucket all-reduced as soon as the backward fills it
"""

GRAD_BUCKETS = '''

def grad_buckets(model):
    """The model's data-parallel gradient buckets, hooked on first use: each bucket is all-reduced
    over DP asynchronously as soon as the backward has filled it, in the backward's order;
    tensor-parallel partial gradients are summed as they come."""
    return _comm.overlap_grads(model, _comm.DP, average=AVERAGE_SHARES, partial=tp_partial_params(model),
                               partial_axis=_comm.TP)
'''

# finish_backward's data-parallel part, and what optimizer_step does after the step
TP_FINISH = """    _comm.sync_grads(tp_partial_params(model), _comm.TP, average=False)  # tensor parallel: partial gradients summed
"""

DP_FINISH = TP_FINISH + """    _comm.sync_grads(list(model.parameters()), _comm.DP, average=AVERAGE_SHARES,
                     reduce_dtype=reduce_dtype)  # data parallel
"""

DP_FINISH_OVERLAPPED = """    _comm.wait_grad_buckets(grad_buckets(model), reduce_dtype=reduce_dtype)  # data parallel: the backward's bucket all-reduces, waited for
"""

ZERO_FINISH = {
    1: TP_FINISH + """    # this rank's shard of the data-parallel gradient, to the optimizer
    _comm.reduce_scatter_grads(model.zero_shards, _comm.DP, average=AVERAGE_SHARES, reduce_dtype=reduce_dtype)
""",
    2: TP_FINISH + """    # only this rank's shard of the data-parallel gradient is kept (the backward's reduce-scatters waited for)
    _comm.reduce_scatter_grads(model.zero_shards, _comm.DP, average=AVERAGE_SHARES, reduce_dtype=reduce_dtype)
""",
    3: TP_FINISH + """    # only this rank's shard of the data-parallel gradient is kept (the backward's reduce-scatters waited for)
    _comm.reduce_scatter_grads(model.zero_shards, _comm.DP, average=AVERAGE_SHARES, reduce_dtype=reduce_dtype)
    _comm.free_params(model.zero_shards)                      # whole parameters dropped: the shard stays
""",
}

ZERO_AFTER_STEP = {
    1: """    model.zero_grad(set_to_none=True)                         # ZeRO-1's full gradients, dropped
    _comm.all_gather_params(model.zero_shards, _comm.DP)     # every rank's updated shard, to every rank
""",
    2: """    _comm.all_gather_params(model.zero_shards, _comm.DP)     # every rank's updated shard, to every rank
""",
    3: "",
}

# The gradients the optimizer steps: each parameter's, or (ZeRO) this rank's shard's
STEPPED_GRADS = """

def stepped_grads(model):
    return [param.grad for param in model.parameters() if param.grad is not None]
"""

ZERO_STEPPED_GRADS = """

def stepped_grads(model):
    return [chunk.grad for chunk in model.zero_shards.chunks]
"""

# clip_grad_norm's gradients: each parameter's, or (ZeRO) the pieces of this rank's shard
CLIP_PIECES = """    pieces, counts = [], []
    for key, param in model.named_parameters():
        if param.grad is not None:
            pieces.append(param.grad)
            counts.append(counted.get(key, False) and _comm.DP.rank == 0)
"""

ZERO_CLIP_PIECES = """    keys = {{id(param): key for key, param in model.named_parameters()}}
    pieces, counts = [], []
    for param, piece in model.zero_shards.pieces(stepped_grads(model)):   # this rank's elements
        pieces.append(piece)
        counts.append(counted.get(keys[id(param)], False))
"""


# How the loss combines its samples decides how the shares of the batch (data-parallel ranks,
# micro-batches) combine: averaged for a mean, added for a sum.
LOSS_SHARES = {
    "mean": "\n# The loss is a mean over the batch: data-parallel and micro-batch shares are averaged.\n"
            "AVERAGE_SHARES = True\n",
    "sum": "\n# The loss sums over the batch: data-parallel and micro-batch shares are added up.\n"
           "AVERAGE_SHARES = False\n",
}

PRECISION_CODE = {None: "None", "fp32": "None", "tf32": "None  # tf32 prices matmuls on tensor cores; the program runs in float32",
                  "bf16": "torch.bfloat16", "fp16": "torch.float16"}


# BatchNorm under micro-batches: each normalised by its own statistics; buffers the forward writes:
# written once per micro-batch
MICRO_BATCH_STATISTICS = """
# Each micro-batch runs the forward's per-call state on its own, as GPipe and torch.distributed.pipelining
# do: BatchNorm normalises it by its own statistics, and buffers the forward writes (spectral norm's
# power iteration, a step counter) are written once per micro-batch. A step computes what one device
# computes accumulating gradients over MICRO_BATCHES micro-batches (verify compares with that), not one
# pass over the whole batch.
BATCH_STATISTICS_PER_MICRO_BATCH = True"""


def training_api(*, partial: str, loss: str, zero: int, micro: int | None, precision: str | None,
                 micro_statistics: bool = False, accumulate: int = 1) -> str:
    """The training section of __init__.py for a plan: `partial` the TP_PARTIAL_GRADS entries,
    `loss` the loss's reduction ("mean" or "sum"), `zero` the ZeRO stage (0: replicated state),
    `micro` the micro-batches of a pipeline (None: no pipeline), `precision` the forward's dtype,
    `micro_statistics` whether BatchNorm normalises each micro-batch by its own statistics,
    `accumulate` the micro-batches of a step without a pipeline (gradient accumulation)."""
    pipeline = micro is not None
    accumulating = not pipeline and accumulate > 1
    pieces = {"optimizer_params": OPTIMIZER_PARAMS, "gather_before_forward": "", "dp_finish": DP_FINISH,
              "dp_after_step": "", "clip_pieces": CLIP_PIECES, "stepped_grads": STEPPED_GRADS}
    # one backward a step: the data-parallel reduction overlaps it; several (a pipeline's, gradient
    # accumulation's): the gradients add up first and finish_backward reduces them once, as a pipeline's
    overlap = not pipeline and not accumulating
    if overlap:
        pieces.update(optimizer_params=OPTIMIZER_PARAMS + GRAD_BUCKETS, gather_before_forward=DP_OVERLAP,
                      dp_finish=DP_FINISH_OVERLAPPED)
    if zero:
        # ZeRO-2 and 3 keep the gradients sharded under gradient accumulation too: each micro-batch's
        # backward reduce-scatters into the shard's gradient, which adds them up (FSDP's way)
        pieces = {"optimizer_params": ZERO_OPTIMIZER_PARAMS.format(stage=zero, what=ZERO_WHAT[zero],
                                                                   hooks=ZERO_HOOKS[zero], overlap=not pipeline),
                  "gather_before_forward": ZERO_GATHER if zero == 3 else "", "dp_finish": ZERO_FINISH[zero],
                  "dp_after_step": ZERO_AFTER_STEP[zero], "clip_pieces": ZERO_CLIP_PIECES.format(),
                  "stepped_grads": ZERO_STEPPED_GRADS}
    step = ""
    if pipeline:
        step = "\n\n" + PIPELINE_STEP.format(micro=micro).rstrip("\n")
    elif accumulating:
        step = "\n\n" + MICRO_BATCHES_SPLIT.format(micro=accumulate).rstrip("\n")
    if pipeline or accumulating:
        step += MICRO_BATCH_STATISTICS if micro_statistics else ""
    return TRAINING.format(partial=partial, loss_shares=LOSS_SHARES[loss], precision=PRECISION_CODE[precision],
                           forward_backward=PIPELINE_FORWARD_BACKWARD if pipeline else
                           ACCUMULATE_FORWARD_BACKWARD if accumulating else FORWARD_BACKWARD,
                           pipeline_step=step, **pieces)
