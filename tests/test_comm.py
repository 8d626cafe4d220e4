"""Spec of nnscaler_cst/runtime/_comm.py: real gloo process groups on CPU, no mocks.

Every multi-process test runs a module-level ``_check_*`` function on each rank
of a pool of spawned processes (one free port per pool, hard timeout per check).  Each rank builds
the same full tensors from a fixed seed and compares its distributed result
with a single-process reference computed from those full tensors.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.testing import assert_close

from nnscaler_cst.runtime import _comm
from nnscaler_cst.runtime._comm import DP, PP, TP
from nnscaler_cst.verify.launch import free_port

TIMEOUT_S = 120      # hard limit for one check on all ranks
FAIL_GRACE_S = 10    # how long to wait for the other ranks once one has failed


# --------------------------------------------------------------------------
# Harness: a pool of gloo ranks kept alive for the whole module
# --------------------------------------------------------------------------
#
# Starting a process (importing torch) costs seconds on 2 cores, so each world
# size gets one pool of spawned ranks that runs one check per test.  Before
# every check each rank calls ``_comm.setup`` with that test's mesh (on the
# already initialised world).  Any failure or timeout kills the pool; the next
# test starts a fresh one.

def _rank_server(rank, world_size, port, tasks, results):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    try:
        _comm.setup(rank, world_size, tp=world_size, backend="gloo")
        while (task := tasks.get()) is not None:
            check, mesh = task
            try:
                _comm.setup(rank, world_size, **mesh)
                check(rank, world_size)
                results.put((rank, None))
            except BaseException:
                results.put((rank, traceback.format_exc()))
    except BaseException:
        results.put((rank, traceback.format_exc()))
    finally:
        _comm.teardown()


class RankPool:
    """``world_size`` spawned processes sharing one gloo world."""

    def __init__(self, world_size: int):
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        port = free_port()
        self.procs = [ctx.Process(target=_rank_server, daemon=True,
                                  args=(r, world_size, port, self.tasks[r], self.results))
                      for r in range(world_size)]
        for p in self.procs:
            p.start()

    def run(self, check, mesh: dict) -> list[str]:
        """Run ``check`` on every rank; return the failure tracebacks (empty =
        success).  Kills the pool on any failure or on timeout."""
        for q in self.tasks:
            q.put((check, mesh))
        failures, reported = [], set()
        start = time.monotonic()
        deadline = start + TIMEOUT_S
        while len(reported) < self.world_size:
            try:
                rank, tb = self.results.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                missing = sorted(set(range(self.world_size)) - reported)
                failures.append(f"ranks {missing} still running after "
                                f"{time.monotonic() - start:.0f}s; pool killed")
                break
            reported.add(rank)
            if tb is not None:
                failures.append(f"rank {rank}:\n{tb}")
                # peers may be stuck in a collective the failed rank never joins
                deadline = min(deadline, time.monotonic() + FAIL_GRACE_S)
        if failures:
            self.kill()
        return failures

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join()

    def close(self) -> None:
        for q in self.tasks:
            q.put(None)
        for p in self.procs:
            p.join(timeout=10)
        self.kill()


class Ranks:
    """Test-facing handle: ``ranks.run(check, world_size, **mesh)``."""

    def __init__(self):
        self.pools: dict[int, RankPool] = {}

    def run(self, check, world_size: int, **mesh) -> None:
        """Run ``check(rank, world_size)`` on ``world_size`` gloo ranks after
        ``_comm.setup(..., **mesh)`` (default mesh: all ranks on TP).  A failure
        on any rank fails the test with that rank's traceback."""
        pool = self.pools.get(world_size)
        if pool is None or not pool.alive():
            pool = self.pools[world_size] = RankPool(world_size)
        failures = pool.run(check, mesh or {"tp": world_size})
        if failures:
            pytest.fail(f"{check.__name__} on {world_size} ranks failed:\n" + "\n".join(failures),
                        pytrace=False)

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()


@pytest.fixture(scope="module")
def ranks():
    handle = Ranks()
    yield handle
    handle.close()


def _full(*shape, seed=0, dtype=torch.float64):
    """Same tensor on every rank (seeded)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype)


def _slice_of(full, rank, size, dim, groups=1):
    """Reference for tp_scatter: rank's slice of every one of ``groups`` blocks."""
    return torch.cat([block.chunk(size, dim)[rank] for block in full.chunk(groups, dim)], dim)


# --------------------------------------------------------------------------
# tp_copy / tp_reduce
# --------------------------------------------------------------------------

def _check_tp_copy(rank, world):
    x = _full(3, 4).requires_grad_()
    y = _comm.tp_copy(x, TP)
    assert_close(y, x)                                   # forward: identity
    (y * _full(3, 4, seed=10 + rank)).sum().backward()   # rank-specific upstream grad
    expected = sum(_full(3, 4, seed=10 + r) for r in range(world))
    assert_close(x.grad, expected)                       # backward: sum over ranks


@pytest.mark.slow
def test_tp_copy_is_identity_forward_and_sums_grads_backward(ranks):
    ranks.run(_check_tp_copy, 2)


def _check_tp_reduce(rank, world):
    x = _full(3, 4, seed=rank).requires_grad_()          # a different partial per rank
    y = _comm.tp_reduce(x, TP)
    assert_close(y, sum(_full(3, 4, seed=r) for r in range(world)))  # forward: sum
    upstream = _full(3, 4, seed=99)
    (y * upstream).sum().backward()
    assert_close(x.grad, upstream)                       # backward: identity


