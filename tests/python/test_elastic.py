"""moed.deep_ep.ElasticBuffer (DeepEP V2's API) against a reference written here, token by
token, from every rank's routing: both layouts, cached handles, FP8 (either scale order, and
UE8M0 packs), -1 entries, ranks with no tokens, biases, worst-case sizes (do_cpu_sync=False),
and the combine in DeepEP V2's order for each recipe, compared bitwise (torch.equal).

The case_* functions run on one rank (a moed.Group); the tests run them on the threads world
(1, 2, 3, 4 ranks and 2 emulated nodes); mpi_deep_ep.py and gloo_workers.py run them under
mpirun and in gloo processes."""
import pytest
import torch

import moed
import moed.deep_ep as deep_ep
from test_deep_ep import make_inputs, run

WORLDS = [(1, 0), (2, 0), (3, 0), (4, 0), (4, 2)]
WORLD_IDS = ["R1", "R2", "R3", "R4", "R4_G2"]


# ---- the reference ----

def y_of(src_global, slot, H):
    """A deterministic expert output for one (token, slot), bf16 (what an expert returns)."""
    v = torch.arange(H, dtype=torch.float32) * 0.01 + float(src_global) * 0.5 - float(slot) * 1.25
    return torch.sin(v).to(torch.bfloat16)


def ref_combine(terms, recipe, bias):
    """One token: terms = [(slot, rank, node, row bf16)], summed in DeepEP V2's order."""
    acc = bias.clone() if bias is not None else torch.zeros(terms[0][3].shape if terms else 0)
    local, scaleup = recipe

    def group(items, key):
        groups = {}
        for it in sorted(items, key=lambda i: i[0]):
            groups.setdefault(key(it), []).append(it)
        out = []
        for members in groups.values():
            s = torch.zeros(members[0][3].shape)
            for m in members:
                s = s + m[3].float()
            last = members[-1]
            out.append((last[0], last[1], last[2], s.to(torch.bfloat16)))
        return out

    items = list(terms)
    if local:
        items = group(items, lambda i: i[1])
    if local and scaleup:
        items = group(items, lambda i: i[2])
    for it in sorted(items, key=lambda i: i[0]):
        acc = acc + it[3].float()
    return acc


def recipe_of(allow_multiple_reduction, hybrid, expand):
    if allow_multiple_reduction:
        return (True, hybrid)
    return (not expand, False)


# ---- one rank's case ----

