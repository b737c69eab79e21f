"""The DeepEP API as its clients use it: a Megatron-shaped client written here (the calls,
attributes and arguments of Megatron-Core's fused_a2a.py / _DeepepManager, and of its dev
branch's DeepEP V2 path), and the pieces vLLM's and SGLang's DeepEP managers rely on, through
`import deep_ep` after moed.deep_ep.install(). The MoE layer's forward and backward are checked
against a float64 torch computation of the same layer.

Run on the threads world here; gloo_workers.py runs the Megatron-shaped client with a torch
ProcessGroup (the object Megatron compares buffer.group with)."""
import gc
import threading
import weakref

import pytest
import torch

import moed
import moed.deep_ep

moed.deep_ep.install()
import deep_ep  # noqa: E402  (moed's, after the opt-in)
from deep_ep.utils import EventHandle, EventOverlap  # noqa: E402  (Megatron's import)

E, K, H, T = 8, 2, 64, 24

# ---- a Megatron-shaped client (the calls of fused_a2a.py, as Megatron makes them) ----

# Megatron keeps its buffers in module globals, one per process; rank threads share a module,
# so here they are per rank thread (the same thing for one rank).
_cache = threading.local()


def get_buffer(group, hidden_bytes):
    _buffer = getattr(_cache, "buffer", None)
    num_nvl_bytes, num_rdma_bytes = 0, 0
    for config in (deep_ep.Buffer.get_dispatch_config(group.size()),
                   deep_ep.Buffer.get_combine_config(group.size())):
        num_nvl_bytes = max(config.get_nvl_buffer_size_hint(hidden_bytes, group.size()), num_nvl_bytes)
        num_rdma_bytes = max(config.get_rdma_buffer_size_hint(hidden_bytes, group.size()), num_rdma_bytes)
    if (_buffer is None or _buffer.group != group or _buffer.num_nvl_bytes < num_nvl_bytes
            or _buffer.num_rdma_bytes < num_rdma_bytes):
        _buffer = _cache.buffer = deep_ep.Buffer(group, num_nvl_bytes, num_rdma_bytes)
    return _buffer


class FusedDispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, token_indices, token_probs, num_experts, group, async_finish=False,
                allocate_on_comm_stream=False):
        previous_event = EventOverlap(EventHandle()) if async_finish else None
        buffer = get_buffer(group, x.size(1) * max(x.element_size(), 2))
        ntpr, ntprdma, ntpe, itir, event = buffer.get_dispatch_layout(
            token_indices, num_experts, previous_event=previous_event, async_finish=async_finish,
            allocate_on_comm_stream=allocate_on_comm_stream)
        recv_x, recv_idx, recv_probs, per_expert, handle, after = buffer.dispatch(
            x, topk_idx=token_indices, topk_weights=token_probs, num_tokens_per_rank=ntpr,
            num_tokens_per_rdma_rank=ntprdma, is_token_in_rank=itir, num_tokens_per_expert=ntpe,
            previous_event=event, async_finish=async_finish, allocate_on_comm_stream=allocate_on_comm_stream)
        if async_finish:
            after.current_stream_wait()
        ctx.group, ctx.handle = group, handle
        return recv_x, recv_idx, recv_probs, torch.tensor(per_expert), handle

    @staticmethod
    def backward(ctx, grad_output, grad_indices, grad_probs, grad_tokens_per_expert, grad_handle):
        buffer = get_buffer(ctx.group, grad_output.size(1) * max(grad_output.element_size(), 2))
        grad_x, grad_probs, after = buffer.combine(grad_output.contiguous(), ctx.handle,
                                                   topk_weights=grad_probs.float(),
                                                   previous_event=None, async_finish=False,
                                                   allocate_on_comm_stream=False)
        return grad_x, None, grad_probs, None, None, None, None


class FusedCombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, handle):
        buffer = get_buffer(group, x.size(1) * max(x.element_size(), 2))
        combined, _, after = buffer.combine(x, handle=handle, async_finish=False, previous_event=None,
                                            allocate_on_comm_stream=False)
        ctx.group, ctx.handle = group, handle
        return combined, None

    @staticmethod
    def backward(ctx, grad_output, previous_event=None):
        buffer = get_buffer(ctx.group, grad_output.size(1) * max(grad_output.element_size(), 2))
        grad_x, _, _, _, _, after = buffer.dispatch(grad_output.contiguous(), handle=ctx.handle,
                                                    previous_event=None, async_finish=False,
                                                    allocate_on_comm_stream=False)
        return grad_x, None, None