@pytest.mark.slow
def test_tp_reduce_sums_forward_and_is_identity_backward(ranks):
    ranks.run(_check_tp_reduce, 2)


# --------------------------------------------------------------------------
# tp_scatter / tp_gather
# --------------------------------------------------------------------------

def _check_tp_scatter(rank, world):
    for dim, groups in [(-1, 1), (0, 1), (-1, 3), (1, 3)]:
        full = _full(6, 12).requires_grad_()
        part = _comm.tp_scatter(full, TP, dim=dim, groups=groups)
        assert_close(part, _slice_of(full.detach(), rank, world, dim, groups))
        # Every rank weights its slice with the matching slice of one common
        # weight W, so the gathered gradient of the replicated input is W.
        weight = _full(6, 12, seed=5)
        (part * _slice_of(weight, rank, world, dim, groups)).sum().backward()
        assert_close(full.grad, weight)


@pytest.mark.slow
def test_tp_scatter_keeps_rank_slice_forward_and_gathers_grads_backward(ranks):
    ranks.run(_check_tp_scatter, 2)


def _check_tp_gather_fused_qkv(rank, world):
    c = 4 * world
    q, k, v = _full(2, c, seed=1), _full(2, c, seed=2), _full(2, c, seed=3)
    qkv = torch.cat([q, k, v], dim=-1)
    local = torch.cat([q.chunk(world, -1)[rank], k.chunk(world, -1)[rank],
                       v.chunk(world, -1)[rank]], dim=-1).requires_grad_()   # [q_r | k_r | v_r]
    gathered = _comm.tp_gather(local, TP, dim=-1, groups=3)
    assert_close(gathered, qkv)                          # forward: [q | k | v]
    weight = _full(2, 3 * c, seed=7)
    (gathered * weight).sum().backward()
    assert_close(local.grad, _slice_of(weight, rank, world, -1, groups=3))  # backward: slice


@pytest.mark.slow
def test_tp_gather_of_fused_qkv_slices_gives_full_qkv_and_slices_grads_backward(ranks):
    ranks.run(_check_tp_gather_fused_qkv, 2)


def _check_tp_reduce_scatter(rank, world):
    for dim in (1, -1, 0):
        x = _full(2 * world, 4 * world, 2 * world, seed=rank).requires_grad_()     # a different partial per rank
        part = _comm.tp_reduce_scatter(x, TP, dim=dim)
        total = sum(_full(2 * world, 4 * world, 2 * world, seed=r) for r in range(world))
        assert_close(part, total.chunk(world, dim)[rank])            # forward: this rank's slice of the sum
        weight = _full(2 * world, 4 * world, 2 * world, seed=5)
        (part * weight.chunk(world, dim)[rank]).sum().backward()
        assert_close(x.grad, weight)                                  # backward: the gathered gradient


@pytest.mark.slow
def test_tp_reduce_scatter_sums_and_slices_forward_and_gathers_grads_backward(ranks):
    ranks.run(_check_tp_reduce_scatter, 2)


def _check_tp_all_gather(rank, world):
    for dim in (1, -1):
        full = _full(2, 4 * world, 2 * world)
        local = full.chunk(world, dim)[rank].clone().requires_grad_()
        gathered = _comm.tp_all_gather(local, TP, dim=dim)
        assert_close(gathered, full)                                  # forward: the whole tensor
        upstream = _full(2, 4 * world, 2 * world, seed=20 + rank)             # a partial gradient per rank
        (gathered * upstream).sum().backward()
        expected = sum(_full(2, 4 * world, 2 * world, seed=20 + r) for r in range(world)).chunk(world, dim)[rank]
        assert_close(local.grad, expected)                            # backward: reduce-scatter


@pytest.mark.slow
def test_tp_all_gather_gathers_forward_and_reduce_scatters_grads_backward(ranks):
    ranks.run(_check_tp_all_gather, 2)


def _check_scatter_gather_inverse(rank, world):
    for dim, groups in [(0, 1), (-1, 1), (1, 3), (-1, 2)]:
        full = _full(4, 12, 6 * world)
        assert_close(_comm.tp_gather(_comm.tp_scatter(full, TP, dim, groups), TP, dim, groups), full)
        local = _slice_of(full, rank, world, dim, groups)
        assert_close(_comm.tp_scatter(_comm.tp_gather(local, TP, dim, groups), TP, dim, groups), local)
    # gradients flow through the round trip unchanged
    x = _full(4, 12).requires_grad_()
    y = _comm.tp_gather(_comm.tp_scatter(x, TP, dim=1, groups=3), TP, dim=1, groups=3)
    upstream = _full(4, 12, seed=3)
    (y * upstream).sum().backward()
    assert_close(x.grad, upstream)


@pytest.mark.slow
def test_tp_scatter_and_tp_gather_are_inverses(ranks):
    ranks.run(_check_scatter_gather_inverse, 2)


