"""Source of the generated __init__.py and train.py. Torch only: the output never imports
nnscaler_cst. Filled with str.format; literal braces are doubled.
"""

INIT = '''"""{title}

build(rank)                 this rank's model (its source: model_rank<rank>.py)
shard_state_dict(sd, rank)  a single-device state dict -> this rank's share of it
merge_state_dicts(sds)      every rank's state dict -> one single-device state dict
"""
import importlib

import torch

WORLD_SIZE = {world}
TP_SIZE = {tp}  # tensor-parallel ranks vary fastest: rank = dp_rank * TP_SIZE + tp_rank
DP_SIZE = {dp}

# Parameters split over the tensor-parallel axis: name -> (dim, groups). A dim with
# groups > 1 holds that many fused blocks (q|k|v), each split alike. All others are whole.
TP_SPLITS = {{
{splits}}}


def coords(rank):
    return {{"tp": rank % TP_SIZE, "dp": rank // TP_SIZE % DP_SIZE}}


def rank_module(rank):
    return importlib.import_module(f"{{__name__}}.model_rank{{rank}}")


def build(rank):
    return rank_module(rank).build()


def shard(tensor, dim, groups, tp_rank):
    """This tensor-parallel rank's slice of every block of `dim`."""
    blocks = tensor.unflatten(dim, (groups, tensor.shape[dim] // groups))
    return blocks.chunk(TP_SIZE, dim=dim + 1)[tp_rank].flatten(dim, dim + 1).clone()


def unshard(pieces, dim, groups):
    blocks = [p.unflatten(dim, (groups, p.shape[dim] // groups)) for p in pieces]
    return torch.cat(blocks, dim=dim + 1).flatten(dim, dim + 1)


def shard_state_dict(state_dict, rank):
    tp_rank = coords(rank)["tp"]
    return {{name: shard(t, *TP_SPLITS[name], tp_rank) if name in TP_SPLITS else t.clone()
            for name, t in state_dict.items()}}


def merge_state_dicts(state_dicts):
    """Ranks 0..TP_SIZE-1 (data-parallel replica 0) hold one copy of every parameter."""
    return {{name: unshard([state_dicts[r][name] for r in range(TP_SIZE)], *TP_SPLITS[name])
            if name in TP_SPLITS else t.clone() for name, t in state_dicts[0].items()}}
'''

TRAIN = '''"""torchrun entry for {source} ({plan}).

    torchrun --nproc-per-node {world} {folder}/train.py --steps 10

Initialises torch.distributed (NCCL and the local GPU when CUDA is there, gloo on CPU
otherwise), builds this rank's model, optionally loads its share of a single-device
checkpoint (--init), and trains on the entry file's example_inputs().
"""
import argparse
import importlib
import os
import sys

import torch
import torch.distributed as dist

if __package__ in (None, ""):  # run as a script: import the output folder as a package
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.dirname(_here))
    __package__ = os.path.basename(_here)
    importlib.import_module(__package__)

from . import _comm
from . import DP_SIZE, TP_SIZE, WORLD_SIZE, rank_module, shard_state_dict

# Whole parameters whose gradient each tensor-parallel rank holds only in part.
TP_PARTIAL_GRADS = [{partial}]


def split_batch(batch):
    """This data-parallel rank's share of a batch: its slice of dim 0 of every tensor."""
    def share(x):
        if isinstance(x, torch.Tensor) and x.dim() > 0 and _comm.DP.size > 1:
            return x.chunk(_comm.DP.size, dim=0)[_comm.DP.rank]
        return x
    if isinstance(batch, dict):
        return {{k: share(v) for k, v in batch.items()}}
    return tuple(share(v) for v in batch)


def loss_of(module, output):
    if hasattr(module, "loss"):
        return module.loss(output)
    return output if isinstance(output, torch.Tensor) else output.loss


def train_step(model, optimizer, batch, module):
    """One optimizer step on the full batch; returns the full batch's loss."""
    inputs = split_batch(batch)
    output = model(**inputs) if isinstance(inputs, dict) else model(*inputs)
    loss = loss_of(module, output)
    loss.backward()
    named = dict(model.named_parameters())
    _comm.sync_grads([named[n] for n in TP_PARTIAL_GRADS if n in named], _comm.TP, average=False)
    _comm.sync_grads(list(model.parameters()), _comm.DP, average=True)  # data parallel: mean
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    full = loss.detach().clone()
    if _comm.DP.size > 1:  # the full batch's loss is the mean of the data-parallel shares
        dist.all_reduce(full, group=_comm.DP.group)
        full /= _comm.DP.size
    return full.item()


def batch_for(module, step, seed, device):
    torch.manual_seed(seed + step)  # every rank draws the same full batch
    batch = module.example_inputs()
    move = lambda x: x.to(device) if isinstance(x, torch.Tensor) else x
    return {{k: move(v) for k, v in batch.items()}} if isinstance(batch, dict) else tuple(map(move, batch))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--init", help="single-device state dict (torch.save) to start from")
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    assert world == WORLD_SIZE, f"this output was generated for {{WORLD_SIZE}} processes"
    _comm.setup(rank, world, tp=TP_SIZE, dp=DP_SIZE)
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    module = rank_module(rank)
    torch.manual_seed(args.seed)
    model = module.build()
    if args.init:
        model.load_state_dict(shard_state_dict(torch.load(args.init), rank))
    model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    for step in range(args.steps):
        loss = train_step(model, optimizer, batch_for(module, step, args.seed, device), module)
        if rank == 0:
            print(f"step {{step}} loss {{loss:.6f}}", flush=True)
    _comm.teardown()


if __name__ == "__main__":
    main()
'''
