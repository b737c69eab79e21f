"""Returned tensors are the caller's (docs/python.md): whatever later calls do, and after the
Buffer that made them is gone, they keep their bits; a zero-copy combine's buffer outlives its
Buffer; nothing crashes when the last reference to any of them goes, on any thread.

The case_* functions run on one rank (a moed.Group): here on the threads world, and in gloo
processes through gloo_workers.scenario_ownership (test_gloo.py runs it)."""
import gc
import os
import weakref

import pytest
import torch

import moed
import moed.deep_ep as deep_ep
from test_deep_ep import make_inputs, quantize_ref

# Each reproduction this many times in one world (10 of 10 aborted before the fix); the sanitizer
# pass, 3-5 times slower and failing on the first bad access, sets fewer (cmake/python.cmake).
RUNS = int(os.environ.get("MOED_OWNERSHIP_RUNS", "50"))


def run(fn, R, *args, G=0):
    return moed.launch(fn, R, *args, ranks_per_node=G, timeout=120.0, threads_per_rank=1)


def ll_inputs(group, M, H, E, K, seed):
    """Every rank's token count (rank 1 has none), inputs, as test_deep_ep's low-latency cases."""
    R = group.size()
    tokens = [0 if (R > 1 and s == 1) else min(M, 1 + (3 * s + seed) % M) for s in range(R)]
    xs, idxs, ws = make_inputs(R, E, K, H, seed, tokens=tokens)
    return tokens, xs, idxs, ws