def _check_results_can_be_written_in_place(rank, world):
    # The user's code may write into a gathered or scattered tensor (`h[..., :k] = 0`); autograd
    # allows that on a fresh tensor, not on a view made inside the collective.
    local = _full(4, 6).requires_grad_()
    gathered = _comm.tp_gather(local, TP, dim=0)
    gathered[:2] = 0.0                                   # rows 0 and 1 live on rank 0
    gathered.sum().backward()
    expected = torch.ones_like(local)
    if rank == 0:
        expected[:2] = 0.0
    assert_close(local.grad, expected)

    full = _full(4 * world, 6).requires_grad_()
    part = _comm.tp_scatter(full, TP, dim=0)
    part[0] = 0.0                                        # each rank zeroes the first row of its slice
    part.sum().backward()
    expected = torch.ones_like(full)
    expected[::4] = 0.0
    assert_close(full.grad, expected)


@pytest.mark.slow
def test_gathered_and_scattered_results_can_be_written_in_place(ranks):
    ranks.run(_check_results_can_be_written_in_place, 2)


# --------------------------------------------------------------------------
# Vocabulary-parallel embedding and cross entropy
# --------------------------------------------------------------------------

def _check_vocab_parallel_embedding(rank, world):
    vocab, dim, pad = 4 * world, 3, 5
    table = _full(vocab, dim)
    ids = torch.tensor([[0, 5, 7, 3], [pad, 1, 6, 2], [4, 4, 0, 7]])
    v_local = vocab // world
    rows = slice(rank * v_local, (rank + 1) * v_local)
    local_w = table[rows].clone().requires_grad_()

    partial = _comm.vocab_parallel_embedding(ids, local_w, TP, padding_idx=pad)
    outside = (ids < rows.start) | (ids >= rows.stop)
    assert (partial[outside] == 0).all()                 # rows of other ranks are zero
    out = _comm.tp_reduce(partial, TP)

    full_w = table.clone().requires_grad_()
    ref = F.embedding(ids, full_w, padding_idx=pad)
    assert_close(out, ref)

    upstream = _full(*ref.shape, seed=4)
    (out * upstream).sum().backward()
    (ref * upstream).sum().backward()
    assert_close(local_w.grad, full_w.grad[rows])        # includes a zero padding row


@pytest.mark.slow
def test_vocab_parallel_embedding_plus_tp_reduce_equals_full_embedding(ranks):
    ranks.run(_check_vocab_parallel_embedding, 2)


def _mha_cases():
    """F.multi_head_attention_forward's argument sets, (L=5, N=2, E=8) with 4 heads: fused or
    separate projections, boolean masks, bias_k / add_zero_attn, weights averaged or per head."""
    e, heads, kdim = 8, 4, 6
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[1, -2:] = True
    causal = torch.triu(torch.ones(5, 7, dtype=torch.bool), 3)
    base = dict(embed_dim_to_check=e, num_heads=heads, in_proj_weight=_full(3 * e, e, seed=1),
                in_proj_bias=_full(3 * e, seed=2), bias_k=None, bias_v=None, add_zero_attn=False, dropout_p=0.0,
                out_proj_weight=_full(e, e, seed=3), out_proj_bias=_full(e, seed=4))
    yield dict(base, need_weights=False), (e, e)
    yield dict(base, key_padding_mask=pad, attn_mask=causal, need_weights=True), (e, e)
    yield dict(base, bias_k=_full(1, 1, e, seed=5), bias_v=_full(1, 1, e, seed=6), add_zero_attn=True,
               key_padding_mask=pad, need_weights=True, average_attn_weights=False), (e, e)
    yield dict(base, in_proj_weight=None, use_separate_proj_weight=True, q_proj_weight=_full(e, e, seed=7),
               k_proj_weight=_full(e, kdim, seed=8), v_proj_weight=_full(e, kdim, seed=9), attn_mask=causal,
               need_weights=False), (kdim, kdim)


def _local_heads(name, full, rank, world):
    """This rank's share of one argument of F.multi_head_attention_forward, split by heads."""
    if name in ("in_proj_weight", "in_proj_bias"):
        return _slice_of(full, rank, world, 0, groups=3)
    if name in ("q_proj_weight", "k_proj_weight", "v_proj_weight"):
        return _slice_of(full, rank, world, 0)
    if name in ("bias_k", "bias_v", "out_proj_weight"):
        return _slice_of(full, rank, world, -1)
    return full


def _check_tp_multi_head_attention(rank, world, axis=TP):
    for case, (kdim, vdim) in _mha_cases():
        inputs = [_full(5, 2, 8, seed=20), _full(7, 2, kdim, seed=21), _full(7, 2, vdim, seed=22)]
        full = {n: v.clone().requires_grad_() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                for n, v in case.items()}
        local = {n: _local_heads(n, v.detach(), rank, world).requires_grad_() if isinstance(v, torch.Tensor)
                 and v.is_floating_point() else v for n, v in full.items()}
        x_full = [x.clone().requires_grad_() for x in inputs]
        x_local = [x.clone().requires_grad_() for x in inputs]
        ref = F.multi_head_attention_forward(*x_full, **full)
        out = _comm.tp_multi_head_attention_forward(*(_comm.tp_copy(x, axis) for x in x_local), **local, axis=axis)
        assert_close(out[0], ref[0])
        assert (out[1] is None) == (ref[1] is None)
        upstream = _full(*ref[0].shape, seed=30)
        per_head = ref[1] is not None and ref[1].dim() == 4
        loss_ref = (ref[0] * upstream).sum() + (ref[1].sum() if ref[1] is not None else 0)
        # per-head weights: every rank's heads summed, as the whole sum
        loss = (out[0] * upstream).sum() + (_comm.tp_reduce(out[1].sum(), axis) if per_head
                                            else out[1].sum() if out[1] is not None else 0)
        if ref[1] is not None:      # averaged: whole; per head: this rank's heads
            assert_close(out[1], ref[1] if ref[1].dim() == 3 else _slice_of(ref[1].detach(), rank, world, 1))
        loss_ref.backward()
        loss.backward()
        for x, y in zip(x_local, x_full):
            assert_close(x.grad, y.grad)                 # inputs: whole gradients (tp_copy sums them)
        for name, value in local.items():
            if isinstance(value, torch.Tensor) and value.requires_grad:   # weights: this rank's heads'
                assert_close(value.grad, _local_heads(name, full[name].grad, rank, world), msg=name)


