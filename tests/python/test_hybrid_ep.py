"""DeepEP's HybridEPBuffer (its hybrid-ep branch) on moed: dispatch_with_permute and
combine_with_unpermute against a reference built here from every rank's routing map, as
DeepEP's tests/utils.py TorchRef builds it (gather everything, keep the local experts' rows,
expert by expert, padded to pad_multiple), bit for bit; both calls as each other's backward;
and the calls a CPU rank does not serve. Megatron-Core's hybridep backend itself runs in
test_megatron_core.py."""
import pytest
import torch

import moed
import moed.deep_ep as deep_ep

from conftest import run

H, L = 40, 2  # hidden, local experts


def tokens_of(rank):
    return [7, 0, 5, 9][rank % 4]  # rank 1 has no tokens


def rank_problem(rank, R, K=2):
    """Rank `rank`'s tokens: x bf16 [T, H], routing_map [T, E], probs [T, E], topk_idx [T, K]."""
    E = L * R
    T = tokens_of(rank)
    g = torch.Generator().manual_seed(30 + rank)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    top = torch.randn(T, E, generator=g).topk(K, dim=1).indices
    rmap = torch.zeros(T, E, dtype=torch.bool).scatter_(1, top, True)
    probs = torch.rand(T, E, generator=g) * rmap
    return x, rmap, probs, top


def expert_scale(e):
    return 1.0 + e / 8.0  # expert e's output: its input times this (exact in bf16 for these)


def reference(rank, R, pad):
    """DeepEP's TorchRef for rank `rank`: its rows [N, H], probs [N], padded tokens per expert."""
    probs_all = [rank_problem(r, R) for r in range(R)]
    rows, probs, tpe = [], [], []
    for j in range(L):
        e = rank * L + j
        seg = [(x[t], p[t, e]) for x, rmap, p, _ in probs_all for t in range(x.size(0)) if rmap[t, e]]
        n = len(seg)
        padded = (n + pad - 1) // pad * pad if pad else n
        rows += [r for r, _ in seg] + [torch.zeros(H, dtype=torch.bfloat16)] * (padded - n)
        probs += [p for _, p in seg] + [torch.tensor(0.0)] * (padded - n)
        tpe.append(padded)
    x0 = torch.zeros(0, H, dtype=torch.bfloat16)
    return (torch.stack(rows) if rows else x0, torch.stack(probs) if probs else torch.zeros(0),
            torch.tensor(tpe))