def ll_buffer(group, M, H, E, destroy=False):
    R = group.size()
    return deep_ep.Buffer(group, 0, deep_ep.Buffer.get_low_latency_rdma_size_hint(M, H, R, E),
                          low_latency_mode=True, num_qps_per_rank=E // R, explicitly_destroy=destroy)


def want_rows(xs, idxs, tokens, e):
    """(source rank, token) of every row expert e receives, in moed's order."""
    return [(s, t) for s in range(len(xs)) for t in range(tokens[s]) if bool((idxs[s][t] == e).any())]


def check_low_latency(group, xs, idxs, tokens, E, recv, recv_count, handle, use_fp8):
    """recv_x (and scales), recv_count and the handle's src_info against the inputs."""
    R, r = group.size(), group.rank()
    L = E // R
    recv_x = recv[0] if use_fp8 else recv
    src_info = handle[0]
    for j in range(L):
        want = want_rows(xs, idxs, tokens, r * L + j)
        assert recv_count[j].item() == len(want), (j, recv_count[j].item(), len(want))
        assert src_info[j, :len(want)].tolist() == [t for _, t in want]
        for i, (s, t) in enumerate(want):
            if not use_fp8:
                assert torch.equal(recv_x[j, i], xs[s][t])
            else:
                q, sinv = quantize_ref(xs[s][t:t + 1], False)
                assert torch.equal(recv_x[j, i].view(torch.uint8), q[0])
                assert torch.equal(recv[1][j, i], sinv[0])


def combine_want(idx, w, H):
    """The combine of expert outputs whose rows are all (e + 1) / 4 for global expert e."""
    T = idx.size(0)
    want = torch.zeros(T, H)
    for t in range(T):
        for e in sorted(v for v in idx[t].tolist() if v >= 0):
            k = idx[t].tolist().index(e)
            want[t] += w[t, k] * torch.full((H,), (e + 1) / 4).to(torch.bfloat16).float()
    return want.to(torch.bfloat16)


def expert_rows(group, E, M, H):
    R, r = group.size(), group.rank()
    L = E // R
    return torch.stack([torch.full((R * M, H), (r * L + j + 1) / 4) for j in range(L)]).to(torch.bfloat16)


def freed(ref):
    """Whether the object behind the weak reference is gone: at its last reference, as in a
    model, or else (a cycle) at a collection, which takes 0.1-0.3 s with the suites loaded."""
    if ref() is not None:
        gc.collect()
    return ref() is None


def snapshot(tensors):
    return [t.clone() for t in tensors]


def same_bits(a, b):
    """Bitwise equality (rows past a receive's counts are uninitialised: NaN != NaN)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def unchanged(held, shots):
    return all(same_bits(a, b) for a, b in zip(held, shots))


def case_held_low_latency(group, runs, use_fp8, hook):
    """Four low-latency dispatches (and combines) on one Buffer, every result kept: each still
    holds its own bits after the later calls (the issue's [False, False, True, True])."""
    M, H, E, K = 8, 256, 2 * group.size(), 3
    r = group.rank()
    for run_ in range(runs):
        held, shots = [], []
        buffer = ll_buffer(group, M, H, E)
        for step in range(4):
            tokens, xs, idxs, ws = ll_inputs(group, M, H, E, min(K, E), 100 * run_ + step)
            recv, count, handle, _, rhook = buffer.low_latency_dispatch(
                xs[r], idxs[r], M, E, use_fp8=use_fp8, return_recv_hook=hook)
            if hook:
                rhook()
            check_low_latency(group, xs, idxs, tokens, E, recv, count, handle, use_fp8)
            combined, _, chook = buffer.low_latency_combine(expert_rows(group, E, M, H), idxs[r], ws[r],
                                                            handle, return_recv_hook=hook)
            if hook:
                chook()
            assert torch.equal(combined, combine_want(idxs[r], ws[r], H))
            mine = list(recv) if use_fp8 else [recv]
            mine += [count, handle[0], handle[1], combined]
            held.append(mine)
            shots.append(snapshot(mine))
        kept = [unchanged(h, s) for h, s in zip(held, shots)]
        assert kept == [True] * 4, kept
    return True


def case_outlive_buffer(group, runs, destroy):
    """Low-latency and normal-mode results read after their Buffer is gone (destroy() or the
    last reference dropped), and after a later Buffer reused the memory."""
    M, H, E, K = 16, 1024, 8 if group.size() <= 4 else 2 * group.size(), 3
    r = group.rank()
    kept = []
    for run_ in range(runs):
        tokens, xs, idxs, ws = ll_inputs(group, M, H, E, K, 7 + run_)
        buffer = ll_buffer(group, M, H, E, destroy)
        recv, count, handle, _, _ = buffer.low_latency_dispatch(xs[r], idxs[r], M, E, use_fp8=False)
        combined, _, _ = buffer.low_latency_combine(expert_rows(group, E, M, H), idxs[r], ws[r], handle)
        mine = [recv, count, handle[0], handle[1], combined]
        if destroy:
            buffer.destroy()
        gone = weakref.ref(buffer)
        del buffer, handle
        assert freed(gone)
        group.barrier()  # every rank's buffer is gone
        kept.append((mine, snapshot(mine)))
        # A new Buffer of the same shape: its memory must not be the old results'.
        _, xs2, idxs2, _ = ll_inputs(group, M, H, E, K, 1000 + run_)
        b2 = ll_buffer(group, M, H, E)
        b2.low_latency_dispatch(xs2[r], idxs2[r], M, E, use_fp8=False)
        del b2
    return [unchanged(h, s) for h, s in kept]


def case_zero_copy_outlives_buffer(group, runs):
    """DeepEP's pattern: the experts write into get_next_low_latency_combine_buffer, a zero-copy
    combine reads it; the buffer's tensor is kept (and written) after the Buffer is gone."""
    M, H, E, K = 16, 1024, 8 if group.size() <= 4 else 2 * group.size(), 3
    r = group.rank()
    bufs = []
    for run_ in range(runs):
        tokens, xs, idxs, ws = ll_inputs(group, M, H, E, K, 31 + run_)
        buffer = ll_buffer(group, M, H, E)
        recv, count, handle, _, _ = buffer.low_latency_dispatch(xs[r], idxs[r], M, E, use_fp8=False)
        buf = buffer.get_next_low_latency_combine_buffer(handle)
        buf.copy_(expert_rows(group, E, M, H))
        zc, _, _ = buffer.low_latency_combine(torch.zeros_like(buf), idxs[r], ws[r], handle, zero_copy=True)
        assert torch.equal(zc, combine_want(idxs[r], ws[r], H))
        gone = weakref.ref(buffer)
        del buffer, handle, recv, count
        assert freed(gone)
        group.barrier()
        buf.add_(1.0)  # still this rank's memory
        bufs.append(buf[:, :1].clone())
        del buf, zc
    return True


def case_many_held_normal(group, held_outputs):
    """More normal-mode dispatch results held at once than the Buffer's ring of receive regions
    has slots (64; a model's layers kept for the backward), from two inputs in turn: each keeps
    its bits, those past the ring in regions of their own."""
    E, K, H = 8, 2, 96
    r = group.rank()
    buffer = deep_ep.Buffer(group, int(1e9), 0)
    inputs = [make_inputs(group.size(), E, K, H, seed) for seed in (3, 4)]
    held, shots = [], []
    for i in range(held_outputs):
        xs, idxs, ws = inputs[i % 2]
        ntpr, _, ntpe, itir, _ = buffer.get_dispatch_layout(idxs[r], E)
        recv_x, recv_idx, recv_w, _, _, _ = buffer.dispatch(
            xs[r], num_tokens_per_rank=ntpr, is_token_in_rank=itir, num_tokens_per_expert=ntpe,
            topk_idx=idxs[r], topk_weights=ws[r])
        held.append([recv_x, recv_idx, recv_w])
        shots.append(snapshot(held[-1]))
    return [unchanged(h, s) for h, s in zip(held, shots)]


WORLDS = [(2, 0), (4, 0), (4, 2)]
IDS = ["R2", "R4", "R4_G2"]


@pytest.mark.parametrize("world", WORLDS, ids=IDS)
@pytest.mark.parametrize("mode", ["bf16", "bf16_hook", "fp8"])
def test_held_low_latency_results_never_change(world, mode):
    runs = RUNS if world == (2, 0) and mode == "bf16" else 3
    assert all(run(case_held_low_latency, world[0], runs, mode == "fp8", mode.endswith("hook"), G=world[1]))


@pytest.mark.parametrize("world", WORLDS, ids=IDS)
@pytest.mark.parametrize("destroy", [True, False], ids=["destroy", "dropped"])
def test_results_outlive_their_buffer(world, destroy):
    runs = RUNS if world == (2, 0) else 5
    for per_rank in run(case_outlive_buffer, world[0], runs, destroy, G=world[1]):
        assert per_rank == [True] * runs


@pytest.mark.parametrize("world", [(4, 2)], ids=["R4_G2"])
def test_more_held_results_than_ring_slots(world):
    for per_rank in run(case_many_held_normal, world[0], 64 + 3, G=world[1]):
        assert per_rank == [True] * (64 + 3)


def test_results_outlive_the_world():
    """Read after moed.launch returned: the rank threads, their Buffers and the world are gone."""
    def fn(group):
        tokens, xs, idxs, ws = ll_inputs(group, 8, 256, 4, 2, 5)
        buffer = ll_buffer(group, 8, 256, 4)
        r = group.rank()
        recv, count, handle, _, hook = buffer.low_latency_dispatch(xs[r], idxs[r], 8, 4, use_fp8=True,
                                                                   return_recv_hook=True)
        hook()
        mine = [recv[0], recv[1], count, handle[0], handle[1]]
        return mine, snapshot(mine)
    for mine, shot in run(fn, 2):
        gc.collect()
        assert unchanged(mine, shot)


@pytest.mark.parametrize("world", WORLDS, ids=IDS)
def test_zero_copy_buffer_outlives_its_buffer(world):
    runs = RUNS if world == (2, 0) else 5
    assert all(run(case_zero_copy_outlives_buffer, world[0], runs, G=world[1]))


def test_hook_after_destroy_has_received():
    """A dispatch hook not yet called when its Buffer is destroyed: destroy() runs the receive,
    so calling the hook later neither touches the gone world nor loses the rows."""
    def fn(group):
        M, H, E = 8, 256, 4
        tokens, xs, idxs, ws = ll_inputs(group, M, H, E, 2, 3)
        buffer = ll_buffer(group, M, H, E, destroy=True)
        r = group.rank()
        recv, count, handle, _, hook = buffer.low_latency_dispatch(xs[r], idxs[r], M, E, use_fp8=False,
                                                                   return_recv_hook=True)
        buffer.destroy()
        hook()
        check_low_latency(group, xs, idxs, tokens, E, recv, count, handle, False)
        with pytest.raises(RuntimeError, match="destroyed"):
            buffer.low_latency_dispatch(xs[r], idxs[r], M, E)
        return True
    assert all(run(fn, 2))


def make_everything(group):
    """A Buffer (normal and low-latency results), an ElasticBuffer and a Megatron-style Flex
    dispatcher, each with results it handed out, returned out of the rank's thread."""
    from test_megatron import inputs, six_steps
    from moed.megatron import MoEConfig, make_dispatcher
    R, r = group.size(), group.rank()
    E, K, H, M = 2 * R, 2, 128, 8
    tokens, xs, idxs, ws = ll_inputs(group, M, H, E, K, 17)
    buffer = ll_buffer(group, M, H, E)
    recv, count, handle, _, _ = buffer.low_latency_dispatch(xs[r], idxs[r], M, E, use_fp8=False)
    ntpr, _, ntpe, itir, _ = buffer.get_dispatch_layout(idxs[r], E)
    nrecv = buffer.dispatch(xs[r], num_tokens_per_rank=ntpr, is_token_in_rank=itir,
                            num_tokens_per_expert=ntpe, topk_idx=idxs[r], topk_weights=ws[r])[0]
    elastic = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=M, hidden=H, num_topk=K)
    erecv = elastic.dispatch(xs[r], topk_idx=idxs[r], topk_weights=ws[r], num_experts=E)[0]
    d = make_dispatcher("flex", MoEConfig(num_moe_experts=24, moe_router_topk=2))
    x, rmap, probs, _, _ = inputs(r, 20, 2, torch.float32)
    frecv = six_steps(d, x, rmap, probs, False)[0]
    results = [recv, count, handle[0], handle[1], nrecv, erecv, frecv]
    return [buffer, elastic, d, handle], results, snapshot(results)


@pytest.mark.parametrize("world", [(2, 0), (4, 2)], ids=["R2", "R4_G2"])
def test_objects_dropped_after_their_world_on_another_thread(world):
    """Buffers and dispatchers outlive moed.launch and are dropped by the main thread, after
    their world ended: the results they handed out keep their bits, nothing crashes."""
    out = run(make_everything, world[0], G=world[1])
    for objects, results, shot in out:
        with pytest.raises(RuntimeError):
            objects[0].low_latency_dispatch(results[0][0, :1], torch.zeros(1, 2, dtype=torch.int64), 8, 4)
        objects.clear()
        gc.collect()
        assert unchanged(results, shot)



def test_world_ends_with_steps_in_flight():
    """A Megatron-style dispatch and a low-latency dispatch left in flight (async step, hook not
    called) when moed.launch returns: the world's end completes them, nothing crashes, and the
    objects, dropped later by the main thread, raise a clear error if used."""
    from test_megatron import inputs
    from moed.megatron import MoEConfig, make_dispatcher

    def fn(group):
        r = group.rank()
        d = make_dispatcher("alltoall", MoEConfig(num_moe_experts=24, moe_router_topk=2))
        x, rmap, probs, _, _ = inputs(r, 20, 2, torch.float32)
        h, p = d.dispatch_preprocess(x, rmap, probs)
        d.token_dispatch(h, p, async_op=True)
        tokens, xs, idxs, ws = ll_inputs(group, 8, 256, 4, 2, 9)
        buffer = ll_buffer(group, 8, 256, 4)
        recv, count, handle, _, hook = buffer.low_latency_dispatch(xs[r], idxs[r], 8, 4, use_fp8=False,
                                                                   return_recv_hook=True)
        return r, (d, x, rmap, probs), buffer, hook, (xs, idxs, tokens), (recv, count, handle)

    for r, (d, x, rmap, probs), buffer, hook, (xs, idxs, tokens), (recv, count, handle) in run(fn, 2):
        hook()  # its receive ran when the world ended
        L = 2  # E = 4 experts over 2 ranks
        for j in range(L):
            want = want_rows(xs, idxs, tokens, r * L + j)
            assert count[j].item() == len(want)
            for i, (s, t) in enumerate(want):
                assert torch.equal(recv[j, i], xs[s][t])
        with pytest.raises(RuntimeError, match="ended"):
            d.dispatch_preprocess(x, rmap, probs)
        with pytest.raises(RuntimeError, match="world has ended"):
            buffer.low_latency_dispatch(xs[r], idxs[r], 8, 4)
        del d, buffer, hook
        gc.collect()