@pytest.mark.slow
def test_multi_head_attention_on_local_heads_equals_the_whole_layer(ranks):
    ranks.run(_check_tp_multi_head_attention, 2)


def _check_vocab_parallel_cross_entropy(rank, world):
    vocab, ignore = 5 * world, -100
    v_local = vocab // world
    cols = slice(rank * v_local, (rank + 1) * v_local)
    logits_full = _full(2, 3, vocab)
    target = torch.tensor([[0, 7, ignore], [9, 4, ignore]])  # targets in both shards
    cases = [(red, 0.0) for red in ("mean", "sum", "none")] + [("mean", 0.1), ("none", 0.2)]
    for reduction, smoothing in cases:
        local = logits_full[..., cols].clone().requires_grad_()
        loss = _comm.vocab_parallel_cross_entropy(local, target, TP, ignore_index=ignore,
                                                  reduction=reduction, label_smoothing=smoothing)
        full = logits_full.clone().requires_grad_()
        ref = F.cross_entropy(full.view(-1, vocab), target.view(-1), ignore_index=ignore,
                              reduction=reduction, label_smoothing=smoothing)
        if reduction == "none":
            ref = ref.view(target.shape)
        assert_close(loss, ref, msg=f"forward {reduction}, smoothing {smoothing}")

        upstream = _full(*ref.shape, seed=8) if reduction == "none" else torch.tensor(1.7, dtype=ref.dtype)
        (loss * upstream).sum().backward()
        (ref * upstream).sum().backward()
        assert_close(local.grad, full.grad[..., cols], msg=f"grad {reduction}, smoothing {smoothing}")

    # under autocast torch's cross_entropy runs in float32, whatever the logits' dtype: so do the pieces
    with torch.autocast("cpu", dtype=torch.bfloat16):
        local = logits_full[..., cols].bfloat16().requires_grad_()
        loss = _comm.vocab_parallel_cross_entropy(local, target, TP, ignore_index=ignore)
        full = logits_full.bfloat16().requires_grad_()
        ref = F.cross_entropy(full.view(-1, vocab), target.view(-1), ignore_index=ignore)
    assert loss.dtype == ref.dtype == torch.float32
    assert_close(loss, ref)
    loss.backward()
    ref.backward()
    assert_close(local.grad, full.grad[..., cols])


@pytest.mark.slow
def test_vocab_parallel_cross_entropy_matches_full_cross_entropy_and_grad(ranks):
    ranks.run(_check_vocab_parallel_cross_entropy, 2)


def _check_vocab_parallel_cross_entropy_stability(rank, world):
    # float32 logits around 1e4 overflow exp() unless the global max is subtracted;
    # the winning column lives on rank 1 only.
    vocab = 4 * world
    v_local = vocab // world
    cols = slice(rank * v_local, (rank + 1) * v_local)
    logits_full = (_full(5, vocab, dtype=torch.float32) + 1e4)
    logits_full[:, vocab - 1] += 30.0
    target = torch.tensor([0, vocab - 1, 3, -100, 5])
    local = logits_full[:, cols].clone().requires_grad_()
    loss = _comm.vocab_parallel_cross_entropy(local, target, TP)
    full = logits_full.clone().requires_grad_()
    ref = F.cross_entropy(full, target)
    assert torch.isfinite(loss)
    assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    loss.backward()
    ref.backward()
    assert_close(local.grad, full.grad[:, cols], atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_vocab_parallel_cross_entropy_is_numerically_stable_in_float32(ranks):
    ranks.run(_check_vocab_parallel_cross_entropy_stability, 2)


def _check_dp_batch_norm_of_a_nearly_constant_channel(rank, world):
    # 4 values per channel (8 over the batch), spread 1e-3 around 100: the variance is below eps.
    # torch's CPU kernel accumulates float32 in float64; the data-parallel one must land as near
    # the float64 result (in float32 throughout, its centred values lost a tenth of themselves)
    full = (_full(8, 3, 2, 2, dtype=torch.float32) * 1e-3 + 100.0)
    upstream = _full(8, 3, 2, 2, seed=1, dtype=torch.float32)

    def run(norm, x, grad):
        x = x.clone().requires_grad_()
        y = norm(x)
        y.backward(grad)
        return y.detach().double(), x.grad.double()

    def whole(x):
        return F.batch_norm(x, None, None, torch.ones(3, dtype=x.dtype), None, True)

    y, dx = run(lambda x: _comm.dp_functional_batch_norm(x, DP, None, None, torch.ones(3), None, True),
                full.chunk(world)[rank], upstream.chunk(world)[rank])
    ref_y, ref_dx = (t.chunk(world)[rank] for t in run(whole, full, upstream))
    exact_y, exact_dx = (t.chunk(world)[rank] for t in run(whole, full.double(), upstream.double()))
    assert (y - exact_y).abs().max() <= 2 * (ref_y - exact_y).abs().max() + 1e-6
    assert (dx - exact_dx).abs().max() <= 2 * (ref_dx - exact_dx).abs().max() + 1e-6


@pytest.mark.slow
def test_dp_batch_norm_accumulates_as_torchs_kernel_does(ranks):
    ranks.run(_check_dp_batch_norm_of_a_nearly_constant_channel, 2, dp=2)


# --------------------------------------------------------------------------
# Data-parallel gradient sync
# --------------------------------------------------------------------------

def _sync_grads_params(rank):
    shapes = [((10,), torch.float32), ((2, 3), torch.float32), ((4, 5), torch.float32),
              ((3,), torch.float64), ((7,), torch.float32), ((4,), torch.float32)]
    params = []
    for i, (shape, dtype) in enumerate(shapes):
        p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype))
        if i != 4:                                       # param 4 has no grad
            p.grad = _full(*shape, seed=100 * rank + i, dtype=dtype)
        params.append(p)
    return params


