"""Caller-owned output buffers (`out=`) in moed.deep_ep, and low-latency argument errors on
every rank.

- combine(..., out=) and dispatch(..., out=) (moed's extensions; dispatch's sized by
  num_worst_tokens or a handle) and low_latency_combine(..., out=) (DeepEP's): the result is
  written into the caller's tensor (strided rows too), bit for bit what the call returns
  without `out`; the columns around a strided `out` stay untouched. A bad `out` on one
  rank is a ValueError on every rank naming that rank and the value, and no rank's `out` is
  written.
- A bad argument to low_latency_dispatch / low_latency_combine on one rank: every rank raises
  the same ValueError naming the rank, the argument and the value (the call's own agreement
  carries it), and the buffer keeps working.
The case_* functions run on one rank; mpi_deep_ep.py runs them under mpirun -np 4 too."""
import pytest
import torch

import moed
import moed.deep_ep as deep_ep
from test_deep_ep import low_latency_inputs, make_inputs, run

WORLDS = [(1, 0), (3, 0), (4, 2), (5, 0)]
WORLD_IDS = ["R1", "R3", "R4_G2", "R5"]


def sentinel_out(T, H, dtype, pad=5):
    """A [T, H] view with row_stride H + pad of a buffer filled with NaN (checked afterwards)."""
    big = torch.full((T, H + pad), float("nan"), dtype=dtype)
    return big, big[:, :H]


def untouched(big, H):
    return bool(torch.isnan(big[:, H:].float()).all())


def case_normal_out(group, E, K, H, seed, dtype):
    R, r = group.size(), group.rank()
    xs, idxs, ws = make_inputs(R, E, K, H, seed, dtype=dtype)
    buffer = deep_ep.Buffer(group, int(1e9), 0)
    ntpr, _, ntpe, itir, _ = buffer.get_dispatch_layout(idxs[r], E)
    recv_x, _, recv_w, _, handle, _ = buffer.dispatch(
        xs[r], num_tokens_per_rank=ntpr, is_token_in_rank=itir, num_tokens_per_expert=ntpe,
        topk_idx=idxs[r], topk_weights=ws[r])
    y = (recv_x.float() * 1.5 - 0.25).to(dtype)
    T = xs[r].size(0)
    bias = torch.randn(T, H, generator=torch.Generator().manual_seed(seed + r)).to(dtype)
    want, want_w, _ = buffer.combine(y, handle, topk_weights=recv_w, bias=bias)
    big, out = sentinel_out(T, H, dtype)
    got, got_w, _ = buffer.combine(y, handle, topk_weights=recv_w, bias=bias, out=out)
    assert got is out
    assert torch.equal(out, want) and torch.equal(got_w, want_w) and untouched(big, H)

    # A bad `out` on the last rank: every rank raises, no rank's buffer is written.
    errors = []
    for bad in ("shape", "dtype"):
        big, out = sentinel_out(T, H, dtype)
        if r == R - 1:
            out = torch.empty(T + 1, H, dtype=dtype) if bad == "shape" else \
                torch.empty(T, H, dtype=torch.float32 if dtype == torch.bfloat16 else torch.bfloat16)
        try:
            buffer.combine(y, handle, topk_weights=recv_w, out=out)
        except ValueError as e:
            errors.append(str(e))
        if r != R - 1:
            assert bool(torch.isnan(big.float()).all()), "out written after a rejected combine"
    return errors