def get_elastic_buffer(group, num_max_tokens_per_rank, hidden, num_topk):
    _elastic_buffer = getattr(_cache, "elastic", None)
    num_bytes = deep_ep.ElasticBuffer.get_buffer_size_hint(
        group, num_max_tokens_per_rank=num_max_tokens_per_rank, hidden=hidden, num_topk=num_topk)
    if (_elastic_buffer is None or _elastic_buffer.group != group or _elastic_buffer.num_bytes < num_bytes
            or _elastic_buffer.num_max_tokens_per_rank < num_max_tokens_per_rank):
        _elastic_buffer = _cache.elastic = deep_ep.ElasticBuffer(group, num_bytes=num_bytes,
                                                num_max_tokens_per_rank=num_max_tokens_per_rank,
                                                hidden=hidden, num_topk=num_topk)
    return _elastic_buffer


class V2Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, buffer, x, token_indices, token_probs, num_experts, num_max_tokens_per_rank):
        previous_event = buffer.capture()
        recv_x, recv_idx, recv_probs, handle, event = buffer.dispatch(
            x, topk_idx=token_indices, topk_weights=token_probs, num_experts=num_experts,
            num_max_tokens_per_rank=num_max_tokens_per_rank, expert_alignment=1, num_sms=0,
            previous_event=previous_event, async_with_compute_stream=True, allocate_on_comm_stream=True)
        event.current_stream_wait()
        ctx.buffer, ctx.handle, ctx.num_sms = buffer, handle, handle.num_sms
        return recv_x, recv_idx, recv_probs, torch.tensor(handle.num_recv_tokens_per_expert_list), handle

    @staticmethod
    def backward(ctx, grad_output, grad_indices, grad_probs, grad_tokens_per_expert, grad_handle):
        grad_x, grad_probs, event = ctx.buffer.combine(
            grad_output.contiguous(), handle=ctx.handle, topk_weights=grad_probs.float(),
            num_sms=ctx.num_sms, previous_event=None, async_with_compute_stream=False,
            allocate_on_comm_stream=False)
        return None, grad_x, None, grad_probs, None, None


class V2Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, buffer, x, handle, num_sms):
        combined, combined_probs, event = buffer.combine(x, handle=handle, num_sms=num_sms,
                                                         previous_event=None,
                                                         async_with_compute_stream=False,
                                                         allocate_on_comm_stream=False)
        ctx.buffer, ctx.handle, ctx.num_sms = buffer, handle, handle.num_sms if num_sms == 0 else num_sms
        return combined, combined_probs

    @staticmethod
    def backward(ctx, grad_output, grad_combined_probs):
        grad_x, _, _, _, event = ctx.buffer.dispatch(grad_output.contiguous(), handle=ctx.handle,
                                                     num_sms=ctx.num_sms, previous_event=None,
                                                     async_with_compute_stream=False,
                                                     allocate_on_comm_stream=False)
        return None, grad_x, None, None


# ---- the layer, and its float64 reference ----

def problem(R):
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(T, H, generator=g, dtype=torch.float64) for _ in range(R)]
    logits = [torch.randn(T, E, generator=g, dtype=torch.float64) for _ in range(R)]
    W = torch.randn(E, H, H, generator=g, dtype=torch.float64) * 0.1
    gy = [torch.randn(T, H, generator=g, dtype=torch.float64) for _ in range(R)]
    return xs, logits, W, gy


def reference(x, logits, W, gy):
    x = x.clone().requires_grad_()
    lg = logits.clone().requires_grad_()
    top = torch.softmax(lg, -1).topk(K, dim=-1)
    out = torch.zeros_like(x)
    for t in range(x.size(0)):
        for k in range(K):
            out[t] = out[t] + (x[t] @ W[int(top.indices[t, k])]) * top.values[t, k]
    (out * gy).sum().backward()
    return out.detach(), x.grad, lg.grad