def case_elastic(group, E, K, H, seed, expand, alignment=1, fp8=None, cpu_sync=True,
                 multi=True, hybrid=True, num_bias=0, with_weights=True, tokens=None):
    """fp8: None, "row" (float32 scales, row-major), "col" (column-major) or "ue8m0"."""
    R, r = group.size(), group.rank()
    G = group.ranks_per_node() if group.num_nodes() > 1 else R
    L = E // R
    xs, idxs, ws = make_inputs(R, E, K, H, seed, tokens=tokens)
    M = max(x.size(0) for x in xs) + 1
    x, topk_idx, topk_w = xs[r], idxs[r], ws[r]
    buffer = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=M, hidden=H, num_topk=K,
                                   allow_hybrid_mode=hybrid, allow_multiple_reduction=multi)
    use_hybrid = hybrid and group.num_nodes() > 1
    assert buffer.get_logical_domain_size() == ((group.num_nodes(), G) if use_hybrid else (1, R))
    payload = x
    if fp8:
        g = torch.Generator().manual_seed(seed + 100)
        bits = [torch.randint(0, 0x7e, (t.size(0), H), generator=g, dtype=torch.uint8) for t in xs]
        if fp8 == "ue8m0":
            exps = [torch.randint(100, 140, (t.size(0), H // 128), generator=g, dtype=torch.int32)
                    for t in xs]
            scales = [(e << 23).view(torch.float32) for e in exps]
            packed = [e.to(torch.uint8).view(torch.int32) for e in exps]
        else:
            scales = [torch.rand(t.size(0), H // 128, generator=g) for t in xs]
        data = bits[r] if deep_ep.fp8_dtype is torch.uint8 else bits[r].view(deep_ep.fp8_dtype)
        sf = packed[r] if fp8 == "ue8m0" else scales[r]
        if fp8 == "col":
            sf = sf.T.contiguous().T
        payload = (data, sf)
    recv_x, recv_idx, recv_w, handle, event = buffer.dispatch(
        payload, topk_idx=topk_idx, topk_weights=topk_w if with_weights else None, num_experts=E,
        expert_alignment=alignment, do_cpu_sync=cpu_sync, do_expand=expand)
    event.current_stream_wait()
    recv_data, recv_sf = recv_x if fp8 else (recv_x, None)
    bits_of = (lambda t: t.view(torch.uint8)) if fp8 else (lambda t: t)

    # The tokens this rank receives: source rank ascending, then token ascending.
    received = [(s, t) for s in range(R) for t in range(xs[s].size(0))
                if any(0 <= int(e) < E and int(e) // L == r for e in idxs[s][t])]
    n = len(received)
    assert handle.num_recv_tokens == n and handle.psum_num_recv_tokens_per_scaleup_rank[-1] == n
    per_scaleup = [0] * buffer.num_scaleup_ranks
    for s, _ in received:
        per_scaleup[s % buffer.num_scaleup_ranks] += 1
    assert handle.psum_num_recv_tokens_per_scaleup_rank.tolist() == \
        torch.tensor(per_scaleup).cumsum(0).tolist()
    counts = [sum(int(idxs[s][t][k]) == r * L + j for s, t in received for k in range(K)) for j in range(L)]
    aligned = [(c + alignment - 1) // alignment * alignment for c in counts]
    assert handle.num_unaligned_recv_tokens_per_expert.tolist() == counts
    assert handle.num_recv_tokens_per_expert_list == (aligned if cpu_sync else [])
    meta = handle.recv_src_metadata
    assert meta.shape == (n, K + 2)
    for i, (s, t) in enumerate(received):
        slots = [k for k in range(K) if 0 <= int(idxs[s][t][k]) < E and int(idxs[s][t][k]) // L == r]
        assert meta[i, 0] == s * M + t and meta[i, 1] == s * K + max(slots)

    if not expand:
        rows = recv_data.size(0)
        assert rows == (n if cpu_sync else R * M)
        for i, (s, t) in enumerate(received):
            src = bits[s][t] if fp8 else xs[s][t]
            assert torch.equal(bits_of(recv_data[i]), src), (i, s, t)
            if fp8:
                want = scales[s][t]
                got = recv_sf[i] if fp8 != "ue8m0" else \
                    (recv_sf[i].contiguous().view(torch.uint8).to(torch.int32) << 23).view(torch.float32)
                assert torch.equal(got, want)
            local = (idxs[s][t] >= r * L) & (idxs[s][t] < (r + 1) * L)
            assert torch.equal(recv_idx[i], torch.where(local, idxs[s][t] - r * L, torch.full_like(idxs[s][t], -1)))
            if with_weights:
                assert torch.equal(recv_w[i], torch.where(local, ws[s][t], torch.zeros(K)))
        assert bool((recv_idx[n:] == -1).all()) and torch.count_nonzero(bits_of(recv_data[n:]).float()) == 0
        assert (recv_w is None) == (not with_weights)
        # Cached: the same rows, recv_topk_idx again.
        again, again_idx, again_w, h2, _ = buffer.dispatch(payload, handle=handle,
                                                           topk_weights=topk_w if with_weights else None)
        assert h2 is handle and torch.equal(again_idx, recv_idx)
        assert torch.equal(bits_of(again[0] if fp8 else again), bits_of(recv_data))
        if with_weights:
            assert torch.equal(again_w, recv_w)
        # The experts' outputs: each rank reduces its slots (fp32 from 0, slot order, rounded).
        y = torch.zeros(recv_data.size(0), H, dtype=torch.bfloat16)
        for i, (s, t) in enumerate(received):
            acc = torch.zeros(H)
            for k in range(K):
                e = int(idxs[s][t][k])
                if 0 <= e < E and e // L == r:
                    acc = acc + y_of(s * M + t, k, H).float()
            y[i] = acc.to(torch.bfloat16)
        combine_w = recv_w
    else:
        rows = recv_data.size(0)
        offsets = [0]
        for a in aligned:
            offsets.append(offsets[-1] + a)
        assert rows >= offsets[-1] and (rows == offsets[-1] or not cpu_sync)
        assert torch.count_nonzero(bits_of(recv_data[offsets[-1]:]).float()) == 0
        assert handle.psum_num_recv_tokens_per_expert.tolist() == [offsets[j] + counts[j] for j in range(L)]
        y = torch.zeros(rows, H, dtype=torch.bfloat16)
        row_of = {}
        for j in range(L):
            seg = [(s, t, k) for s, t in received for k in range(K) if int(idxs[s][t][k]) == r * L + j]
            for q, (s, t, k) in enumerate(seg):
                row = offsets[j] + q
                row_of[(s, t, k)] = row
                src = bits[s][t] if fp8 else xs[s][t]
                assert torch.equal(bits_of(recv_data[row]), src), (j, q)
                if with_weights:
                    assert recv_w[row] == ws[s][t][k]
                y[row] = y_of(s * M + t, k, H)
            pad = slice(offsets[j] + counts[j], offsets[j + 1])
            assert torch.count_nonzero(bits_of(recv_data[pad]).float()) == 0
            if with_weights:
                assert bool((recv_w[pad] == 0).all())
        for i, (s, t) in enumerate(received):
            for k in range(K):
                assert meta[i, 2 + k] == row_of.get((s, t, k), -1)
        assert recv_idx is None
        again, _, again_w, h2, _ = buffer.dispatch(payload, handle=handle,
                                                   topk_weights=topk_w if with_weights else None)
        assert h2 is handle and torch.equal(bits_of(again[0] if fp8 else again), bits_of(recv_data))
        if with_weights:
            assert torch.equal(again_w, recv_w)
        combine_w = recv_w

    # Where this rank's (token, slot) pairs landed on their ranks.
    assert handle.dst_buffer_slot_idx.shape == (x.size(0), K)
    assert bool(((handle.dst_buffer_slot_idx >= 0) == (topk_idx >= 0)).all())

    # Combine in V2's order, against the reference for this rank's tokens.
    g = torch.Generator().manual_seed(seed + 7)
    bias = None
    if num_bias:
        bias = tuple(torch.randn(x.size(0), H, generator=g).to(torch.bfloat16) for _ in range(num_bias))
        bias = bias[0] if num_bias == 1 else bias
    combined, combined_w, _ = buffer.combine(y, handle, topk_weights=combine_w if with_weights else None,
                                             bias=bias)
    recipe = recipe_of(multi, use_hybrid, expand)
    for t in range(x.size(0)):
        terms = []
        for k in range(K):
            e = int(topk_idx[t][k])
            if e < 0:
                continue
            q = e // L
            if expand:
                terms.append((k, q, q // G, y_of(r * M + t, k, H)))
            elif all(int(topk_idx[t][j]) // L != q or int(topk_idx[t][j]) < 0 for j in range(k + 1, K)):
                # A rank's row (its slots' sum, as its experts returned it) at its last slot.
                acc = torch.zeros(H)
                for j in range(K):
                    if int(topk_idx[t][j]) >= 0 and int(topk_idx[t][j]) // L == q:
                        acc = acc + y_of(r * M + t, j, H).float()
                terms.append((k, q, q // G, acc.to(torch.bfloat16)))
        start = None
        if bias is not None:
            start = bias.float() if isinstance(bias, torch.Tensor) else bias[0].float() + bias[1].float()
            start = start[t]
        want = ref_combine(terms, recipe, start) if (terms or start is not None) else torch.zeros(H)
        assert torch.equal(combined[t], want.to(torch.bfloat16)), (t, recipe)
        if with_weights:
            assert torch.equal(combined_w[t], torch.where(topk_idx[t] >= 0, topk_w[t], torch.zeros(K)))
    return combined


@pytest.mark.parametrize("world", WORLDS, ids=WORLD_IDS)
@pytest.mark.parametrize("expand", [False, True], ids=["rank_major", "expanded"])
@pytest.mark.parametrize("multi", [True, False], ids=["multi", "single"])
def test_dispatch_combine(world, expand, multi):
    R = world[0]
    E = 2 * R
    run(case_elastic, world, E, min(3, E), 256, 5 + R, expand, 4 if expand else 1, None, True, multi,
        True, 2)


@pytest.mark.parametrize("world", [(2, 0), (4, 2)], ids=["R2", "R4_G2"])
@pytest.mark.parametrize("fp8", ["row", "col", "ue8m0"])
@pytest.mark.parametrize("expand", [False, True], ids=["rank_major", "expanded"])
def test_fp8(world, fp8, expand):
    run(case_elastic, world, 2 * world[0], 2, 512, 9, expand, 1, fp8, True, True, True, 1)


@pytest.mark.parametrize("world", [(3, 0), (4, 2)], ids=["R3", "R4_G2"])
@pytest.mark.parametrize("expand", [False, True], ids=["rank_major", "expanded"])
def test_worst_case_sizes_and_no_weights(world, expand):
    R = world[0]
    run(case_elastic, world, 2 * R, 2, 64, 3, expand, 2, None, False, True, False, 0, False)


@pytest.mark.parametrize("expand", [False, True], ids=["rank_major", "expanded"])
def test_k_equals_e_and_odd_hidden(expand):
    run(case_elastic, (2, 0), 4, 4, 100, 4, expand, 1, None, True, True, True, 1)


def case_same_problem(group, seed):
    """One global problem (12 tokens, all on every rank's view), rank r owning tokens r::R."""
    R, r = group.size(), group.rank()
    E, K, H = 8, 3, 64
    g = torch.Generator().manual_seed(seed)
    T = 12
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int64)
    idx[torch.rand(T, K, generator=g) < 0.2] = -1
    mine = list(range(r, T, R))
    buffer = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=T, allow_multiple_reduction=False)
    recv, _, _, handle, _ = buffer.dispatch(x[mine], topk_idx=idx[mine], num_experts=E, do_expand=True)
    y = torch.zeros_like(recv)
    meta = handle.recv_src_metadata
    for i in range(meta.size(0)):
        src, t = divmod(int(meta[i, 0]), T)
        token = t * R + src  # global token index of (source rank, local token)
        for k in range(K):
            if meta[i, 2 + k] >= 0:
                y[meta[i, 2 + k]] = y_of(token, k, H)
    combined, _, _ = buffer.combine(y, handle)
    return mine, combined


def test_single_reduction_same_bits_across_ep_sizes():
    outs = {}
    for world in [(1, 0), (2, 0), (4, 0), (4, 2)]:
        full = torch.zeros(12, 64, dtype=torch.bfloat16)
        for mine, combined in run(case_same_problem, world, 3):
            full[mine] = combined
        outs[world] = full
    first = outs[(1, 0)]
    for world, full in outs.items():
        assert torch.equal(full, first), world


def case_bad_input(group):
    R, r = group.size(), group.rank()
    xs, idxs, ws = make_inputs(R, 2 * R, 2, 64, 4, tokens=[4] * R)
    buffer = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=4)
    errors = []
    bad = idxs[r].clone()
    if r == R - 1:
        bad[1, 0] = 99
    for fn in (lambda: buffer.dispatch(xs[r], topk_idx=bad, topk_weights=ws[r], num_experts=2 * R),
               lambda: buffer.dispatch(xs[r], topk_idx=idxs[r], num_experts=2 * R,
                                       do_expand=(r == R - 1)),
               lambda: buffer.dispatch(torch.cat([xs[r], xs[r]]) if r == R - 1 else xs[r],
                                       topk_idx=torch.cat([idxs[r], idxs[r]]) if r == R - 1 else idxs[r],
                                       num_experts=2 * R)):
        try:
            fn()
            errors.append("no error")
        except ValueError as e:
            errors.append(str(e))
    # Still works afterwards.
    buffer.dispatch(xs[r], topk_idx=idxs[r], num_experts=2 * R)
    return errors


@pytest.mark.parametrize("world", [(1, 0), (3, 0)], ids=["R1", "R3"])
def test_bad_input_is_every_ranks_error(world):
    R = world[0]
    for errors in run(case_bad_input, world):
        assert f"rank {R - 1}: topk_idx[1][0] = 99 is outside [-1, {2 * R})" in errors[0], errors
        if R > 1:
            assert f"do_expand = 0 on rank 0 but 1 on rank {R - 1}" in errors[1], errors
        assert f"rank {R - 1}: x has 8 tokens, more than num_max_tokens_per_rank = 4" in errors[2], errors


def test_api_surface_is_v2s():
    import inspect
    params = lambda f: list(inspect.signature(f).parameters)  # noqa: E731
    assert params(deep_ep.ElasticBuffer.__init__)[:8] == [
        "self", "group", "num_bytes", "num_cpu_bytes", "num_max_tokens_per_rank", "hidden", "num_topk",
        "use_fp8_dispatch"]
    assert params(deep_ep.ElasticBuffer.dispatch)[:20] == [
        "self", "x", "topk_idx", "topk_weights", "cumulative_local_expert_recv_stats", "num_experts",
        "num_max_tokens_per_rank", "expert_alignment", "num_sms", "num_qps", "previous_event",
        "previous_event_before_epilogue", "async_with_compute_stream", "allocate_on_comm_stream",
        "handle", "do_handle_copy", "do_cpu_sync", "do_expand", "do_zero_padding",
        "use_tma_aligned_col_major_sf"]
    assert params(deep_ep.ElasticBuffer.combine)[:11] == [
        "self", "x", "handle", "topk_weights", "bias", "num_sms", "num_qps", "previous_event",
        "previous_event_before_epilogue", "async_with_compute_stream", "allocate_on_comm_stream"]
    hint = deep_ep.ElasticBuffer.get_pp_buffer_size_hint(1000, 4)
    assert hint % (2 << 20) == 0 and hint >= 1000 * 4 * 4