def _check_sync_grads(rank, world):
    for average in (True, False):
        params = _sync_grads_params(rank)
        _comm.reset_counters()
        # 64 bytes per bucket: float32 [10]+[2,3] | [4,5] | [4] and float64 [3]
        _comm.sync_grads(params, DP, average=average, bucket_bytes=64)
        assert _comm.COUNTERS["all_reduce"] == 4
        per_rank = [_sync_grads_params(r) for r in range(world)]
        for i, p in enumerate(params):
            if i == 4:
                assert p.grad is None
                continue
            total = sum(ps[i].grad for ps in per_rank)
            assert_close(p.grad, total / world if average else total)


@pytest.mark.slow
def test_sync_grads_averages_or_sums_over_dp_in_several_buckets(ranks):
    ranks.run(_check_sync_grads, 4, dp=4)


# --------------------------------------------------------------------------
# Mesh setup
# --------------------------------------------------------------------------

def _check_mesh_tp2_dp2(rank, world):
    tp_groups, dp_groups = [[0, 1], [2, 3]], [[0, 2], [1, 3]]
    assert _comm.axis_ranks(TP) == tp_groups[rank // 2]
    assert _comm.axis_ranks(DP) == dp_groups[rank % 2]
    assert _comm.axis_ranks(PP) == [rank]
    assert (TP.size, TP.rank, DP.size, DP.rank, PP.size) == (2, rank % 2, 2, rank // 2, 1)
    assert _comm.GLOBAL_RANK == rank
    # the groups really are those ranks: sum the global ranks over each axis
    me = torch.tensor([float(rank)])
    assert _comm.tp_reduce(me, TP).item() == sum(tp_groups[rank // 2])
    assert _comm.tp_reduce(me, DP).item() == sum(dp_groups[rank % 2])


@pytest.mark.slow
def test_setup_tp2_dp2_puts_tp_fastest_then_dp(ranks):
    ranks.run(_check_mesh_tp2_dp2, 4, tp=2, dp=2)


def _check_mesh_tp2_pp2(rank, world):
    assert _comm.axis_ranks(TP) == [[0, 1], [2, 3]][rank // 2]
    assert _comm.axis_ranks(PP) == [[0, 2], [1, 3]][rank % 2]
    assert (PP.size, PP.rank, DP.size) == (2, rank // 2, 1)


@pytest.mark.slow
def test_setup_tp2_pp2_puts_pp_slowest(ranks):
    ranks.run(_check_mesh_tp2_pp2, 4, tp=2, pp=2)


def test_setup_rejects_mesh_that_does_not_cover_the_world():
    with pytest.raises(AssertionError, match="tp=2 x dp=2 x pp=1 = 4 ranks, but world_size is 2"):
        _comm.setup(0, 2, tp=2, dp=2)
    assert not dist.is_initialized()


# --------------------------------------------------------------------------
# Pipeline p2p
# --------------------------------------------------------------------------

def _check_send_recv(rank, world):
    act, grad = _full(2, 3, seed=1), _full(2, 3, seed=2, dtype=torch.float32)
    _comm.reset_counters()
    if rank == 0:
        _comm.send_forward(act, dst=1)
        assert_close(_comm.recv_backward((2, 3), torch.float32, src=1), grad)
        assert _comm.COUNTERS["send"] == 1 and _comm.COUNTERS["recv"] == 1
        assert _comm.COUNTERS["bytes"] == act.numel() * act.element_size()
    else:
        assert_close(_comm.recv_forward((2, 3), torch.float64, src=0), act)
        _comm.send_backward(grad, dst=0)


@pytest.mark.slow
def test_send_and_recv_move_activations_forward_and_grads_backward(ranks):
    ranks.run(_check_send_recv, 2, pp=2)


# --------------------------------------------------------------------------
# Pipeline hand-offs: metadata once per input shapes, one message per tensor, batched
# --------------------------------------------------------------------------

def _handoff(m, rows=2):
    """What a stage hands over for micro-batch m: two tensors (one needing a gradient), plain values."""
    act = _full(rows, 3, seed=10 + m).requires_grad_()
    mask = torch.arange(rows * 3).view(rows, 3) % (m + 2) == 0
    return (act * 2, {"mask": mask, "causal": True, "heads": 4})


def _check_handoff_metadata_once(rank, world):
    """Two steps of four micro-batches, the last one smaller (a new input shape), rank 0 -> 1.
    Each action posts its sends and the next action's receives in one batch, as train.py does."""
    _comm.reset_counters()
    micro = [torch.zeros(2, 5)] * 3 + [torch.zeros(1, 5)]          # the inputs the keys come from
    keys = [_comm.shape_key(x) for x in micro]
    assert keys[0] == keys[2] != keys[3]
    for step in range(2):
        if rank == 0:
            requests, incoming = [], None
            for m in range(4):
                values = _handoff(m, rows=micro[m].shape[0])
                sends = _comm.activation_sends(values, 1, 1, m, keys[m])
                # the backward of m = 0 follows the last forward: post its receive with that send
                incoming = _comm.grad_recvs(_comm.flat_tensors(_handoff(0)), 1, 1, 0) if m == 3 else None
                requests += _comm.post_p2p(sends, incoming)
            assert_close(_comm.wait_grads(incoming)[0], _full(2, 3, seed=99))
            for r in requests:
                r.wait()
        else:
            incoming = _comm.activation_recvs(0, 1, 0, keys[0])
            _comm.post_p2p([], incoming)
            for m in range(4):
                values, tensors = _comm.wait_activations(incoming)
                expected = _handoff(m, rows=micro[m].shape[0])
                assert_close(values[0], expected[0].detach())
                assert values[0].requires_grad and not values[1]["mask"].requires_grad
                assert torch.equal(values[1]["mask"], expected[1]["mask"])
                assert {k: v for k, v in values[1].items() if k != "mask"} == {"causal": True, "heads": 4}
                assert len(tensors) == 2
                if m == 0:
                    first = tensors
                sends = []
                if m == 3:       # send the gradient of micro-batch 0 with nothing to receive next
                    first[0].grad = _full(2, 3, seed=99)
                    sends = _comm.grad_sends(first, 0, 1, 0)
                incoming = _comm.activation_recvs(0, 1, m + 1, keys[m + 1]) if m < 3 else None
                for r in _comm.post_p2p(sends, incoming):
                    r.wait()
    if rank == 0:
        # one header per input shape for the whole run: 2 messages each (size, structure),
        # then one message per tensor for every hand-off, and one gradient received
        assert _comm.COUNTERS["handoff_headers"] == 2, _comm.COUNTERS
        assert _comm.COUNTERS["send"] == 2 * 2 + 2 * 4 * 2, _comm.COUNTERS
    else:
        assert _comm.COUNTERS["handoff_headers"] == 0 and _comm.COUNTERS["send"] == 2, _comm.COUNTERS  # a gradient per step


@pytest.mark.slow
def test_handoff_metadata_is_sent_once_per_input_shape_then_one_message_per_tensor(ranks):
    ranks.run(_check_handoff_metadata_once, 2, pp=2)


def test_a_tensor_handed_on_twice_is_one_message_after_the_header_too():
    """A block's output tuple handed on beside its first item (`layer_outputs = blk(h); h =
    layer_outputs[0]`): the receiver reads that tensor once, so every hand-off sends it once,
    not only the first one, whose header the later ones reuse (they sent it twice: a send no
    receive ever matched, and the first stage hung). A world of one over gloo builds the ops."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        _comm._clear_handoff_cache()
        key = _comm.shape_key(torch.zeros(2, 5))
        for m in range(3):
            hidden = _full(2, 3, seed=m).requires_grad_() * 2
            ops = _comm.activation_sends((hidden, (hidden,), None), 1, 1, m, key)
            assert len(ops) == (2 if m == 0 else 0) + 1, m        # the header's two messages, then the tensor
    finally:
        _comm._clear_handoff_cache()
        dist.destroy_process_group()


class _Opaque:
    """An object a stage hands on that is not plain metadata (like a transformers DynamicCache)."""

    def __init__(self, n):
        self.n = n


def _check_handoff_objects(rank, world):
    """A hand-off holding an object sends its header every time (both sides see that in the first
    header); one of lists and plain values only is cached, and unpickled afresh for every hand-off."""
    key = _comm.shape_key(torch.zeros(2, 5))
    _comm.reset_counters()
    for m in range(3):
        if rank == 0:
            for r in _comm.send_values((_full(2, 3, seed=m), _Opaque(m)), 1, 1, m, key):
                r.wait()
            for r in _comm.send_values((_full(2, 3, seed=m), ["a", 1]), 1, 2, m, key):
                r.wait()
        else:
            values, _ = _comm.recv_values(0, 1, m, key)
            assert_close(values[0], _full(2, 3, seed=m))
            assert isinstance(values[1], _Opaque) and values[1].n == m
            values, _ = _comm.recv_values(0, 2, m, key)
            assert values[1] == ["a", 1]
            values[1].append("changed by the stage")      # the next micro-batch gets its own list
    if rank == 0:
        assert _comm.COUNTERS["handoff_headers"] == 3 + 1, _comm.COUNTERS


@pytest.mark.slow
def test_handoff_holding_an_object_sends_its_header_every_time(ranks):
    ranks.run(_check_handoff_objects, 2, pp=2)


def _check_handoff_shape_change(rank, world):
    """Under one key (same input shapes), the second hand-off's activation is wider: shapes that
    depend on the data. The sender refuses it with a clear error before posting anything; with
    HANDOFF_METADATA = "every" the same hand-offs go through."""
    key = _comm.shape_key(torch.zeros(2, 5))
    first, wider = _full(2, 3, seed=1), _full(2, 4, seed=2)
    if rank == 0:
        for r in _comm.send_values((first,), 1, 1, 0, key):
            r.wait()
        with pytest.raises(_comm.HandoffMismatch, match=r"stage 1 \(micro-batch 1\).*tensor 0: shape "
                           r"\(2, 3\) first, now \(2, 4\).*HANDOFF_METADATA = \"every\""):
            _comm.activation_sends((wider,), 1, 1, 1, key)
    else:
        assert_close(_comm.recv_values(0, 1, 0, key)[0][0], first)
    dist.barrier()
    _comm.HANDOFF_METADATA = "every"
    try:
        _comm.reset_counters()
        for m, x in enumerate([first, wider, first]):
            if rank == 0:
                for r in _comm.send_values((x, "plain"), 1, 1, m, key):
                    r.wait()
            else:
                values, _ = _comm.recv_values(0, 1, m, key)
                assert_close(values[0], x)
                assert values[1] == "plain"
        if rank == 0:
            assert _comm.COUNTERS["handoff_headers"] == 3
    finally:
        _comm.HANDOFF_METADATA = "once"


@pytest.mark.slow
def test_handoff_whose_shapes_change_under_the_same_input_shapes_is_refused_or_sent_every_time(ranks):
    ranks.run(_check_handoff_shape_change, 2, pp=2)


def _structured(m, *, grad=True, dtype=torch.float32, middle=None, heads=4, extra=None):
    """A hand-off with a tensor that may need a gradient, a None, and a dict of a tensor and an int."""
    act = _full(2, 3, seed=20 + m).to(dtype)
    act = (act.requires_grad_() * 2) if grad else act
    info = {"mask": torch.arange(6).view(2, 3) % (m + 2) == 0, "heads": heads}
    if extra is not None:
        info["extra"] = extra
    return (act, middle, info)


def _check_handoff_structure_change(rank, world):
    """Structure changes between hand-offs under one key are refused on the sender, before it
    posts anything, with what changed; the receiver is never handed a misread tensor. Under a new
    key (new input shapes) the new structure gets its own header and arrives intact, and the
    first structure still goes through under its own key."""
    key, other_key = _comm.shape_key(torch.zeros(2, 5)), _comm.shape_key(torch.zeros(2, 6))
    changes = [   # (changed hand-off, what the error says)
        (dict(middle=_full(2, seed=5)), r"2 tensor\(s\) first, now 3"),     # None -> a tensor
        (dict(grad=False), r"tensor 0: requires_grad True first, now False"),
        (dict(dtype=torch.float64), r"tensor 0: dtype torch.float32 first, now torch.float64"),
        (dict(heads=8), r"the structure or a plain value differs"),           # a plain value
        (dict(extra=1), r"the structure or a plain value differs"),           # a new dict key
    ]
    _comm.reset_counters()
    if rank == 0:
        for r in _comm.send_values(_structured(0), 1, 1, 0, key):
            r.wait()
        for m, (change, says) in enumerate(changes, start=1):
            with pytest.raises(_comm.HandoffMismatch, match=rf"stage 1 \(micro-batch {m}\).*{says}"):
                _comm.activation_sends(_structured(m, **change), 1, 1, m, key)
        for r in _comm.send_values(_structured(6, middle=_full(2, seed=5)), 1, 1, 6, other_key):
            r.wait()
        for r in _comm.send_values(_structured(7), 1, 1, 7, key):
            r.wait()
        # headers: the first structure, then the new one under its own key; none for the refusals
        assert _comm.COUNTERS["handoff_headers"] == 2, _comm.COUNTERS
    else:
        for m, kwargs, k in [(0, {}, key), (6, dict(middle=_full(2, seed=5)), other_key), (7, {}, key)]:
            values, tensors = _comm.recv_values(0, 1, m, k)
            expected = _structured(m, **kwargs)
            assert len(tensors) == len(_comm.flat_tensors(expected))
            assert_close(values[0], expected[0].detach())
            assert values[0].requires_grad and not values[2]["mask"].requires_grad
            assert (values[1] is None) == (expected[1] is None)
            if expected[1] is not None:
                assert_close(values[1], expected[1])
            assert torch.equal(values[2]["mask"], expected[2]["mask"]) and values[2]["heads"] == 4


@pytest.mark.slow
def test_handoff_structure_change_is_refused_under_the_same_key_and_resent_under_a_new_one(ranks):
    ranks.run(_check_handoff_structure_change, 2, pp=2)



def test_vocab_parallel_embedding_takes_the_arguments_f_embedding_takes():
    """torchtitan's Embedding calls F.embedding with every argument positional; the split call
    takes them in the same order. Each rank's lookup needs no communication: the partial
    results of both ranks, summed, are the whole table's."""
    table, ids = _full(8, 3), torch.tensor([[0, 7, 2], [5, 3, 3]])
    rest = (None, None, 2.0, False, False)     # padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse
    parts = [_comm.vocab_parallel_embedding(ids, table.chunk(2)[r], _comm.Axis("tp", size=2, rank=r), *rest)
             for r in range(2)]
    assert_close(parts[0] + parts[1], F.embedding(ids, table, *rest))
    with pytest.raises(ValueError, match="max_norm"):     # other ranks' ids would renormalize row 0
        _comm.vocab_parallel_embedding(ids, table.chunk(2)[0], _comm.Axis("tp", size=2, rank=0), None, 1.0)

# --------------------------------------------------------------------------
# Size-1 axes: everything is the identity, in one plain process
# --------------------------------------------------------------------------

def test_size_one_axes_are_identity_without_torch_distributed():
    assert not dist.is_initialized()
    _comm.reset_counters()
    axis = _comm.Axis("tp")
    assert (axis.size, axis.rank, axis.group) == (1, 0, None)

    x = _full(4, 6).requires_grad_()
    assert _comm.tp_copy(x, axis) is x
    assert _comm.tp_reduce(x, axis) is x
    assert _comm.tp_scatter(x, axis, dim=-1, groups=3) is x
    assert _comm.tp_gather(x, axis, dim=0) is x

    table = _full(8, 3).requires_grad_()
    ids = torch.tensor([[0, 7, 2]])
    assert_close(_comm.vocab_parallel_embedding(ids, table, axis, padding_idx=2),
                 F.embedding(ids, table, padding_idx=2))

    logits, target = _full(2, 3, 8), torch.tensor([[1, -100, 7], [0, 3, 3]])
    for reduction in ("mean", "sum", "none"):
        ref = F.cross_entropy(logits.view(-1, 8), target.view(-1), reduction=reduction)
        out = _comm.vocab_parallel_cross_entropy(logits, target, axis, reduction=reduction)
        assert_close(out, ref.view(target.shape) if reduction == "none" else ref)

    _check_tp_multi_head_attention(0, 1, axis)      # all heads on one rank: F's own results

    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([1.0, 2.0, 3.0])
    _comm.sync_grads([p], axis, average=True)
    assert_close(p.grad, torch.tensor([1.0, 2.0, 3.0]))

    assert all(v == 0 for v in _comm.COUNTERS.values())
    assert not dist.is_initialized()


@dataclasses.dataclass
class Inter:
    """An attention's intermediates, as x-transformers hands them from layer to layer."""
    values: torch.Tensor
    kind: str = "a"


def test_a_handoff_sends_a_module_as_the_receiving_stages_own_and_a_dataclass_field_by_field():
    """Without a process group: what activation_sends pickles, as wait_activations rebuilds it. A
    tuple of the layers a loop zips reaches the next stage as that stage's modules at the same
    paths; a dataclass holding a tensor that needs gradients keeps it a tensor of the hand-off."""
    import pickle

    def model():
        return torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]))

    sender, receiver = model(), model()
    values = torch.randn(2, requires_grad=True) * 2
    inter = Inter(values)
    inter.layer_type = "a"      # an attribute besides the fields
    handed = ((tuple(sender[0]), "af"), inter)
    tensors: list = []
    try:
        _comm.PIPE.model = sender
        structure = pickle.loads(pickle.dumps(_comm._slots(handed, tensors)))
        assert _comm._cacheable(structure) and len(tensors) == 1 and tensors[0] is values
        _comm.PIPE.model = receiver
        (layers, kinds), inter = _comm._received(structure, [values.detach().requires_grad_()])
    finally:
        _comm.PIPE.model = None
    assert layers[0] is receiver[0][0] and layers[1] is receiver[0][1] and kinds == "af"
    assert isinstance(inter, Inter) and inter.kind == "a" and inter.layer_type == "a" and inter.values.requires_grad
    assert_close(inter.values, values)


def test_a_cached_handoff_holding_a_tensor_twice_sends_it_once_as_its_header_says():
    """Without a process group: a UNet's down path hands on its list of skips and the last of them
    again (`res_samples`). The first hand-off's header has one slot for it; a later micro-batch,
    checked against the cached header, must send as many tensors as that header's slots (one more
    left the receiver short and the sender waiting forever), and a tensor handed twice in another
    place differs from the cached hand-off."""
    skips = [torch.randn(2, 3) for _ in range(3)]
    handed = (skips[0], tuple(skips), skips[1:])
    slots: list = []
    _comm._slots_of(_comm._slots(handed, []), slots)
    tensors: list = []
    signature = _comm._signature(handed, tensors)
    assert len(tensors) == len(slots) == 3 and all(a is b for a, b in zip(tensors, skips))
    other = [torch.randn(2, 3) for _ in range(3)]
    assert _comm._signature((other[0], tuple(other), other[1:]), []) == signature
    assert _comm._signature((other[1], tuple(other), other[1:]), []) != signature


def test_a_loop_over_lists_of_modules_runs_this_stages_iterations_and_counts_them_all():
    try:
        _comm.PIPE.stage, _comm.PIPE.iterations, _comm.PIPE.iteration_count = 1, {1: (2, 4)}, 4
        assert list(_comm.pp_iterations(enumerate("abcd"))) == [(2, "c"), (3, "d")]
        with pytest.raises(RuntimeError, match="ran 5 iterations; the pipeline stages were cut for 4"):
            list(_comm.pp_iterations(range(5)))
    finally:
        _comm.PIPE.stage, _comm.PIPE.iterations, _comm.PIPE.iteration_count = 0, {}, None