def layer(group, v2, xs, logits, W, gy):
    """One MoE layer step the way Megatron's Flex path runs it; returns the worst relative
    difference from the float64 reference over out, x.grad and logits.grad."""
    r, R = group.rank(), group.size()
    L = E // R
    x = xs[r].float().requires_grad_()
    lg = logits[r].float().requires_grad_()
    top = torch.softmax(lg, -1).topk(K, dim=-1)
    if v2:
        buffer = get_elastic_buffer(group, x.size(0), H, K)
        recv_x, recv_idx, recv_probs, tpe, handle = V2Dispatch.apply(buffer, x, top.indices, top.values,
                                                                      E, x.size(0))
    else:
        recv_x, recv_idx, recv_probs, tpe, handle = FusedDispatch.apply(x, top.indices, top.values, E, group)
    # The experts, token by token over the rank-major rows (each row's local experts).
    y = torch.zeros_like(recv_x)
    for i in range(recv_x.size(0)):
        for k in range(K):
            j = int(recv_idx[i, k])
            if j >= 0:
                y[i] = y[i] + (recv_x[i] @ W[r * L + j].float()) * recv_probs[i, k]
    out, _ = V2Combine.apply(buffer, y, handle, 0) if v2 else FusedCombine.apply(y, group, handle)
    (out * gy[r].float()).sum().backward()
    ref = reference(xs[r], logits[r], W, gy[r])
    scale = max(t.abs().max().item() for t in ref)
    return max((a.double() - b).abs().max().item() / scale for a, b in zip((out, x.grad, lg.grad), ref))


def case_megatron(group, v2, steps=3):
    _cache.buffer = _cache.elastic = None
    xs, logits, W, gy = problem(group.size())
    worst, made = 0.0, set()
    for _ in range(steps):
        worst = max(worst, layer(group, v2, xs, logits, W, gy))
        made.add(id(_cache.elastic if v2 else _cache.buffer))
    # Megatron keeps one buffer while buffer.group == group (the group stays the object passed).
    return worst, len(made), (_cache.elastic if v2 else _cache.buffer).group is group


@pytest.mark.parametrize("world", [(2, 0), (4, 0), (4, 2)], ids=["R2", "R4", "R4_G2"])
@pytest.mark.parametrize("v2", [False, True], ids=["fused_a2a", "deepepv2"])
def test_megatron_flex_path_matches_float64(world, v2):
    for worst, buffers, kept in moed.launch(case_megatron, world[0], v2, ranks_per_node=world[1],
                                             timeout=120.0, threads_per_rank=1):
        assert worst < 1e-5 and buffers == 1 and kept, (worst, buffers, kept)


# ---- what vLLM's and SGLang's DeepEP managers rely on ----