def case_permute_and_back(g, pad, by_topk):
    r, R = g.rank(), g.size()
    E = L * R
    x, rmap, probs, top = rank_problem(r, R)
    buffer = deep_ep.HybridEPBuffer(g, hidden_dim=H, max_num_of_tokens_per_rank=8, num_local_experts=L)
    if by_topk:
        rows, row_probs, sf, tpe, handle = buffer.dispatch_with_permute(
            hidden=x, topk_idx=top, topk_weights=probs.gather(1, top), num_of_experts=E,
            pad_multiple=pad)
    else:
        rows, row_probs, sf, tpe, handle = buffer.dispatch_with_permute(
            hidden=x, routing_map=rmap, probs=probs, num_of_experts_per_rank=L, pad_multiple=pad)
    want_rows, want_probs, want_tpe = reference(r, R, pad)
    ok = dict(rows=torch.equal(rows, want_rows), probs=torch.equal(row_probs, want_probs),
              tpe=torch.equal(tpe, want_tpe), sf=sf is None, handle=len(handle) == 11)
    # The handle's places DeepEP's tests read: tokens received once each, their local experts.
    num_dispatched, local_map = handle[3], handle[4]
    ok["local_map"] = (int(num_dispatched) == local_map.size(0)
                       and int(local_map.sum()) == int(handle[7].sum()) and handle[8] == x.size(0))
    # Experts: segment j scaled by expert_scale(rank * L + j); combine sums each token's rows.
    scale = torch.repeat_interleave(torch.tensor([expert_scale(r * L + j) for j in range(L)]), tpe)
    y = (rows.float() * scale[:, None]).to(torch.bfloat16)
    out, none = buffer.combine_with_unpermute(hidden=y, handle=handle, pad_multiple=pad)
    acc = torch.zeros(x.size(0), H)  # moed's order: experts ascending, fp32 from 0, one rounding
    for e in range(E):
        part = (x.float() * expert_scale(e)).to(torch.bfloat16).float()
        acc = acc + torch.where(rmap[:, e:e + 1], part, torch.zeros_like(part))
    ok["combine"] = torch.equal(out, acc.to(torch.bfloat16)) and none is None
    # Backward of combine: the gradient goes back along the layout (rows as a dispatch of it).
    gy = (x.float() * 3).to(torch.bfloat16)
    grad_rows, no_probs, _, tpe2, _ = buffer.dispatch_with_permute(hidden=gy, handle=handle,
                                                                    num_permuted_tokens=tpe.sum())
    ok["combine_backward"] = (torch.equal(grad_rows, (want_rows.float() * 3).to(torch.bfloat16))
                              and no_probs is None and torch.equal(tpe2, tpe))
    # Backward of dispatch: rows summed home, row probs put back at their (token, expert).
    g_probs = row_probs * 2
    gx, gp = buffer.combine_with_unpermute(hidden=rows, probs=g_probs, handle=handle)
    ok["dispatch_backward"] = (torch.equal(gp, probs * 2)
                               and torch.equal(gx, (x.float() * rmap.sum(1, keepdim=True)).to(torch.bfloat16)))
    # A sync-free upper bound on the rows: the rows past the real ones are zero.
    n = int(tpe.sum()) + 3
    more, more_probs, _, _, h2 = buffer.dispatch_with_permute(
        hidden=x, routing_map=rmap, probs=probs, pad_multiple=pad, num_permuted_tokens=n,
        non_blocking=True)
    ok["upper_bound"] = (more.size(0) == n and torch.equal(more[:n - 3], rows)
                         and not more[n - 3:].any() and not more_probs[n - 3:].any())
    back, _ = buffer.combine_with_unpermute(hidden=more, handle=h2)
    ok["upper_bound_back"] = torch.equal(back, (x.float() * rmap.sum(1, keepdim=True)).to(torch.bfloat16))
    return ok


@pytest.mark.parametrize("by_topk", [False, True], ids=["routing_map", "topk_idx"])
@pytest.mark.parametrize("pad", [0, 4])
@pytest.mark.parametrize("world", [(2, 0), (4, 0), (4, 2)], ids=["R2", "R4", "R4_G2"])
def test_permute_dispatch_and_combine_match_deepeps_reference(world, pad, by_topk):
    for r, ok in enumerate(run(case_permute_and_back, world, pad, by_topk)):
        assert all(ok.values()), (r, ok)


def case_unserved(g):
    buffer = deep_ep.HybridEPBuffer(g, hidden_dim=H, max_num_of_tokens_per_rank=8, num_local_experts=L,
                                    num_sms_dispatch_api=24, load_cached_kernels=True)
    assert buffer.group is g and buffer.group_size == g.size() and buffer.rank == g.rank()
    assert buffer.num_of_hybrid_ep_ranks_per_nvlink_domain * buffer.num_of_nodes == g.size()
    x, rmap, probs, _ = rank_problem(g.rank(), g.size())
    errors = []
    for call in (lambda: buffer.dispatch(hidden=x, routing_map=rmap),
                 lambda: buffer.combine(x, None, None),
                 lambda: buffer.update_template_config(hidden_dim=H),
                 lambda: buffer.dispatch_with_permute(hidden=x, routing_map=rmap,
                                                      scaling_factor=torch.ones(x.size(0), 1)),
                 lambda: deep_ep.HybridEPBuffer(g, H, 8, L, use_fp8=True)):
        with pytest.raises(NotImplementedError) as e:
            call()
        errors.append(str(e.value))
    with pytest.raises(ValueError, match="num_of_experts_per_rank = 3"):
        buffer.dispatch_with_permute(hidden=x, routing_map=rmap, num_of_experts_per_rank=3)
    with pytest.raises(ValueError, match="handle is necessary"):
        buffer.combine_with_unpermute(hidden=x)
    buffer.empty_jit_cache()
    return errors


def test_unserved_calls_raise_naming_them():
    for errors in run(case_unserved, (2, 0)):
        for name, msg in zip(["HybridEPBuffer.dispatch", "HybridEPBuffer.combine",
                              "update_template_config", "scaling_factor", "use_fp8=True"], errors):
            assert name in msg, (name, msg)
