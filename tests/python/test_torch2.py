"""What depends on the torch moed runs on (the suite runs on torch 2.x in .venv and again on
Debian's 1.13: tests/python/CMakeLists.txt): FP8 as torch.float8_e4m3fn where torch has it, with
uint8 bits still accepted, and its rounding the same as torch's; DeepEP V2's int32 index
tensors from torch 2.0 on; bf16 and fp8 through the Megatron and DeepEP paths. The gloo world
over subgroups (new_group, device_mesh) and torch.compile'd callers are in test_gloo.py."""
import pytest
import torch

import moed
import moed.deep_ep as deep_ep
from moed import _C

import test_deep_ep as cases
from conftest import WORLDS, WORLD_IDS, run

TORCH2 = int(torch.__version__.split(".")[0]) >= 2
HAS_FP8 = hasattr(torch, "float8_e4m3fn")


def test_fp8_dtype_follows_torch():
    assert moed.fp8_dtype is (torch.float8_e4m3fn if HAS_FP8 else torch.uint8)
    assert deep_ep.fp8_dtype is moed.fp8_dtype
    assert TORCH2 or not HAS_FP8  # 1.13 has no float8


@pytest.mark.skipif(not HAS_FP8, reason="this torch has no float8_e4m3fn")
def test_fp8_rounding_is_torchs():
    """Every bf16 value in [-448, 448] (E4M3FN's range) and float32 values between them:
    moed's rounding to E4M3FN (nearest even) gives torch's bits."""
    every = torch.arange(1 << 16, dtype=torch.int32)
    bf16 = torch.where(every >= 1 << 15, every - (1 << 16), every).to(torch.int16).view(torch.bfloat16)
    v = bf16.float()
    g = torch.Generator().manual_seed(5)
    v = torch.cat([v, (torch.rand(1 << 16, generator=g) * 2 - 1) * 448,
                   (torch.rand(1 << 12, generator=g) * 2 - 1) * 2.0 ** -6])  # subnormals
    v = v[torch.isfinite(v) & (v.abs() <= 448)]
    v = v[: v.numel() // 128 * 128].view(-1, 128)
    assert torch.equal(_C._to_fp8(v), v.to(torch.float8_e4m3fn).view(torch.uint8))


def case_uint8_beside_fp8(group, seed):
    """The same E4M3FN bits dispatched once as moed.fp8_dtype and once as uint8: the same bits
    back, in moed.fp8_dtype both times (normal mode, and a cached dispatch)."""
    R, r = group.size(), group.rank()
    E, K, H = 2 * R, 2, 256
    xs, idxs, ws = cases.make_inputs(R, E, K, H, seed, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed + r)
    bits = torch.randint(0, 0x7e, (xs[r].size(0), H), generator=g, dtype=torch.uint8)
    scales = torch.rand(xs[r].size(0), H // 128, generator=g)
    buffer = deep_ep.Buffer(group, int(1e9))
    ntpr, _, ntpe, itir, _ = buffer.get_dispatch_layout(idxs[r], E)
    got = []
    for data in (bits, bits.view(moed.fp8_dtype)):
        (recv, recv_scales), _, _, _, handle, _ = buffer.dispatch(
            (data, scales), num_tokens_per_rank=ntpr, is_token_in_rank=itir,
            num_tokens_per_expert=ntpe, topk_idx=idxs[r], topk_weights=ws[r])
        (again, _), *_ = buffer.dispatch((data, scales), handle=handle)
        assert recv.dtype == moed.fp8_dtype and again.dtype == moed.fp8_dtype
        got.append((recv.view(torch.uint8).clone(), again.view(torch.uint8).clone(), recv_scales))
    assert all(torch.equal(a, b) for a, b in zip(*got))
    return True


@pytest.mark.parametrize("world", WORLDS, ids=WORLD_IDS)
def test_uint8_bits_stay_accepted(world):
    assert all(run(case_uint8_beside_fp8, world, 31))


@pytest.mark.parametrize("world", [(2, 0), (4, 2)], ids=["R2", "R4_G2"])
def test_low_latency_fp8_and_bf16(world):
    """Low-latency dispatch: FP8 out in moed.fp8_dtype, bf16 in and out (checked inside against
    the reference bit for bit)."""
    for use_fp8 in (True, False):
        assert all(run(cases.case_low_latency, world, 6, 512, 8, 3, 9, use_fp8, use_fp8, False, False))


def case_v2_index_dtype(group):
    R, r = group.size(), group.rank()
    E, K, H = 2 * R, 2, 128
    xs, idxs, ws = cases.make_inputs(R, E, K, H, 3)
    buffer = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=max(x.size(0) for x in xs),
                                   hidden=H, num_topk=K)
    recv_x, _, _, handle, _ = buffer.dispatch(xs[r], topk_idx=idxs[r], topk_weights=ws[r],
                                              num_experts=E)
    meta = handle.recv_src_metadata
    # DeepEP's int32 where torch indexes with it (2.0 on); int64, the same values, before.
    assert meta.dtype == (torch.int32 if TORCH2 else torch.int64), meta.dtype
    src = meta[:, 0]
    assert torch.equal(torch.arange(1000)[src.clamp(min=0)], src.clamp(min=0).long())
    return True


def test_v2_index_dtype_follows_torch():
    assert all(run(case_v2_index_dtype, (2, 0)))


def _init_dist_worker(local_rank, port, out):
    """DeepEP's set-up (deep_ep.utils.envs.init_dist) with FutureWarnings as errors: moed's own
    probe of torch's gloo says nothing, and the stacked all_gather_into_tensor DeepEP's tests
    call gives every rank's row."""
    import os
    import warnings
    warnings.simplefilter("error", FutureWarning)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="1", RANK="0")
    from moed.deep_ep.utils.envs import init_dist
    rank, size, group = init_dist(local_rank, 2)
    got = torch.empty(size, 3, dtype=torch.int32)
    with warnings.catch_warnings():  # the caller's own stacked call may warn, as on a GPU
        warnings.simplefilter("ignore", FutureWarning)
        torch.distributed.all_gather_into_tensor(got, torch.full((3,), rank, dtype=torch.int32),
                                                 group=group)
    torch.save({"rank": rank, "size": size, "got": got}, f"{out}/{local_rank}.pt")


def test_deep_ep_init_dist(tmp_path):
    from test_gloo import free_port
    torch.multiprocessing.spawn(_init_dist_worker, args=(free_port(), str(tmp_path)), nprocs=2)
    for r in range(2):
        rec = torch.load(tmp_path / f"{r}.pt")
        assert rec["rank"] == r and rec["size"] == 2
        assert torch.equal(rec["got"], torch.tensor([[0] * 3, [1] * 3], dtype=torch.int32))