def case_serving_clients(group):
    R = group.size()
    # vLLM keeps buffers in a WeakValueDictionary keyed by the constructor's kwargs.
    kwargs = dict(group=group, num_nvl_bytes=1 << 20, num_rdma_bytes=0, low_latency_mode=False,
                  num_qps_per_rank=1, explicitly_destroy=True)
    cache = weakref.WeakValueDictionary()
    buffer = cache.setdefault(tuple(sorted(kwargs.items(), key=lambda kv: kv[0])), deep_ep.Buffer(**kwargs))
    assert buffer.group_size == R and buffer.low_latency_mode is False and deep_ep.Buffer.num_sms >= 2
    deep_ep.Buffer.set_num_sms(20)
    config = deep_ep.Config(num_sms=20, num_max_nvl_chunked_send_tokens=6, num_max_nvl_chunked_recv_tokens=256,
                            num_max_rdma_chunked_send_tokens=6, num_max_rdma_chunked_recv_tokens=256)
    # SGLang pads an empty batch to one dummy token with zero weights.
    idx = torch.arange(K, dtype=torch.int64).view(1, K)
    w = torch.zeros(1, K)
    x = torch.randn(1, H).to(torch.bfloat16)
    previous = deep_ep.Buffer.capture()
    ntpr, ntprdma, ntpe, itir, event = buffer.get_dispatch_layout(topk_idx=idx, num_experts=E,
                                                                  previous_event=previous,
                                                                  async_finish=False,
                                                                  allocate_on_comm_stream=False)
    recv_x, recv_idx, recv_w, per_expert, handle, event = buffer.dispatch(
        x=x, handle=None, num_tokens_per_rank=ntpr, num_tokens_per_rdma_rank=ntprdma,
        is_token_in_rank=itir, num_tokens_per_expert=ntpe, topk_idx=idx, topk_weights=w,
        expert_alignment=1, config=config, previous_event=previous, async_finish=True,
        allocate_on_comm_stream=False)
    if event.event is not None:  # vLLM's and SGLang's check
        event.current_stream_wait()
    combined, _, event = buffer.combine(x=recv_x, handle=handle, topk_weights=None, config=config,
                                        previous_event=None, async_finish=False, allocate_on_comm_stream=False)
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank=8, hidden=H,
                                                         num_ranks=R, num_experts=E)
    ll = deep_ep.Buffer(group=group, num_nvl_bytes=0, num_rdma_bytes=hint, low_latency_mode=True,
                        num_qps_per_rank=E // R, allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False,
                        explicitly_destroy=True, enable_shrink=False)
    out = torch.empty(1, H, dtype=torch.bfloat16)
    recv, count, ll_handle, _, hook = ll.low_latency_dispatch(x, idx, 8, E, use_fp8=False, async_finish=False,
                                                              return_recv_hook=True)
    hook()
    _, _, hook = ll.low_latency_combine(recv, idx, w, ll_handle, async_finish=False, zero_copy=False,
                                        return_recv_hook=True, out=out)
    hook()
    ll.clean_low_latency_buffer(8, H, E)
    # The V2 path of vLLM and SGLang.
    v2 = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=4, hidden=H, num_topk=K, use_fp8_dispatch=False,
                               allow_hybrid_mode=True, prefer_overlap_with_compute=False,
                               allow_multiple_reduction=True, num_cpu_timeout_secs=60,
                               num_gpu_timeout_secs=60, explicitly_destroy=True, sl_idx=0)
    num_sms = v2.get_theoretical_num_sms(num_experts=E, num_topk=K)
    num_qps = v2.get_theoretical_num_qps(num_sms)
    recv_x, recv_idx, recv_w, h, event = v2.dispatch(x=x, topk_idx=idx, topk_weights=w, num_experts=E,
                                                      num_max_tokens_per_rank=4, expert_alignment=1,
                                                      num_sms=num_sms, num_qps=num_qps,
                                                      use_tma_aligned_col_major_sf=False, do_cpu_sync=None,
                                                      do_expand=False)
    n = h.psum_num_recv_tokens_per_scaleup_rank[-1].item()
    assert list(h.num_recv_tokens_per_expert_list) and h.psum_num_recv_tokens_per_expert.numel() == E // R
    if event.event is not None:
        event.current_stream_wait()
    assert n == recv_x.size(0)
    combined_v2, _, event = v2.combine(recv_x, handle=h, topk_weights=None, num_sms=num_sms, num_qps=num_qps)
    for b in (buffer, ll, v2):
        b.destroy()
    del buffer
    gc.collect()
    # The dummy token went to rank 0 only (its experts 0 and 1), once: it comes back as it was.
    return torch.equal(combined, x), torch.equal(combined_v2, x)


def test_serving_clients_calls():
    for ok in moed.launch(case_serving_clients, 2, timeout=120.0, threads_per_rank=1):
        assert all(ok)


def test_opt_in_is_needed_and_never_shadows():
    import importlib
    import subprocess
    import sys
    # Without the opt-in, nothing named deep_ep appears.
    code = "import moed, moed.deep_ep\ntry:\n import deep_ep\n print('found')\nexcept ImportError:\n print('absent')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "absent"
    # The opt-in's package is moed's, HybridEPBuffer (Megatron's hybridep backend) included.
    assert deep_ep.__moed__ and deep_ep.Buffer is moed.deep_ep.Buffer
    from deep_ep import HybridEPBuffer
    assert HybridEPBuffer is moed.deep_ep.HybridEPBuffer
    assert importlib.import_module("deep_ep.utils.math").align(5, 4) == 8
