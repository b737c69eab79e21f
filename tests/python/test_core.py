"""Interop (tensor arguments in, moed memory out), moed.launch, moed.dist, settings."""
import pytest
import torch

import moed
from moed import _C

from conftest import WORLDS, WORLD_IDS, run


def test_rows_view_reads_in_place():
    x = torch.randn(5, 7)
    ptr, dtype, rows, cols, stride = _C._rows_view(x, "x")
    assert (ptr, dtype, rows, cols, stride) == (x.data_ptr(), "f32", 5, 7, 7)
    # Row-strided views are read in place too.
    big = torch.randn(5, 16)
    v = big[:, 3:10]
    ptr, _, rows, cols, stride = _C._rows_view(v, "v")
    assert (ptr, rows, cols, stride) == (v.data_ptr(), 5, 7, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_returned_memory_round_trips(dtype):
    x = torch.randn(33, 130).to(dtype)
    y = _C._copy_rows(x)
    assert y.dtype == dtype and torch.equal(x, y)
    assert y.data_ptr() != x.data_ptr()
    del x
    y += 1  # moed's memory, writable and alive while torch holds it
    assert y.shape == (33, 130)


def test_empty_and_fp8():
    assert _C._copy_rows(torch.empty(0, 4)).shape == (0, 4)
    q = torch.randint(0, 255, (3, 128), dtype=torch.uint8)
    if moed.fp8_dtype != torch.uint8:
        q = q.view(moed.fp8_dtype)
    y = _C._copy_rows(q)
    assert y.dtype == moed.fp8_dtype and torch.equal(y.view(torch.uint8), q.view(torch.uint8))


def test_bf16_rounding_matches_torch():
    x = torch.randn(64, 100) * 1e3
    assert torch.equal(_C._to_bf16(x), x.bfloat16())


@pytest.mark.parametrize("bad, exc, words", [
    (torch.randn(4, 4).double(), TypeError, ["x", "torch.float64"]),
    (torch.randn(4, 4).int(), TypeError, ["x", "torch.int32"]),
    ([1, 2, 3], TypeError, ["x", "list"]),
    (torch.randn(4), ValueError, ["x", "[4]"]),
    (torch.randn(2, 4, 4), ValueError, ["x", "[2, 4, 4]"]),
    (torch.randn(4, 4).t(), ValueError, ["x", "(1, 4)"]),
    (torch.randn(4, 8)[:, ::2], ValueError, ["x", "strides"]),
])
def test_bad_tensor_arguments(bad, exc, words):
    with pytest.raises(exc) as e:
        _C._rows_view(bad, "x")
    for w in words:
        assert w in str(e.value)


def test_wrong_device():
    meta = torch.empty(4, 4, device="meta")
    with pytest.raises(TypeError, match="x must be a CPU tensor, got device meta"):
        _C._rows_view(meta, "x")


@pytest.mark.parametrize("world", WORLDS, ids=WORLD_IDS)
def test_launch_ranks_and_dist(world):
    def body(g):
        r, R = g.rank(), g.size()
        assert moed.dist.get_rank() == r and moed.dist.get_world_size() == R
        t = torch.full((5,), float(r + 1))
        moed.dist.all_reduce(t)
        i = torch.tensor([r, 2 * r], dtype=torch.int64)
        moed.dist.all_reduce(i)
        parts = [torch.empty(3) for _ in range(R)]
        moed.dist.all_gather(parts, torch.arange(3.0) + 10 * r)
        flat = torch.empty(R * 2, dtype=torch.bfloat16)
        moed.dist.all_gather_into_tensor(flat, torch.tensor([r, -r], dtype=torch.bfloat16))
        b = torch.tensor([r + 100.0, 7.0]) if r == R - 1 else torch.zeros(2)
        moed.dist.broadcast(b, src=R - 1)
        moed.dist.barrier()
        return r, t, i, torch.stack(parts), flat, b
    R = world[0]
    out = run(body, world)
    assert [o[0] for o in out] == list(range(R))
    for _, t, i, parts, flat, b in out:
        assert torch.equal(t, torch.full((5,), float(R * (R + 1) // 2)))
        assert i.tolist() == [R * (R - 1) // 2, R * (R - 1)]
        assert torch.equal(parts, torch.stack([torch.arange(3.0) + 10 * r for r in range(R)]))
        assert flat.tolist() == [v for r in range(R) for v in (r, -r)]
        assert b.tolist() == [R - 1 + 100.0, 7.0]


def test_all_reduce_is_rank_ordered():
    # 1e8 + 1 - 1e8 in fp32 depends on the order: rank order 0, 1, 2 gives 0 + ... exactly.
    vals = [1e8, 1.0, -1e8]

    def body(g):
        t = torch.tensor([vals[g.rank()]], dtype=torch.float32)
        moed.dist.all_reduce(t)
        return t.item()
    expect = torch.tensor(0.0)
    for v in vals:
        expect = expect + torch.tensor(v, dtype=torch.float32)
    assert run(body, (3, 0)) == [expect.item()] * 3


@pytest.mark.parametrize("world", [(2, 0), (4, 0), (4, 2)], ids=["R2", "R4", "R4_G2"])
def test_rank_that_raises_aborts_every_rank(world):
    seen = []

    def body(g):
        if g.rank() == 1:
            raise KeyError("no such expert")
        try:
            g.barrier()
            g.barrier()
        except moed.AbortedError as e:
            seen.append(str(e))
            raise
    with pytest.raises(KeyError) as e:
        run(body, world)
    assert "rank 1: " in str(e.value) and isinstance(e.value.__cause__, KeyError)
    assert len(seen) == world[0] - 1 and all("rank 1" in s for s in seen)


def test_mismatched_shapes_across_ranks_raise_everywhere():
    def body(g):
        parts = torch.empty(g.size() * (2 + g.rank()))
        try:
            moed.dist.all_gather_into_tensor(parts, torch.ones(2 + g.rank()))
        except ValueError as e:
            return str(e)
    msgs = run(body, (3, 0))
    assert all(m and "rank" in m for m in msgs)
    def body2(g):
        t = torch.ones(3 + g.rank())
        with pytest.raises(ValueError, match="elements"):
            moed.dist.all_reduce(t)
    run(body2, (2, 0))


def test_launch_bad_arguments():
    with pytest.raises(ValueError):
        moed.launch(lambda g: None, 0)
    with pytest.raises(ValueError):
        moed.launch(lambda g: None, 4, ranks_per_node=3)
    with pytest.raises(ValueError):
        moed.launch(lambda g: None, 2, timeout=0)


def test_group_outside_launch():
    with pytest.raises(RuntimeError, match="no group"):
        moed.dist.get_rank()
    groups = moed.launch(lambda g: g, 2)
    with pytest.raises(RuntimeError, match="ended"):
        groups[0].rank()


def test_settings():
    moed.set_num_threads(3)
    assert moed.get_num_threads() == 3
    assert moed.launch(lambda g: g.handle.num_threads(), 3) == [1, 1, 1]
    moed.set_num_threads(None)
    assert moed.get_num_threads() == torch.get_num_threads()
    with pytest.raises(ValueError):
        moed.set_num_threads(0)
    old = moed.tensor_cache_stats()["limit_bytes"]
    moed.set_tensor_cache_limit(1 << 20)
    # 0 in the sanitizer builds, which keep the cache off (moed/tensor.h: a freed block stays
    # visible to AddressSanitizer).
    assert moed.tensor_cache_stats()["limit_bytes"] in (1 << 20, 0 if old == 0 else -1)
    moed.set_tensor_cache_limit(old)


def test_dist_explicit_group_strided_and_async():
    def body(g):
        base = torch.zeros(4, 6)
        view = base[:, 1:3]  # not contiguous: reduced through a copy, written back in place
        view.fill_(g.rank() + 1.0)
        work = moed.dist.all_reduce(view, group=g, async_op=True)
        assert work.wait() and work.is_completed()
        b = torch.zeros(3, 2).t()
        if g.rank() == 0:
            b.copy_(torch.arange(6.0).view(2, 3))
        moed.dist.broadcast(b, src=0, group=g)
        moed.dist.destroy_process_group()  # a launch group: no-op
        return base, b
    for base, b in run(body, (3, 0)):
        assert torch.equal(base[:, 1:3], torch.full((4, 2), 6.0)) and base[:, 0].abs().sum() == 0
        assert torch.equal(b, torch.arange(6.0).view(2, 3))


def test_dist_bad_arguments_every_rank():
    def body(g):
        errs = []
        for call in (lambda: moed.dist.broadcast(torch.zeros(2), src=g.size()),
                     lambda: moed.dist.all_gather([torch.zeros(2)], torch.zeros(2)),
                     lambda: moed.dist.all_reduce([1.0])):
            try:
                call()
            except ValueError as e:
                errs.append(str(e))
        return errs
    for errs in run(body, (2, 0)):
        assert len(errs) == 3
        assert "src = 2" in errs[0] and "tensor_list has 1" in errs[1] and "torch.Tensor" in errs[2]