@pytest.mark.parametrize("world", WORLDS, ids=WORLD_IDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_combine_out(world, dtype):
    R = world[0]
    results = run(case_normal_out, world, 2 * R, 2, 100, 5, dtype)
    name = "bf16" if dtype == torch.bfloat16 else "f32"
    other = "f32" if dtype == torch.bfloat16 else "bf16"
    T_last = make_inputs(R, 2 * R, 2, 100, 5)[0][R - 1].size(0)
    for errors in results:
        assert len(errors) == 2, errors
        assert f"rank {R - 1}: out is [{T_last + 1}, 100]; expected [{T_last}, 100]" in errors[0]
        assert f"rank {R - 1}: out dtype is {other}; expected {name} (the dtype of x)" in errors[1]


def case_dispatch_out(group, E, K, H, seed, dtype):
    """dispatch(..., out=) with num_worst_tokens and in cached mode: recv_x is the caller's
    tensor, bitwise moed's own; a bad or unsized `out` raises on every rank."""
    R, r = group.size(), group.rank()
    xs, idxs, ws = make_inputs(R, E, K, H, seed, dtype=dtype)
    W = sum(x.size(0) for x in xs) + 1  # every token at most once per receiver
    buffer = deep_ep.Buffer(group, int(1e9), 0)
    ntpr, _, ntpe, itir, _ = buffer.get_dispatch_layout(idxs[r], E)
    layout = dict(num_tokens_per_rank=ntpr, is_token_in_rank=itir, num_tokens_per_expert=ntpe,
                  topk_idx=idxs[r], topk_weights=ws[r], num_worst_tokens=W)
    want, want_idx, want_w, _, handle, _ = buffer.dispatch(xs[r], **layout)
    want = want.clone()
    big, out = sentinel_out(W, H, dtype)
    got, got_idx, got_w, _, _, _ = buffer.dispatch(xs[r], **layout, out=out)
    assert got is out
    assert torch.equal(out, want) and untouched(big, H)
    assert torch.equal(got_idx, want_idx) and torch.equal(got_w, want_w)
    # Cached: the handle gives the rows.
    cached_want, _, _, _, _, _ = buffer.dispatch(xs[r], handle=handle)
    cached_want = cached_want.clone()
    big, out = sentinel_out(cached_want.size(0), H, dtype)
    got, _, _, _, _, _ = buffer.dispatch(xs[r], handle=handle, out=out)
    assert got is out and torch.equal(out, cached_want) and untouched(big, H)

    errors = []
    for bad in ("unsized", "shape"):
        big, out = sentinel_out(W, H, dtype)
        args = dict(layout)
        if bad == "unsized":
            args["num_worst_tokens"] = 0
        elif r == R - 1:
            out = torch.empty(W + 1, H, dtype=dtype)
        try:
            buffer.dispatch(xs[r], **args, out=out)
        except ValueError as e:
            errors.append(str(e))
        if bad == "unsized" or r != R - 1:
            assert bool(torch.isnan(big.float()).all()), "out written by a rejected dispatch"
    return errors, W


@pytest.mark.parametrize("world", WORLDS, ids=WORLD_IDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_dispatch_out(world, dtype):
    R = world[0]
    for errors, W in run(case_dispatch_out, world, 2 * R, 2, 100, 6, dtype):
        assert len(errors) == 2, errors
        assert "out needs num_worst_tokens > 0 or a cached handle" in errors[0]
        assert f"rank {R - 1}: out is [{W + 1}, 100]; expected [{W}, 100]" in errors[1]


def case_low_latency_out(group, M, H, E, K, seed, hook_mode):
    r = group.rank()
    tokens, xs, idxs, ws, buffer = low_latency_inputs(group, M, H, E, K, seed, empty_rank=True)
    recv_x, _, handle, _, hook = buffer.low_latency_dispatch(
        xs[r], idxs[r], M, E, use_fp8=False, return_recv_hook=hook_mode)
    hook() if hook_mode else None
    y = (recv_x.float() * (r + 1)).to(torch.bfloat16)
    want, _, h1 = buffer.low_latency_combine(y, idxs[r], ws[r], handle, return_recv_hook=hook_mode)
    h1() if hook_mode else None
    T = tokens[r]
    big, out = sentinel_out(T, H, torch.bfloat16)
    got, _, h2 = buffer.low_latency_combine(y, idxs[r], ws[r], handle, return_recv_hook=hook_mode,
                                            out=out)
    assert got is out
    h2() if hook_mode else None
    assert torch.equal(out, want) and untouched(big, H)
    return True


@pytest.mark.parametrize("world", WORLDS, ids=WORLD_IDS)
@pytest.mark.parametrize("hook_mode", [False, True], ids=["now", "hook"])
def test_low_latency_combine_out(world, hook_mode):
    R = world[0]
    assert all(run(case_low_latency_out, world, 4, 256, 2 * R, 2, 3, hook_mode))


def case_low_latency_errors(group, M, H, E, K, seed):
    """Each bad argument on the last rank only; returns what every rank raised."""
    R, r = group.size(), group.rank()
    L = E // R
    tokens, xs, idxs, ws, buffer = low_latency_inputs(group, M, H, E, K, seed)
    last = r == R - 1
    errors = []

    def attempt(fn):
        try:
            fn()
            errors.append("no error")
        except Exception as e:  # noqa: BLE001 - the type is what is checked
            errors.append(f"{type(e).__name__}: {e}")

    x_bad = xs[r].double() if last else xs[r]
    attempt(lambda: buffer.low_latency_dispatch(x_bad, idxs[r], M, E, use_fp8=False))
    attempt(lambda: buffer.low_latency_dispatch(xs[r], idxs[r].float() if last else idxs[r], M, E,
                                                use_fp8=False))
    attempt(lambda: buffer.low_latency_dispatch(xs[r], idxs[r], M, E, use_fp8=True,
                                                round_scale=not last, use_ue8m0=True))
    stats = torch.zeros(L + 1 if last else L, dtype=torch.int32)
    attempt(lambda: buffer.low_latency_dispatch(xs[r], idxs[r], M, E, use_fp8=False,
                                                cumulative_local_expert_recv_stats=stats))
    # The buffer still works; then the combine's bad arguments.
    recv_x, _, handle, _, _ = buffer.low_latency_dispatch(xs[r], idxs[r], M, E, use_fp8=False)
    y = recv_x.clone()
    attempt(lambda: buffer.low_latency_combine(y[..., :-1] if last else y, idxs[r], ws[r], handle))
    # Weights of another float dtype are converted, as by every top-k parser of moed's (DeepEP
    # itself takes float32 only): not an error, the same bits as float32 weights.
    same, _, _ = buffer.low_latency_combine(y, idxs[r], ws[r].double() if last else ws[r], handle)
    errors.append("same" if torch.equal(same, buffer.low_latency_combine(y, idxs[r], ws[r], handle)[0])
                  else "differs")
    out = torch.empty(tokens[r] + (1 if last else 0), H, dtype=torch.bfloat16)
    attempt(lambda: buffer.low_latency_combine(y, idxs[r], ws[r], handle, out=out))
    attempt(lambda: buffer.low_latency_combine(y, idxs[r], ws[r], handle, zero_copy=last))
    combined, _, _ = buffer.low_latency_combine(y, idxs[r], ws[r], handle)
    assert combined.shape == (tokens[r], H)
    return errors


@pytest.mark.parametrize("world", WORLDS, ids=WORLD_IDS)
def test_low_latency_errors_on_every_rank(world):
    R = world[0]
    M, H = 4, 256
    results = run(case_low_latency_errors, world, M, H, 2 * R, 2, 7)
    T_last = min(M, 1 + (3 * (R - 1) + 7) % M)
    want = [
        "x has dtype torch.float64",
        "topk_idx has dtype torch.float32",
        "use_ue8m0 = True needs use_fp8 = True and round_scale = True",
        "cumulative_local_expert_recv_stats has shape [3]; expected [2]",
        f"x has shape [2, {4 * R}, {H - 1}]; expected [2, {4 * R}, {H}]",
        "same",
        f"low_latency_combine: out is [{T_last + 1}, {H}]; expected [{T_last}, {H}]",
        "zero_copy = True but get_next_low_latency_combine_buffer(handle) was not called",
    ]
    for r, errors in enumerate(results):
        assert len(errors) == len(want), errors
        for got, w in zip(errors, want):
            if w == "same":
                assert got == w, (r, got)
                continue
            assert got.startswith(f"ValueError: rank {R - 1}: "), (r, got)
            assert w in got, (r, got, w)
