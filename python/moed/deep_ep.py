"""DeepEP's legacy Python API (``deep_ep.Buffer``) on CPU tensors, over moed's C++ runtime.

    import moed
    import moed.deep_ep as deep_ep

    def body(group, x, topk_idx, topk_weights, num_experts):
        buffer = deep_ep.Buffer(group, int(1e9))
        num_tokens_per_rank, _, num_tokens_per_expert, is_token_in_rank, _ = \\
            buffer.get_dispatch_layout(topk_idx, num_experts)
        recv_x, recv_topk_idx, recv_topk_weights, num_recv_per_expert, handle, _ = buffer.dispatch(
            x, topk_idx=topk_idx, topk_weights=topk_weights, num_tokens_per_rank=num_tokens_per_rank,
            is_token_in_rank=is_token_in_rank, num_tokens_per_expert=num_tokens_per_expert)
        y = experts(recv_x, recv_topk_idx, recv_topk_weights, num_recv_per_expert)
        combined_x, _, _ = buffer.combine(y, handle)
        return combined_x

    moed.launch(body, 4, ...)          # or group = moed.init() under mpirun, or a torch gloo
                                       # ProcessGroup in processes torch started

Names, parameters, defaults, return tuples and handle layouts are DeepEP's
(``deep_ep/buffers/legacy.py``), so DeepEP code runs with ``import moed.deep_ep as deep_ep``
and ``device='cpu'`` tensors. Differences, all documented on the methods:

* Normal mode receives rank-major (each token once per receiving rank, source rank
  ascending, then source token ascending) also across nodes, where moed's two-hop path (one
  network copy per destination node, forwarded inside the node) replaces DeepEP's internode
  kernels; the handle is always DeepEP's six-array intranode handle, and num_worst_tokens
  works across nodes too. Combine sums in a fixed order (bias_0 + bias_1, then the ranks
  ascending, fp32, rounded once), so results are bitwise deterministic.
* GPU-only knobs are accepted and ignored: num_sms / Config's SM and chunk fields,
  previous_event, async_finish, allocate_on_comm_stream (every call has finished when it
  returns), num_qps_per_rank, allow_nvlink_for_low_latency_mode, allow_mnnvl, enable_shrink,
  use_logfmt (combine stays bf16), dispatch_wait_recv_cost_stats / combine_wait_recv_cost_stats
  (GPU clock counters; left unchanged). Byte counts (num_nvl_bytes, num_rdma_bytes) are
  recorded only: moed allocates what each call needs, lazily.
* FP8 tensors are torch.float8_e4m3fn where torch has it, else torch.uint8 holding E4M3FN bits.
* Caller-owned outputs: low_latency_combine(out=) (DeepEP's), and combine(..., out=) and
  dispatch(..., out=) (keyword-only, moed's extensions; dispatch's with num_worst_tokens or a
  handle) write the result straight into the caller's tensor (rows may be strided).
* Argument errors are every rank's: a bad argument on one rank raises on every rank, naming
  that rank (normal mode: that rank its own TypeError / ValueError, the others ValueError;
  low-latency mode: ValueError on every rank, carried by the call's own agreement).
"""
import inspect
from typing import Callable, List, Optional, Tuple, Union

import torch

from . import _C
from ._world import Group, as_group, current_group

topk_idx_t = torch.int64
fp8_dtype = getattr(torch, "float8_e4m3fn", torch.uint8)

__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap", "topk_idx_t"]


