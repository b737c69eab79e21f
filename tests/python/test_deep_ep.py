"""moed.deep_ep (DeepEP's legacy Buffer API) in DeepEP's test style (tests/test_intranode.py,
tests/test_low_latency.py): every output against a reference built straight from every rank's
topk_idx, compared bitwise (torch.equal) where moed promises bits.

The case_* functions run on one rank (a moed.Group); the tests run them on the threads world
over 1, 2, 3, 4, 8 ranks and 2 emulated nodes; mpi_deep_ep.py runs them under mpirun -np 4."""
import inspect

import pytest
import torch

import moed
import moed.deep_ep as deep_ep

WORLDS = [(1, 0), (2, 0), (3, 0), (4, 0), (8, 0), (4, 2)]
WORLD_IDS = [f"R{r}" + (f"_G{g}" if g else "") for r, g in WORLDS]


def run(fn, world, *args):
    R, G = world
    return moed.launch(fn, R, *args, ranks_per_node=G, timeout=120.0, threads_per_rank=1)


# ---- the global problem, the same on every rank ----

def make_inputs(R, E, K, H, seed, dtype=torch.bfloat16, tokens=None):
    g = torch.Generator().manual_seed(seed)
    xs, idxs, ws = [], [], []
    for s in range(R):
        T = tokens[s] if tokens is not None else (0 if (R > 1 and s == 1) else 3 + (5 * s + seed) % 9)
        xs.append(torch.randn(T, H, generator=g).to(dtype))
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else \
            torch.empty(0, K, dtype=torch.int64)
        drop = torch.rand(T, K, generator=g) < 0.15
        idx = idx.masked_fill(drop, -1).to(deep_ep.topk_idx_t)
        ws.append(torch.rand(T, K, generator=g) + 0.1)
        idxs.append(idx)
    return xs, idxs, ws


