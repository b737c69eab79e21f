"""One set of top-k rules (validate in moed/routing.h, design.md §2.2): each bad routing, on one
rank of 2, through every entry point that takes top-k routing, raises a ValueError with the
same message on every rank (collective calls name the rank; DeepEP's get_dispatch_layout is
local, as DeepEP's, and raises on the rank that has it). -1 (no expert) is accepted everywhere,
and so is a transposed (strided) topk_idx."""
import math

import pytest
import torch

import moed
import moed.deep_ep as deep_ep
from moed.megatron import make_dispatcher

R, E, K, H, M = 2, 8, 2, 64, 4
IDX = [[[0, 5], [2, 7], [1, 4]], [[3, 6], [0, 2], [1, 4]]]

# name: (token, k, new index or None, new weight or None) on rank 1, the message.
BAD = {
    "above": (1, 1, E, None, f"topk_idx[1][1] = {E} is outside [-1, {E})"),
    "below": (1, 1, -2, None, f"topk_idx[1][1] = -2 is outside [-1, {E})"),
    "repeat": (2, 1, 1, None, "topk_idx[2] repeats expert 1 (at k = 0 and k = 1)"),
    "nan": (0, 1, None, math.nan, "topk_weights[0][1] = nan is not a valid prob"),
    "inf": (0, 1, None, math.inf, "topk_weights[0][1] = inf is not a valid prob"),
    "-inf": (0, 1, None, -math.inf, "topk_weights[0][1] = -inf is not a valid prob"),
    "negative": (0, 1, None, -0.5, "topk_weights[0][1] = -0.5 is not a valid prob"),
    "no_expert": (1, 0, -1, None, None),  # allowed
}


# The entry points that check indices only (as DeepEP's): they take no weights, or carry them
# as they are (Buffer.dispatch and ElasticBuffer.dispatch: DeepEP's test_internode.py sends
# randn weights).
NO_WEIGHTS = {"get_dispatch_layout", "low_latency_dispatch", "dispatch", "elastic_dispatch"}


def inputs(rank, case):
    idx = torch.tensor(IDX[rank], dtype=deep_ep.topk_idx_t)
    w = torch.full((3, K), 0.5)
    t, k, e, v, _ = BAD[case]
    if rank == 1:
        if e is not None:
            idx[t, k] = e
        if v is not None:
            w[t, k] = v
    x = torch.randn(3, H, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
    return x, idx, w


def outcome(call):
    try:
        call()
        return "ok"
    except ValueError as e:
        return str(e)


def megatron(kind, x, idx, w):
    d = make_dispatcher(kind, num_moe_experts=E, moe_router_topk=K, moe_weighted_combine=True)
    try:
        h, p = d.dispatch_preprocess(x.float(), None, w, topk_idx=idx)
        d.dispatch_postprocess(*d.token_dispatch(h, p))
    finally:
        d.close()


def case_entry_points(group, case):
    r = group.rank()
    x, idx, w = inputs(r, case)
    weights_case = BAD[case][3] is not None
    out = {kind: outcome(lambda: megatron(kind, x, idx, w)) for kind in ("allgather", "alltoall", "flex")}

    buffer = deep_ep.Buffer(group, 1 << 24, 0)
    out["get_dispatch_layout"] = outcome(lambda: buffer.get_dispatch_layout(idx, E))
    # The layout of the routing without its bad entry, so dispatch itself meets the bad one.
    clean = idx.clone()
    if r == 1 and not weights_case:
        clean[BAD[case][0], BAD[case][1]] = -1
    ntpr, _, ntpe, itir, _ = buffer.get_dispatch_layout(clean, E)
    out["dispatch"] = outcome(lambda: buffer.dispatch(
        x, num_tokens_per_rank=ntpr, is_token_in_rank=itir, num_tokens_per_expert=ntpe,
        topk_idx=idx, topk_weights=w))

    elastic = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=M)
    out["elastic_dispatch"] = outcome(lambda: elastic.dispatch(x, topk_idx=idx, topk_weights=w,
                                                               num_experts=E))

    ll = deep_ep.Buffer(group, 0, deep_ep.Buffer.get_low_latency_rdma_size_hint(M, H, R, E),
                        low_latency_mode=True, num_qps_per_rank=E // R)
    # The low-latency combine takes the dispatch's indices (-1 may replace one) with weights.
    out["low_latency_dispatch"] = outcome(lambda: ll.low_latency_dispatch(x, idx, M, E, use_fp8=False))
    if weights_case:
        _, idx_ok, _ = inputs(r, "no_expert")
        recv, _, handle, _, _ = ll.low_latency_dispatch(x, idx_ok, M, E, use_fp8=False)
        out["low_latency_combine"] = outcome(lambda: ll.low_latency_combine(recv, idx_ok, w, handle))
    return out


@pytest.mark.parametrize("case", list(BAD))
def test_every_entry_point_raises_the_same_message(case):
    want = BAD[case][4]
    results = moed.launch(case_entry_points, R, case, timeout=60.0)
    for r, out in enumerate(results):
        for entry, got in out.items():
            if want is None or (entry in NO_WEIGHTS and BAD[case][3] is not None):
                assert got == "ok", (r, entry, got)  # allowed, or weights it does not take
            elif entry == "get_dispatch_layout":  # local
                assert got == (want if r == 1 else "ok"), (r, entry, got)
            else:
                assert got == f"rank 1: {want}", (r, entry, got)


def test_strided_topk_idx_is_accepted():
    """A transposed (non-contiguous) topk_idx routes as its contiguous copy."""
    def fn(group):
        x, idx, w = inputs(group.rank(), "no_expert")
        strided = idx.t().contiguous().t()
        assert not strided.is_contiguous()
        buffer = deep_ep.Buffer(group, 1 << 24, 0)
        got = buffer.get_dispatch_layout(strided, E)
        want = buffer.get_dispatch_layout(idx, E)
        return all(torch.equal(a, b) for a, b in zip(got, want) if isinstance(a, torch.Tensor))
    assert all(moed.launch(fn, R, timeout=60.0))