class Config:
    """DeepEP's performance config. moed accepts and ignores its fields (CPU ranks have no SMs
    or chunked ring buffers); the size hints give DeepEP's numbers for code that sizes
    num_nvl_bytes / num_rdma_bytes from them (moed allocates lazily anyway)."""

    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256, num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256) -> None:
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = num_max_rdma_chunked_send_tokens
        self.num_max_rdma_chunked_recv_tokens = num_max_rdma_chunked_recv_tokens

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        channels = max(self.num_sms // 2, 1)
        return channels * num_ranks * self.num_max_nvl_chunked_recv_tokens * (hidden_bytes + 128)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        channels = max(self.num_sms // 2, 1)
        return 2 * channels * num_ranks * self.num_max_rdma_chunked_recv_tokens * (hidden_bytes + 128)

    def __repr__(self):
        return (f"Config(num_sms={self.num_sms}, nvl=({self.num_max_nvl_chunked_send_tokens}, "
                f"{self.num_max_nvl_chunked_recv_tokens}), rdma=({self.num_max_rdma_chunked_send_tokens}, "
                f"{self.num_max_rdma_chunked_recv_tokens}))")


class EventHandle:
    """DeepEP's CUDA event handle. On CPU every moed call has finished when it returns, so an
    event is always complete."""

    def current_stream_wait(self) -> None:
        pass


class EventOverlap:
    """DeepEP's EventOverlap: ``event.current_stream_wait()`` and ``with event:`` work and
    return at once (the work is already done)."""

    def __init__(self, event: Optional[EventHandle] = None, extra_tensors: Optional[Tuple] = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        if self.event is not None:
            self.event.current_stream_wait()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc_val, exc_tb) -> None:
        if self.event is not None:
            self.event.current_stream_wait()


class _NormalHandle(tuple):
    """DeepEP's intranode handle: (rank_prefix_matrix, channel_prefix_matrix,
    recv_channel_prefix_matrix, recv_src_idx, is_token_in_rank, send_head); a tuple that also
    carries moed's handle (what cached dispatch and combine use)."""

    def __new__(cls, arrays, impl):
        h = super().__new__(cls, arrays)
        h._moed = impl
        return h


class _LowLatencyHandle(tuple):
    """DeepEP's low-latency handle: (src_info, layout_range, num_max_dispatch_tokens_per_rank,
    hidden, num_experts), carrying moed's handle."""

    def __new__(cls, items, impl, num_local_experts, rows_per_expert):
        h = super().__new__(cls, items)
        h._moed = impl
        h._shape = (num_local_experts, rows_per_expert)
        return h


def _impl(handle, what):
    """moed's handle inside a DeepEP handle tuple. Normal mode passes anything else through,
    so the C++ side reports a wrong handle on every rank (not only this one)."""
    impl = getattr(handle, "_moed", None)
    if impl is None and "low_latency" not in what:
        return handle
    if impl is None:
        raise TypeError(f"{what}: handle must be the one returned by this Buffer's "
                        f"{'low_latency_dispatch' if 'low_latency' in what else 'dispatch'} "
                        f"(got {type(handle).__name__})")
    return impl


class Buffer:
    """DeepEP's communication buffer for MoE expert parallelism, on CPU ranks:
        - normal (high-throughput) dispatch and combine, inside a node (node-shared memory)
          and across nodes (one network copy per destination node, forwarded inside it);
        - low-latency dispatch and combine (fixed per-expert slots, FP8, receive hooks).

    Attributes:
        num_sms: DeepEP's SM count (accepted, ignored).
        rank: the rank in the group.
        group_size: the number of ranks.
        group: the moed.Group.
        num_nvl_bytes, num_rdma_bytes: recorded only (moed allocates lazily).
        runtime: the C++ runtime (moed._C.DeepEpBuffer).
    """

    num_sms: int = 20

    def __init__(self, group: Optional[Group], num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 explicitly_destroy: bool = False, enable_shrink: bool = False,
                 comm: Optional["mpi4py.MPI.Comm"] = None) -> None:  # noqa: F821
        """Initialize the communication buffer.

        Arguments:
            group: a moed.Group (from moed.launch, moed.init or moed.from_torch) or a
                torch.distributed ProcessGroup (its moed world is made by moed.from_torch on
                first use); None with ``comm`` given uses the calling rank's group (moed.init()
                under mpirun).
            num_nvl_bytes, num_rdma_bytes: DeepEP's buffer sizes; recorded, not allocated
                (pass DeepEP-sized values such as 1e9 freely).
            low_latency_mode: recorded; both modes are always available.
            num_qps_per_rank, allow_nvlink_for_low_latency_mode, allow_mnnvl, enable_shrink:
                GPU/RDMA settings, accepted and ignored.
            explicitly_destroy: if set, ``destroy()`` must be called to release the memory.
            comm: an mpi4py communicator, used only when group is None (its size must match).
        """
        if group is None:
            if comm is None:
                raise ValueError("Either 'group' or 'comm' must be provided.")
            group = current_group()
            if comm.Get_size() != group.size():
                raise ValueError(f"comm has {comm.Get_size()} ranks but moed's group has {group.size()}")
        # A torch.distributed ProcessGroup (gloo) stands for moed's world over it.
        group = as_group(group)
        for name, value in (("num_nvl_bytes", num_nvl_bytes), ("num_rdma_bytes", num_rdma_bytes)):
            if value < 0:
                raise ValueError(f"{name} = {value} must be >= 0")
        self.rank = group.rank()
        self.group = group
        self.group_size = group.size()
        self.num_nvl_bytes = int(num_nvl_bytes)
        self.num_rdma_bytes = int(num_rdma_bytes)
        self.low_latency_mode = low_latency_mode
        self.explicitly_destroy = explicitly_destroy
        self.enable_shrink = enable_shrink
        self.runtime = _C.DeepEpBuffer(group.handle)
        self._next_combine = {}  # (M, H, E) -> [two bf16 buffers, index of the next]

    def destroy(self):
        """Destroy the C++ runtime and release resources."""
        assert self.explicitly_destroy, '`explicitly_destroy` flag must be set'
        self.runtime.close()
        self.runtime = None

    def _rt(self):
        if self.runtime is None:
            raise RuntimeError("this Buffer was destroyed")
        return self.runtime

    @staticmethod
    def is_sm90_compiled():
        """Whether the FP8 paths exist: they do (True)."""
        return True

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Set DeepEP's SM count (kept for get_dispatch_config; ignored by moed)."""
        assert new_num_sms % 2 == 0, 'The SM count must be even'
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """An event on the "current stream": always complete on CPU."""
        return EventOverlap(EventHandle())

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """Bytes of node-shared memory one rank's low-latency buffer takes (both halves)."""
        return _C.get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks,
                                                 num_experts)

    def get_comm_stream(self):
        """No streams on CPU: None."""
        return None

    def get_local_buffer_tensor(self, dtype: torch.dtype, size: Optional[torch.Size] = None, offset: int = 0,
                                use_rdma_buffer: bool = False) -> torch.Tensor:
        raise NotImplementedError("moed.deep_ep: get_local_buffer_tensor is not available (moed "
                                  "allocates per call; there is no raw buffer to expose)")

    @staticmethod
    def _unpack_bias(bias: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]):
        bias_0, bias_1 = None, None
        if isinstance(bias, torch.Tensor):
            bias_0 = bias
        elif isinstance(bias, tuple):
            if len(bias) != 2:
                raise ValueError(f"bias must be a tensor or a tuple of 2 tensors, got {len(bias)}")
            bias_0, bias_1 = bias
        elif bias is not None:
            raise TypeError(f"bias must be a torch.Tensor or a tuple of two, got {type(bias).__name__}")
        return bias_0, bias_1

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """DeepEP's recommended dispatch config (its values; moed ignores them)."""
        return _recommended_config(num_ranks, 0)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """DeepEP's recommended combine config (its values; moed ignores them)."""
        return _recommended_config(num_ranks, 1)

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int,
                            previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                            allocate_on_comm_stream: bool = False) -> \
            Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor, EventOverlap]:
        """Calculate the layout required for later communication (local: no communication).

        Arguments:
            topk_idx: `[num_tokens, num_topk]`, `deep_ep.topk_idx_t` (torch.int64) or torch.int32,
                the expert indices selected by each token, `-1` means no selection.
            num_experts: the number of experts (a multiple of the number of ranks).
            previous_event, async_finish, allocate_on_comm_stream: ignored (CPU).

        Returns:
            num_tokens_per_rank: `[num_ranks]` torch.int, tokens to be sent to each rank.
            num_tokens_per_rdma_rank: `[num_nodes]` torch.int (tokens per node), None with one node.
            num_tokens_per_expert: `[num_experts]` torch.int.
            is_token_in_rank: `[num_tokens, num_ranks]` torch.bool.
            event: a complete EventOverlap.
        """
        a, b, c, d = self._rt().get_dispatch_layout(topk_idx, int(num_experts))
        return a, b, c, d, EventOverlap(EventHandle())

    def dispatch(self, x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]],
                 handle: Optional[Tuple] = None,
                 num_tokens_per_rank: Optional[torch.Tensor] = None, num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
                 is_token_in_rank: Optional[torch.Tensor] = None, num_tokens_per_expert: Optional[torch.Tensor] = None,
                 topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0,
                 config: Optional[Config] = None,
                 previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False, *,
                 out: Optional[torch.Tensor] = None) -> \
            Tuple[Union[Tuple[torch.Tensor, torch.Tensor], torch.Tensor], Optional[torch.Tensor],
                  Optional[torch.Tensor], List[int], Tuple, EventOverlap]:
        """Dispatch tokens to the ranks of their experts, inside a node and across nodes.

        Arguments:
            x: `[num_tokens, hidden]` torch.bfloat16 (or torch.float32), or a tuple (FP8 data
                `[num_tokens, hidden]` in moed.fp8_dtype, scales `[num_tokens, hidden // 128]`
                torch.float).
            handle: a handle from an earlier dispatch: cached mode (no count exchange; no top-k).
            num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert: from get_dispatch_layout
                (required without handle). num_tokens_per_rdma_rank: accepted (moed derives it).
            topk_idx, topk_weights: `[num_tokens, num_topk]` (optional, together).
            expert_alignment: num_recv_tokens_per_expert_list is rounded up to this.
            num_worst_tokens: > 0: recv_x has this many rows (the rows past the received ones
                are zero, their top-k -1 / 0) and the list is empty; works across nodes too.
            config, previous_event, async_finish, allocate_on_comm_stream: ignored (CPU).
            out (keyword-only, a moed extension): `[num_worst_tokens or the handle's rows,
                hidden]` of x's dtype (bf16 or float32; rows may be strided) to receive recv_x:
                each row is stored there once (threads world: by its sender, no copy). Needs
                num_worst_tokens > 0 or a handle; a bad shape, dtype or stride is a ValueError
                on every rank.

        Returns:
            recv_x: the received tokens (a tuple (data, scales) for FP8; `out` when given),
                rank-major: the rows of source rank 0 first, each source's tokens ascending.
            recv_topk_idx: `[num_recv_tokens, num_topk]` int64, local expert ids or -1.
            recv_topk_weights: `[num_recv_tokens, num_topk]` float, 0 where the id is -1.
            num_recv_tokens_per_expert_list: Python list `[num_local_experts]`.
            handle: DeepEP's intranode handle (rank_prefix_matrix, channel_prefix_matrix,
                recv_channel_prefix_matrix, recv_src_idx, is_token_in_rank, send_head).
            event: a complete EventOverlap.
        The returned tensors are views of moed's memory that no later dispatch writes while
        they are held, and they may outlive the buffer (every world).
        In cached mode the last four are None, as in DeepEP.
        """
        x, x_scales = x if isinstance(x, tuple) else (x, None)
        if handle is not None:
            if topk_idx is not None or topk_weights is not None:
                raise ValueError("cached dispatch (handle given) takes no topk_idx / topk_weights")
            recv_x, recv_x_scales = self._rt().dispatch(x, x_scales, None, None, None, None, None,
                                                        _impl(handle, "dispatch"), int(expert_alignment),
                                                        int(num_worst_tokens), out)
            recv_x = _fp8_out(recv_x, x)
            return (recv_x, recv_x_scales) if x_scales is not None else recv_x, None, None, None, None, \
                EventOverlap(EventHandle())
        if num_tokens_per_rank is None or is_token_in_rank is None or num_tokens_per_expert is None:
            raise ValueError("dispatch without handle needs num_tokens_per_rank, is_token_in_rank and "
                             "num_tokens_per_expert (from get_dispatch_layout)")
        (recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights, expert_list, impl, rank_prefix_matrix,
         channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx, is_token_in_rank_out,
         send_head) = self._rt().dispatch(x, x_scales, topk_idx, topk_weights, num_tokens_per_rank,
                                          is_token_in_rank, num_tokens_per_expert, None,
                                          int(expert_alignment), int(num_worst_tokens), out)
        recv_x = _fp8_out(recv_x, x)
        handle = _NormalHandle((rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix,
                                recv_src_idx, is_token_in_rank_out, send_head), impl)
        return (recv_x, recv_x_scales) if x_scales is not None else recv_x, recv_topk_idx, recv_topk_weights, \
            expert_list, handle, EventOverlap(EventHandle())

    def combine(self, x: torch.Tensor, handle: Tuple,
                topk_weights: Optional[torch.Tensor] = None,
                bias: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]] = None,
                config: Optional[Config] = None,
                previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False, *,
                out: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor], EventOverlap]:
        """Combine (reduce, **without** weights) tokens back to their home ranks.

        Arguments:
            x: `[num_recv_tokens, hidden]` torch.bfloat16 (or float32), rows as dispatch gave them.
            handle: the dispatch's handle.
            topk_weights: `[num_recv_tokens, num_topk]` float, reduced the same way.
            bias: 0, 1 or 2 `[num_tokens, hidden]` tensors added first.
            config, previous_event, async_finish, allocate_on_comm_stream: ignored (CPU).
            out (keyword-only, a moed extension): `[num_tokens, hidden]` of x's dtype (rows may
                be strided) to write recv_x into: each row is stored there once, no copy.
                A bad shape, dtype or stride is a ValueError on every rank.

        Returns:
            recv_x: `[num_tokens, hidden]` (`out` when given): fp32 bias_0 + bias_1, then + the
                row of each rank that received the token, ranks ascending; rounded once to x's dtype.
            recv_topk_weights: `[num_tokens, num_topk]` the same sum of the weights (or None).
            event: a complete EventOverlap.
        """
        bias_0, bias_1 = Buffer._unpack_bias(bias)
        combined_x, combined_topk_weights = self._rt().combine(x, _impl(handle, "combine"), topk_weights,
                                                               bias_0, bias_1, out)
        return combined_x, combined_topk_weights, EventOverlap(EventHandle())

    # DeepEP's internode entry points: the same calls here (the two-hop path is inside).
    def internode_dispatch(self, *args, **kwargs):
        """Internode dispatch: the same as dispatch (moed picks the path)."""
        return self.dispatch(*args, **kwargs)

    def internode_combine(self, *args, **kwargs):
        """Internode combine: the same as combine."""
        return self.combine(*args, **kwargs)

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Collective: drops the low-latency buffer of this shape; the next low-latency call
        makes a fresh one. Results of earlier low-latency calls of this shape become invalid."""
        self._next_combine.pop((num_max_dispatch_tokens_per_rank, hidden, num_experts), None)
        self._rt().clean_low_latency_buffer(num_max_dispatch_tokens_per_rank, hidden, num_experts)

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor,
                             num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                             dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None,
                             use_fp8: bool = True, round_scale: bool = False, use_ue8m0: bool = False,
                             async_finish: bool = False, return_recv_hook: bool = False) -> \
            Tuple[Tuple[torch.Tensor, torch.Tensor], torch.Tensor, Tuple, EventOverlap, Callable]:
        """Low-latency dispatch into fixed per-expert slots (no count exchange).
        As in DeepEP, the results reuse one of two halves of the buffer: hold at most two
        low-latency results at a time.

        Arguments:
            x: `[num_tokens, hidden]` torch.bfloat16, num_tokens <= num_max_dispatch_tokens_per_rank.
            topk_idx: `[num_tokens, num_topk]` int64 (or int32), -1 = none.
            num_max_dispatch_tokens_per_rank, num_experts: the same on every rank.
            cumulative_local_expert_recv_stats: `[num_local_experts]` torch.int; recv_count is
                added to it (after the receive, with a hook when the hook runs).
            dispatch_wait_recv_cost_stats: accepted, left unchanged (a GPU clock counter).
            use_fp8: cast to FP8 E4M3 per 128 channels; round_scale: power-of-two scales;
            use_ue8m0: scales packed as UE8M0 bytes, `[.., hidden // 512]` torch.int (needs
                round_scale).
            async_finish: ignored. return_recv_hook: return after the send phase; call the
                hook to receive (the tensors are valid after it).

        Returns:
            recv_x: `[num_local_experts, num_max_dispatch_tokens_per_rank * num_ranks, hidden]`
                bf16, or (fp8 data, scales `[.., hidden // 128]` float / `[.., hidden // 512]` int).
                Rows of each expert: source rank ascending, then token ascending (deterministic).
                The scales are row-major (DeepEP's are column-major for TMA; same values).
            recv_count: `[num_local_experts]` torch.int.
            handle: (src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden, num_experts);
                layout_range packs (begin << 32) | count as DeepEP does.
            event: a complete EventOverlap.
            hook: the receive hook (None without return_recv_hook, as in DeepEP).
        """
        # Argument errors found here travel with the call's agreement, so every rank raises
        # the same ValueError naming this rank (nobody is left waiting).
        error = None
        if use_ue8m0 and not (use_fp8 and round_scale):
            error = "use_ue8m0 = True needs use_fp8 = True and round_scale = True"
        elif cumulative_local_expert_recv_stats is not None:
            if not isinstance(cumulative_local_expert_recv_stats, torch.Tensor) or \
                    cumulative_local_expert_recv_stats.dtype != torch.int32 or \
                    cumulative_local_expert_recv_stats.numel() != num_experts // self.group_size:
                error = ("cumulative_local_expert_recv_stats must be a torch.int tensor of "
                         f"[num_local_experts = {num_experts // self.group_size}]")
        rt = self._rt()
        (recv_x, scales, count_raw, src_raw, ranges_raw, hook, impl, L, RM) = rt.low_latency_dispatch(
            x, topk_idx, int(num_max_dispatch_tokens_per_rank), int(num_experts), bool(use_fp8),
            bool(round_scale), bool(return_recv_hook), error)
        H = x.size(1)
        recv_x = _fp8_out(recv_x, None if not use_fp8 else "fp8").view(L, RM, H)
        recv_count = count_raw.view(torch.int32).view(L)
        src_info = src_raw.view(torch.int32).view(L, RM)
        layout_range = torch.empty((L, self.group_size), dtype=torch.int64)
        packed_scales = None
        if use_fp8 and use_ue8m0:
            packed_scales = torch.zeros((L * RM, H // 512), dtype=torch.int32)

        def finish():
            pairs = ranges_raw.view(torch.int32).view(L, self.group_size, 2).to(torch.int64)
            layout_range.copy_((pairs[..., 0] << 32) | pairs[..., 1])
            if packed_scales is not None:
                _C.deep_ep_pack_ue8m0(scales, packed_scales, recv_count, RM)
            if cumulative_local_expert_recv_stats is not None:
                cumulative_local_expert_recv_stats.add_(recv_count.view_as(cumulative_local_expert_recv_stats))

        out_hook = _after_receive(hook, finish)
        if use_fp8:
            recv_scales = packed_scales.view(L, RM, H // 512) if use_ue8m0 else scales.view(L, RM, H // 128)
            out = (recv_x, recv_scales)
        else:
            out = recv_x
        handle = _LowLatencyHandle((src_info, layout_range, num_max_dispatch_tokens_per_rank, H, num_experts),
                                   impl, L, RM)
        return out, recv_count, handle, EventOverlap(EventHandle()), out_hook

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: tuple, use_logfmt: bool = False, zero_copy: bool = False,
                            async_finish: bool = False, return_recv_hook: bool = False,
                            out: Optional[torch.Tensor] = None,
                            combine_wait_recv_cost_stats: Optional[torch.Tensor] = None) -> \
            Tuple[torch.Tensor, EventOverlap, Callable]:
        """Low-latency combine (reduce **with** weights): for each token, fp32 from 0 over its
        experts in ascending id, w * y, rounded once to bf16.

        Arguments:
            x: `[num_local_experts, num_max_dispatch_tokens_per_rank * num_ranks, hidden]` bf16.
            topk_idx, topk_weights: the dispatch's `[num_tokens, num_topk]` routing.
            handle: the low-latency dispatch's handle.
            use_logfmt: ignored (moed combines in bf16).
            zero_copy: the expert outputs were written into
                get_next_low_latency_combine_buffer(handle); that buffer is read (x is not).
            async_finish, combine_wait_recv_cost_stats: ignored (CPU).
            return_recv_hook: return after the send phase; call the hook to receive.
            out: `[num_tokens, hidden]` bf16 (rows may be strided) that the receive writes the
                result into directly (with a hook: when the hook runs); returned as combined_x.

        Returns:
            combined_x: `[num_tokens, hidden]` bf16; event; hook (None without return_recv_hook).
        """
        impl = _impl(handle, "low_latency_combine")
        key = (handle[2], handle[3], handle[4])
        L, RM = handle._shape
        # Argument errors found here travel with the call's agreement (see low_latency_dispatch).
        error = None
        if zero_copy:
            state = self._next_combine.get(key)
            if state is None or state[2] is None:
                error = ("zero_copy = True but get_next_low_latency_combine_buffer(handle) was not "
                         "called before this combine")
            else:
                x = state[2]
                state[1] ^= 1
                state[2] = None
        if error is None and (not isinstance(x, torch.Tensor) or x.dim() != 3 or
                              tuple(x.shape) != (L, RM, handle[3])):
            shape = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            error = f"x has shape {shape}; expected [{L}, {RM}, {handle[3]}]"
        if error is None:
            x = x.view(L * RM, handle[3])
        # out: written in place by the receive (with a hook, when the hook runs).
        combined_x, hook = self._rt().low_latency_combine(x, topk_idx, topk_weights, impl,
                                                          bool(return_recv_hook), out, error)
        return combined_x, EventOverlap(EventHandle()), hook

    def get_next_low_latency_combine_buffer(self, handle: object):
        """A bf16 `[num_local_experts, num_ranks * num_max_dispatch_tokens_per_rank, hidden]`
        tensor for the experts to write into; the next low_latency_combine(zero_copy=True)
        reads it. moed's combine writes every row once from wherever it is, so this buffer is
        moed-owned memory that saves the caller an intermediate tensor, as in DeepEP."""
        _impl(handle, "get_next_low_latency_combine_buffer")
        key = (handle[2], handle[3], handle[4])
        L, RM = handle._shape
        state = self._next_combine.get(key)
        if state is None:
            state = [[torch.empty((L, RM, handle[3]), dtype=torch.bfloat16) for _ in range(2)], 0, None]
            self._next_combine[key] = state
        state[2] = state[0][state[1]]
        return state[2]

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False):
        raise NotImplementedError("moed.deep_ep: rank masking (enable_shrink) is not available yet")

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor):
        raise NotImplementedError("moed.deep_ep: rank masking (enable_shrink) is not available yet")

    def low_latency_clean_mask_buffer(self):
        raise NotImplementedError("moed.deep_ep: rank masking (enable_shrink) is not available yet")


# DeepEP's recommended (dispatch, combine) configs per rank count: Config's arguments after
# num_sms (NVL chunked send, NVL chunked recv, RDMA chunked send, RDMA chunked recv tokens).
_RECOMMENDED_CONFIGS = {
    2: ((24, 256, 6, 128), (10, 256, 6, 128)), 4: ((6, 256, 6, 128), (9, 256, 6, 128)),
    8: ((6, 256, 6, 128), (4, 256, 6, 128)), 16: ((36, 288, 20, 128), (4, 288, 12, 128)),
    24: ((32, 288, 8, 128), (1, 288, 8, 128)), 32: ((32, 288, 8, 128), (1, 288, 8, 128)),
    48: ((32, 288, 8, 128), (1, 288, 8, 128)), 64: ((32, 288, 8, 128), (1, 288, 8, 128)),
    96: ((20, 480, 12, 128), (1, 480, 8, 128)), 128: ((20, 560, 12, 128), (1, 560, 8, 128)),
    144: ((32, 720, 12, 128), (2, 720, 8, 128)), 160: ((28, 720, 12, 128), (2, 720, 8, 128)),
}


def _recommended_config(num_ranks, which):
    # DeepEP asserts on other rank counts; moed runs any, so fall back to its default.
    values = _RECOMMENDED_CONFIGS.get(num_ranks)
    return Config(Buffer.num_sms, *values[which]) if values else Config(Buffer.num_sms)


def _after_receive(hook, finish):
    """What the low-latency calls do once the data is in: `finish` now (no hook), or a hook that
    receives and then finishes (return_recv_hook)."""
    if hook is None:
        finish()
        return None

    def out_hook():
        hook()
        finish()
    return out_hook


def _fp8_out(t, like):
    """moed returns fp8 as uint8 bits; give it torch's float8_e4m3fn dtype where torch has one."""
    if t.dtype == torch.uint8 and fp8_dtype is not torch.uint8 and like is not None:
        if like == "fp8" or (isinstance(like, torch.Tensor) and like.dtype == fp8_dtype):
            return t.view(fp8_dtype)
    return t