def low_latency_inputs(group, M, H, E, K, seed, empty_rank=False):
    """Every rank's token count (1..M; none on rank 1 with empty_rank), its inputs and this
    rank's low-latency Buffer for them."""
    R = group.size()
    tokens = [0 if (empty_rank and R > 1 and s == 1) else min(M, 1 + (3 * s + seed) % M)
              for s in range(R)]
    xs, idxs, ws = make_inputs(R, E, K, H, seed, tokens=tokens)
    buffer = deep_ep.Buffer(group, 0, deep_ep.Buffer.get_low_latency_rdma_size_hint(M, H, R, E),
                            low_latency_mode=True, num_qps_per_rank=E // R)
    return tokens, xs, idxs, ws, buffer


def rank_of(idx, E, R):
    L = E // R
    r = idx // L
    return r.masked_fill(idx < 0, -1)


def ref_layout(idx, E, R, G):
    T = idx.size(0)
    in_rank = torch.zeros(T, R, dtype=torch.bool)
    ranks = rank_of(idx, E, R)
    for t in range(T):
        for k in range(idx.size(1)):
            if ranks[t, k] >= 0:
                in_rank[t, ranks[t, k]] = True
    per_expert = torch.tensor([(idx == e).sum().item() for e in range(E)], dtype=torch.int32)
    per_rank = in_rank.sum(0).to(torch.int32)
    N = R // G if G else 1
    per_node = None
    if N > 1:
        per_node = in_rank.view(T, N, G).any(2).sum(0).to(torch.int32)
    return per_rank, per_node, per_expert, in_rank


def ref_recv(xs, idxs, ws, E, R, r):
    """Rank r's rank-major receive: rows, local top-k, weights, source indices, expert counts."""
    L = E // R
    rows, tidx, tw, src, src_rank = [], [], [], [], []
    counts = [0] * L
    for s in range(R):
        for t in range(idxs[s].size(0)):
            e = idxs[s][t]
            local = (e >= r * L) & (e < (r + 1) * L)
            if not bool(local.any()):
                continue
            rows.append(xs[s][t])
            tidx.append(torch.where(local, e - r * L, torch.full_like(e, -1)))
            tw.append(torch.where(local, ws[s][t], torch.zeros_like(ws[s][t])))
            src.append(t)
            src_rank.append(s)
            for j in (e[local] - r * L).tolist():
                counts[j] += 1
    H, K = xs[0].size(1), idxs[0].size(1)
    stack = lambda v, shape, dt: torch.stack(v) if v else torch.empty(shape, dtype=dt)  # noqa: E731
    return (stack(rows, (0, H), xs[0].dtype), stack(tidx, (0, K), torch.int64),
            stack(tw, (0, K), torch.float32), src, src_rank, counts)


def expert_out(recv_x, r):
    """What the experts of rank r return: a per-rank function of the row (bf16)."""
    return (recv_x.float() * (r + 1) + 0.5).to(torch.bfloat16)


# ---- normal mode ----

def case_normal(group, E, K, H, seed, worst=0, alignment=1):
    R, r = group.size(), group.rank()
    G = group.ranks_per_node() if group.num_nodes() > 1 else 0
    xs, idxs, ws = make_inputs(R, E, K, H, seed)
    buffer = deep_ep.Buffer(group, int(1e9), 0)
    x, topk_idx, topk_weights = xs[r], idxs[r], ws[r]

    # Layout as DeepEP counts it.
    ntpr, ntprdma, ntpe, itir, event = buffer.get_dispatch_layout(topk_idx, E)
    want = ref_layout(topk_idx, E, R, G)
    assert torch.equal(ntpr, want[0]) and torch.equal(ntpe, want[2]) and torch.equal(itir, want[3])
    assert (ntprdma is None) == (want[1] is None) and (ntprdma is None or torch.equal(ntprdma, want[1]))
    event.current_stream_wait()

    recv_x, recv_topk_idx, recv_topk_weights, expert_list, handle, event = buffer.dispatch(
        x, num_tokens_per_rank=ntpr, is_token_in_rank=itir, num_tokens_per_expert=ntpe,
        topk_idx=topk_idx, topk_weights=topk_weights, expert_alignment=alignment,
        num_worst_tokens=worst, config=buffer.get_dispatch_config(R))
    with event:
        pass
    rows, tidx, tw, src, src_rank, counts = ref_recv(xs, idxs, ws, E, R, r)
    n = rows.size(0)
    assert recv_x.size(0) == (worst if worst else n)
    assert torch.equal(recv_x[:n], rows), "rank-major rows or order differ"
    assert torch.equal(recv_topk_idx[:n], tidx) and torch.equal(recv_topk_weights[:n], tw)
    if worst:
        assert expert_list == []
        assert torch.count_nonzero(recv_x[n:].float()) == 0
        assert bool((recv_topk_idx[n:] == -1).all()) and bool((recv_topk_weights[n:] == 0).all())
    else:
        assert expert_list == [(c + alignment - 1) // alignment * alignment for c in counts]

    # The handle: DeepEP's layout, intranode (six arrays) or internode (ten; DeepEP's
    # test_internode.py reads handle[-4]), with num_sms / 2 channels.
    C = deep_ep.Buffer.num_sms // 2
    per_pair = torch.stack([ref_layout(idxs[s], E, R, G)[0] for s in range(R)])  # [src, dst]
    if G:
        assert len(handle) == 10
        itir_h, _, channel_prefix_matrix, _, _, recv_channel_prefix_matrix, recv_gbl_rank_prefix_sum = handle[:7]
        assert torch.equal(recv_gbl_rank_prefix_sum, per_pair[:, r].cumsum(0).to(torch.int32))
        assert handle[-4] is recv_gbl_rank_prefix_sum and recv_gbl_rank_prefix_sum[-1] == n
    else:
        rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx, itir_h, send_head = handle
        assert torch.equal(rank_prefix_matrix, per_pair.cumsum(0).to(torch.int32))
        assert torch.equal(recv_src_idx[:n], torch.tensor(src, dtype=torch.int32))
        assert bool(((send_head >= 0) == itir).all())
    assert torch.equal(itir_h, itir)
    assert channel_prefix_matrix.shape == (R, C) and recv_channel_prefix_matrix.shape == (R, C)
    assert torch.equal(channel_prefix_matrix[:, -1], ntpr)

    # Cached dispatch == uncached, bit for bit.
    again, none1, none2, none3, none4, _ = buffer.dispatch(x, handle=handle)
    assert torch.equal(again, recv_x) and none1 is None and none4 is None

    # Combine: bias_0 + bias_1 + sum over the ranks that got the token, ascending, fp32.
    y = expert_out(recv_x, r)
    bias_0 = (torch.arange(x.size(0) * H, dtype=torch.float32).view(-1, H) * 1e-3).to(torch.bfloat16)
    bias_1 = torch.full((x.size(0), H), 0.25, dtype=torch.bfloat16)
    combined_x, combined_w, _ = buffer.combine(y, handle, topk_weights=recv_topk_weights,
                                               bias=(bias_0, bias_1))
    acc = bias_0.float() + bias_1.float()
    wacc = torch.zeros(x.size(0), K)
    for q in range(R):
        for t in range(x.size(0)):
            if itir[t, q]:
                acc[t] = acc[t] + expert_out(x[t:t + 1], q)[0].float()
                wacc[t] = wacc[t] + torch.where(rank_of(topk_idx[t], E, R) == q, topk_weights[t],
                                                torch.zeros(K))
    assert torch.equal(combined_x, acc.to(torch.bfloat16)), "combine differs"
    assert torch.equal(combined_w, wacc)
    # DeepEP's own check: x routed to n ranks comes back n times (no bias, no weights).
    plain, none, _ = buffer.combine(recv_x, handle)
    assert none is None
    return True


def case_fp8(group, seed):
    R, r = group.size(), group.rank()
    E, K, H = 2 * R, 2, 256
    xs, idxs, ws = make_inputs(R, E, K, H, seed, dtype=torch.float32)
    fp8 = deep_ep.fp8_dtype
    g = torch.Generator().manual_seed(seed + 1)
    data = [torch.randint(0, 0x7e, (x.size(0), H), generator=g, dtype=torch.uint8) for x in xs]
    data = [d if fp8 is torch.uint8 else d.view(fp8) for d in data]
    scales = [torch.rand(x.size(0), H // 128, generator=g) for x in xs]
    buffer = deep_ep.Buffer(group, int(1e9))
    ntpr, _, ntpe, itir, _ = buffer.get_dispatch_layout(idxs[r], E)
    (recv_data, recv_scales), _, _, _, handle, _ = buffer.dispatch(
        (data[r], scales[r]), num_tokens_per_rank=ntpr, is_token_in_rank=itir,
        num_tokens_per_expert=ntpe, topk_idx=idxs[r], topk_weights=ws[r])
    assert recv_data.dtype == fp8 and recv_scales.dtype == torch.float32
    _, _, _, src, src_rank, _ = ref_recv(xs, idxs, ws, E, R, r)
    bits = lambda t: t.view(torch.uint8)  # noqa: E731
    for i, (t, s) in enumerate(zip(src, src_rank)):
        assert torch.equal(bits(recv_data[i]), bits(data[s][t])) and torch.equal(recv_scales[i], scales[s][t])
    (d2, s2), *_ = buffer.dispatch((data[r], scales[r]), handle=handle)
    assert torch.equal(bits(d2), bits(recv_data)) and torch.equal(s2, recv_scales)
    # Into a caller's fp8 tensor (moed's extension; rows strided): the same bits, and the
    # columns beside the rows untouched. The scales stay moed's.
    big = torch.full((recv_data.size(0), H + 3), 0x7f, dtype=torch.uint8)
    out = big[:, :H] if fp8 is torch.uint8 else big.view(fp8)[:, :H]
    (d3, s3), *_ = buffer.dispatch((data[r], scales[r]), handle=handle, out=out)
    assert d3 is out and torch.equal(bits(out), bits(recv_data)) and torch.equal(s3, recv_scales)
    assert bool((big[:, H:] == 0x7f).all())
    return True


@pytest.mark.parametrize("world", WORLDS, ids=WORLD_IDS)
@pytest.mark.parametrize("K,H", [(2, 100), ("E", 36), (1, 64)], ids=["K2_H100", "KE_H36", "K1_H64"])
def test_normal_dispatch_combine(world, K, H):
    R = world[0]
    E = 2 * R
    run(case_normal, world, E, E if K == "E" else K, H, 7 + R)


@pytest.mark.parametrize("world", [(4, 0), (4, 2)], ids=["R4", "R4_G2"])
def test_num_worst_tokens_and_alignment(world):
    run(case_normal, world, 8, 3, 100, 3, 64, 4)


@pytest.mark.parametrize("world", WORLDS, ids=WORLD_IDS)
def test_fp8_dispatch(world):
    run(case_fp8, world, 11)


def case_held_recv(group, E, K, H, seed):
    """recv_x and recv_topk_weights stay unchanged through later dispatches while held (each
    takes another receive region in the MPI and gloo worlds), and outlive the buffer."""
    R, r = group.size(), group.rank()
    xs, idxs, ws = make_inputs(R, E, K, H, seed)
    buffer = deep_ep.Buffer(group, int(1e9), 0, explicitly_destroy=True)
    ntpr, _, ntpe, itir, _ = buffer.get_dispatch_layout(idxs[r], E)
    recv_x, _, recv_w, _, handle, _ = buffer.dispatch(
        xs[r], num_tokens_per_rank=ntpr, is_token_in_rank=itir, num_tokens_per_expert=ntpe,
        topk_idx=idxs[r], topk_weights=ws[r])
    kept = (recv_x.clone(), recv_w.clone())
    for step in range(3):
        later = buffer.dispatch(xs[r] * (step + 2), handle=handle)[0]
        buffer.combine(later, handle)
    unchanged = torch.equal(recv_x, kept[0]) and torch.equal(recv_w, kept[1])
    buffer.destroy()
    group.barrier()  # every rank's buffer is gone
    return unchanged and torch.equal(recv_x, kept[0]) and torch.equal(recv_w, kept[1])


@pytest.mark.parametrize("world", [(4, 0), (4, 2)], ids=["R4", "R4_G2"])
def test_held_recv_x_is_never_overwritten(world):
    assert all(run(case_held_recv, world, 8, 2, 64, 21))


# ---- low-latency mode ----

def quantize_ref(x, round_scale):
    """design.md §6.2's FP8 rule in torch: per 128 channels, E4M3FN bits (uint8) and scale_inv."""
    T, H = x.shape
    xf = x.float().view(T, H // 128, 128)
    amax = xf.abs().amax(2).clamp_min(1e-4)
    scale_inv = amax * (1.0 / 448.0)  # DeepEP's kernel: a multiply by the float 1 / 448
    if round_scale:
        b = scale_inv.view(torch.int32)
        e = (b >> 23) + ((b & 0x7fffff) != 0).to(torch.int32)
        scale_inv = (e << 23).view(torch.float32)
        scale = 1.0 / scale_inv
    else:
        scale = torch.full_like(amax, 448.0) / amax  # true division (448 / t is a reciprocal times 448)
    v = (xf * scale.unsqueeze(2)).view(T, H)
    return e4m3_bits(v), scale_inv


def e4m3_bits(v):
    u = v.view(torch.int32).to(torch.int64) & 0xffffffff
    sign = ((u >> 24) & 0x80)
    a = u & 0x7fffffff
    out = torch.zeros_like(a)
    sat = a >= 0x43e00000
    sub = a < 0x3c800000
    # normal: round to nearest even on the 20 dropped bits
    lsb = (a >> 20) & 1
    r = a + 0x7ffff + lsb
    code = (((r >> 23) - 120) << 3) | ((r >> 20) & 7)
    code = code.clamp(max=0x7e)
    out = torch.where(sat, torch.full_like(a, 0x7e), code)
    magic = torch.tensor(16384.0)
    subv = (a.to(torch.int32).view(torch.float32) + magic).view(torch.int32).to(torch.int64) - \
        magic.view(torch.int32).to(torch.int64)
    out = torch.where(sub, subv, out)
    return (out | sign).to(torch.uint8)


def case_low_latency(group, M, H, E, K, seed, use_fp8, round_scale, use_ue8m0, hook_mode):
    R, r = group.size(), group.rank()
    L = E // R
    tokens, xs, idxs, ws, buffer = low_latency_inputs(group, M, H, E, K, seed)
    stats = torch.zeros(L, dtype=torch.int32)
    recv, recv_count, handle, event, hook = buffer.low_latency_dispatch(
        xs[r], idxs[r], M, E, cumulative_local_expert_recv_stats=stats, use_fp8=use_fp8,
        round_scale=round_scale, use_ue8m0=use_ue8m0, return_recv_hook=hook_mode)
    hook() if hook_mode else event.current_stream_wait()
    assert (hook is None) != hook_mode
    src_info, layout_range, m_, h_, e_ = handle
    assert (m_, h_, e_) == (M, H, E)
    recv_x = recv[0] if use_fp8 else recv
    assert tuple(recv_x.shape) == (L, R * M, H)
    for j in range(L):
        e = r * L + j
        want = [(s, t) for s in range(R) for t in range(tokens[s]) if bool((idxs[s][t] == e).any())]
        assert recv_count[j].item() == len(want) and stats[j].item() == len(want)
        got_src = src_info[j, :len(want)].tolist()
        assert got_src == [t for _, t in want]
        begin = 0
        for s in range(R):
            n = sum(1 for q, _ in want if q == s)
            packed = layout_range[j, s].item()
            assert (packed >> 32, packed & 0xffffffff) == (begin if n else (packed >> 32), n)
            begin += n
        for i, (s, t) in enumerate(want):
            if not use_fp8:
                assert torch.equal(recv_x[j, i], xs[s][t])
                continue
            q, sinv = quantize_ref(xs[s][t:t + 1], round_scale)
            assert torch.equal(recv_x[j, i].view(torch.uint8), q[0])
            if use_ue8m0:
                exps = (sinv.view(torch.int32) >> 23) & 0xff
                packed = (exps.view(-1, 4).to(torch.int64) << torch.tensor([0, 8, 16, 24])).sum(1)
                assert torch.equal(recv[1][j, i].to(torch.int64) & 0xffffffff, packed)
            else:
                assert torch.equal(recv[1][j, i], sinv[0])

    # Combine: with and without zero copy, with and without the hook; weighted, experts
    # ascending, fp32 from 0.
    y = (recv_x.float() if not use_fp8 else torch.ones(L, R * M, H)).to(torch.bfloat16) * (r + 1)
    combined, event, chook = buffer.low_latency_combine(y, idxs[r], ws[r], handle,
                                                        return_recv_hook=hook_mode)
    chook() if hook_mode else None
    buf = buffer.get_next_low_latency_combine_buffer(handle)
    buf.copy_(y)
    zc, _, zhook = buffer.low_latency_combine(y, idxs[r], ws[r], handle, zero_copy=True,
                                              return_recv_hook=hook_mode)
    zhook() if hook_mode else None
    assert torch.equal(zc, combined)
    T = tokens[r]
    want = torch.zeros(T, H)
    for t in range(T):
        for e in sorted(idxs[r][t].tolist()):
            if e < 0:
                continue
            q = e // L
            k = idxs[r][t].tolist().index(e)
            row = xs[r][t].float() if not use_fp8 else torch.ones(H)
            term = (row.to(torch.bfloat16) * (q + 1)).float()
            want[t] = want[t] + ws[r][t, k] * term
    assert torch.equal(combined, want.to(torch.bfloat16))
    return True


@pytest.mark.parametrize("world", WORLDS, ids=WORLD_IDS)
@pytest.mark.parametrize("mode", ["bf16", "bf16_hook", "fp8", "fp8_round_hook", "ue8m0"])
def test_low_latency(world, mode):
    R = world[0]
    use_fp8 = mode.startswith("fp8") or mode == "ue8m0"
    round_scale = "round" in mode or mode == "ue8m0"
    run(case_low_latency, world, 6, 512, 2 * R, min(3, 2 * R), 5 + R, use_fp8, round_scale,
        mode == "ue8m0", mode.endswith("hook"))


# ---- bad input: an error naming the value on every rank ----

def case_bad_inputs(group):
    R, r = group.size(), group.rank()
    E, K, H = 2 * R, 2, 64
    xs, idxs, ws = make_inputs(R, E, K, H, 3, tokens=[5] * R)
    buffer = deep_ep.Buffer(group, int(1e9))
    ntpr, _, ntpe, itir, _ = buffer.get_dispatch_layout(idxs[r], E)
    errors = []
    bad = idxs[r].clone()
    if r == R - 1:
        bad[2, 1] = 999
    try:
        buffer.dispatch(xs[r], num_tokens_per_rank=ntpr, is_token_in_rank=itir, num_tokens_per_expert=ntpe,
                        topk_idx=bad, topk_weights=ws[r])
    except ValueError as e:
        errors.append(str(e))
    wrong = ntpr.clone()
    if r == 0:
        wrong[0] += 1
    try:
        buffer.dispatch(xs[r], num_tokens_per_rank=wrong, is_token_in_rank=itir, num_tokens_per_expert=ntpe)
    except ValueError as e:
        errors.append(str(e))
    try:
        buffer.dispatch(xs[r], num_tokens_per_rank=ntpr, is_token_in_rank=itir, num_tokens_per_expert=ntpe,
                        num_worst_tokens=1 if R > 0 else 0)
    except ValueError as e:
        errors.append(str(e))
    # A malformed argument on one rank: that rank raises its TypeError, every other rank a
    # ValueError naming the rank and the value (nobody waits).
    xx = xs[r].double() if r == R - 1 else xs[r]
    try:
        buffer.dispatch(xx, num_tokens_per_rank=ntpr, is_token_in_rank=itir, num_tokens_per_expert=ntpe)
    except (TypeError, ValueError) as e:
        errors.append(f"{type(e).__name__}: {e}")
    # Local type errors raise at once, naming the argument.
    with pytest.raises(TypeError, match="topk_idx"):
        buffer.get_dispatch_layout(idxs[r].float(), E)
    with pytest.raises(TypeError, match="handle"):
        buffer.combine(xs[r], (1, 2, 3, 4, 5, 6))
    with pytest.raises(ValueError, match="use_ue8m0"):
        buffer.low_latency_dispatch(xs[r], idxs[r], 8, E, use_fp8=True, round_scale=False, use_ue8m0=True)
    # The buffer still works after the errors.
    recv_x, *_ = buffer.dispatch(xs[r], num_tokens_per_rank=ntpr, is_token_in_rank=itir,
                                 num_tokens_per_expert=ntpe, topk_idx=idxs[r], topk_weights=ws[r])
    return errors


@pytest.mark.parametrize("world", [(1, 0), (3, 0), (4, 2)], ids=["R1", "R3", "R4_G2"])
def test_bad_inputs_raise_on_every_rank(world):
    R = world[0]
    results = run(case_bad_inputs, world)
    for r, errors in enumerate(results):
        assert len(errors) == 4, errors
        assert f"rank {R - 1}: topk_idx[2][1] = 999 is outside [-1, {2 * R})" in errors[0]
        assert "rank 0: num_tokens_per_rank[0]" in errors[1]
        assert "num_worst_tokens = 1" in errors[2]
        if r == R - 1:
            assert errors[3].startswith("TypeError: x has dtype torch.float64"), errors[3]
        else:
            assert errors[3].startswith(f"ValueError: rank {R - 1}: x has dtype torch.float64"), errors[3]


# ---- the API surface is DeepEP's ----

def test_signatures_match_deepep():
    params = lambda f: list(inspect.signature(f).parameters)  # noqa: E731
    assert params(deep_ep.Buffer.__init__) == [
        "self", "group", "num_nvl_bytes", "num_rdma_bytes", "low_latency_mode", "num_qps_per_rank",
        "allow_nvlink_for_low_latency_mode", "allow_mnnvl", "explicitly_destroy", "enable_shrink", "comm",
        "shrink_timeout"]  # shrink_timeout: keyword-only, moed's extension
    assert params(deep_ep.Buffer.dispatch) == [
        "self", "x", "handle", "num_tokens_per_rank", "num_tokens_per_rdma_rank", "is_token_in_rank",
        "num_tokens_per_expert", "topk_idx", "topk_weights", "expert_alignment", "num_worst_tokens",
        "config", "previous_event", "async_finish", "allocate_on_comm_stream",
        "out"]  # out: keyword-only, moed's extension
    assert params(deep_ep.Buffer.combine) == [
        "self", "x", "handle", "topk_weights", "bias", "config", "previous_event", "async_finish",
        "allocate_on_comm_stream", "out"]  # out: keyword-only, moed's extension
    assert params(deep_ep.Buffer.low_latency_dispatch) == [
        "self", "x", "topk_idx", "num_max_dispatch_tokens_per_rank", "num_experts",
        "cumulative_local_expert_recv_stats", "dispatch_wait_recv_cost_stats", "use_fp8", "round_scale",
        "use_ue8m0", "async_finish", "return_recv_hook"]
    assert params(deep_ep.Buffer.low_latency_combine) == [
        "self", "x", "topk_idx", "topk_weights", "handle", "use_logfmt", "zero_copy", "async_finish",
        "return_recv_hook", "out", "combine_wait_recv_cost_stats",
        "order"]  # order: keyword-only, moed's extension
    assert params(deep_ep.Buffer.get_dispatch_layout) == [
        "self", "topk_idx", "num_experts", "previous_event", "async_finish", "allocate_on_comm_stream"]
    assert deep_ep.Buffer.is_sm90_compiled() is True
    assert deep_ep.topk_idx_t is torch.int64
    assert isinstance(deep_ep.Buffer.get_dispatch_config(8), deep_ep.Config)
    # DeepEP's own numbers (csrc/legacy/config.hpp worked by hand): no RDMA bytes up to 8 ranks.
    assert deep_ep.Config(24, 8, 256).get_nvl_buffer_size_hint(7168 * 2, 8) == 402851712
    assert deep_ep.Config(24, 8, 256).get_rdma_buffer_size_hint(7168 * 2, 8) == 0
    config = deep_ep.Config(24, 8, 256, 16, 120)
    assert config.num_max_rdma_chunked_recv_tokens == 128  # rounded up to the send chunk
    assert config.get_rdma_buffer_size_hint(7168 * 2, 16) == 100814208
    # The module-level names DeepEP's package has.
    assert deep_ep.__version__.startswith("2.1.0")
    assert deep_ep.get_logical_domain_size is deep_ep.utils.envs.get_logical_domain_size
    assert callable(deep_ep.get_physical_domain_size)
    assert deep_ep.utils.EventOverlap is deep_ep.EventOverlap
    from moed.deep_ep.utils import math as ep_math
    assert ep_math.align(5, 4) == 8
    ev = deep_ep.Buffer.capture()
    ev.current_stream_wait()
    with ev:
        pass


def test_example_runs():
    import pathlib
    import runpy
    path = pathlib.Path(__file__).resolve().parents[2] / "python" / "examples" / "deep_ep_example.py"
    body = runpy.run_path(str(path))["body"]
    shapes = moed.launch(body, 4, ranks_per_node=2, timeout=120.0, threads_per_rank=1)
    assert all(s == (torch.Size([256, 1024]), torch.Size([32, 1024])) for s in shapes)
