"""DeepEP's legacy Python API (``deep_ep.buffers.legacy.Buffer``) on CPU tensors, over moed's C++
runtime (moed._C.DeepEpBuffer): each method passes one argument object to C++ and unpacks one
result object into DeepEP's return tuple; every check of the values happens in C++, on every
rank.

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
  kernels; the handle has DeepEP's layout (intranode: six arrays, with num_sms / 2 channels of
  the Buffer's num_sms; across nodes: ten, where the arrays of DeepEP's kernels that moed's
  two hops have no counterpart of are None), and num_worst_tokens works across nodes too. Combine sums in a fixed order (bias_0 + bias_1, then the ranks
  ascending, fp32, rounded once), so results are bitwise deterministic.
* GPU-only knobs are accepted and ignored: Config's SM and chunk fields (a dispatch's
  channels are Buffer.num_sms / 2 when the Buffer was made, not its config's),
  previous_event, async_finish, allocate_on_comm_stream (every call has finished when it
  returns), num_qps_per_rank, allow_nvlink_for_low_latency_mode, allow_mnnvl,
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
* enable_shrink is DeepEP's shrink mode (the low-latency calls go on without a rank that
  stops answering; the mask methods), with the wait before a rank is masked its own setting
  (shrink_timeout). In shrink mode a bad argument is an error on its rank and on every rank
  that receives from it.
* ``group`` is the object the caller passed (a torch ProcessGroup stays one, so client code
  that compares ``buffer.group == group`` keeps its buffer), and a handle is valid for any
  Buffer over the same group.
"""
from typing import Callable, List, Optional, Tuple, Union

import os
import torch

from .. import _C
from .._world import as_group, current_group
from . import _profile
from .event import EventHandle, EventOverlap, completed

topk_idx_t = torch.int64
fp8_dtype = getattr(torch, "float8_e4m3fn", torch.uint8)


class Config:
    """DeepEP's performance config. moed accepts and ignores its fields (CPU ranks have no SMs
    or chunked ring buffers); the size hints are DeepEP's numbers (its csrc/legacy/config.hpp,
    8 NVLink peers per node: the RDMA hint is 0 up to 8 ranks) for code that sizes
    num_nvl_bytes / num_rdma_bytes from them (moed allocates lazily anyway)."""

    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256, num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256) -> None:
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = num_max_rdma_chunked_send_tokens
        # DeepEP's constructor rounds the RDMA receive tokens up to a multiple of the send ones.
        self.num_max_rdma_chunked_recv_tokens = -(-num_max_rdma_chunked_recv_tokens //
                                                  num_max_rdma_chunked_send_tokens) * num_max_rdma_chunked_send_tokens

    # DeepEP's assumptions behind the hints: NVLink peers per node, top-k and scale columns, and
    # the bytes of its SourceMeta and int4.
    _NVL_PEERS, _MAX_TOPK, _MAX_SCALES, _SOURCE_META, _INT4 = 8, 128, 128, 8, 16

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        rdma_ranks = max(num_ranks // self._NVL_PEERS, 1)
        nvl_ranks = min(num_ranks, self._NVL_PEERS)
        per_token = (hidden_bytes + self._SOURCE_META + self._MAX_TOPK * 8 + self._MAX_TOPK * 4 +
                     self._MAX_SCALES * 4)
        cells = (self.num_sms // 2) * nvl_ranks
        n = cells * (2 * rdma_ranks + 3) * 4 + cells * self.num_max_nvl_chunked_recv_tokens * per_token
        return (n + 127) // 128 * 128

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        if num_ranks <= self._NVL_PEERS:
            return 0
        cells = (self.num_sms // 2) * (num_ranks // self._NVL_PEERS)
        per_token = (hidden_bytes + self._SOURCE_META + self._MAX_TOPK * 8 + self._MAX_TOPK * 4 +
                     self._MAX_SCALES * 4 + self._INT4)
        n = cells * (self._NVL_PEERS * 2 + 2) * 2 * 4 + cells * self.num_max_rdma_chunked_recv_tokens * per_token * 2
        return (n + 127) // 128 * 128

    def __repr__(self):
        return (f"Config(num_sms={self.num_sms}, nvl=({self.num_max_nvl_chunked_send_tokens}, "
                f"{self.num_max_nvl_chunked_recv_tokens}), rdma=({self.num_max_rdma_chunked_send_tokens}, "
                f"{self.num_max_rdma_chunked_recv_tokens}))")


class _NormalHandle(tuple):
    """DeepEP's normal-mode handle (intranode or internode layout: Buffer.dispatch says which);
    a tuple that also carries moed's handle (what cached dispatch and combine use)."""

    def __new__(cls, arrays, impl):
        h = super().__new__(cls, arrays)
        h._moed = impl
        return h


class _LowLatencyHandle(tuple):
    """DeepEP's low-latency handle: (src_info, layout_range, num_max_dispatch_tokens_per_rank,
    hidden, num_experts), carrying moed's handle."""

    def __new__(cls, items, impl):
        h = super().__new__(cls, items)
        h._moed = impl
        return h


def _impl(handle):
    """moed's handle inside a DeepEP handle tuple; anything else goes to C++ as it is, which
    reports it (every rank's error where the call can agree on one)."""
    return getattr(handle, "_moed", handle)


class Buffer:
    """DeepEP's communication buffer for MoE expert parallelism, on CPU ranks:
        - normal (high-throughput) dispatch and combine, inside a node (node-shared memory)
          and across nodes (one network copy per destination node, forwarded inside it);
        - low-latency dispatch and combine (fixed per-expert slots, FP8, receive hooks).

    Attributes:
        num_sms: DeepEP's SM count: normal-mode handles have num_sms / 2 channels, as with
            DeepEP's default config (the value when the Buffer was made).
        rank: the rank in the group.
        group_size: the number of ranks.
        group: the group as the caller passed it (a moed.Group, a torch ProcessGroup or an
            mpi4py communicator).
        num_nvl_bytes, num_rdma_bytes: recorded only (moed allocates lazily).
        low_latency_mode, explicitly_destroy, enable_shrink, shrink_timeout: as given.
        runtime: the C++ runtime (moed._C.DeepEpBuffer).
    """

    num_sms: int = 20

    def __init__(self, group, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 explicitly_destroy: bool = False, enable_shrink: bool = False,
                 comm: Optional["mpi4py.MPI.Comm"] = None,  # noqa: F821
                 *, shrink_timeout: Optional[float] = None) -> None:
        """Initialize the communication buffer.

        Arguments:
            group: a moed.Group (from moed.launch, moed.init or moed.from_torch) or a
                torch.distributed ProcessGroup (its moed world is made by moed.from_torch on
                first use); None with ``comm`` given uses the calling rank's group (moed.init()
                under mpirun).
            num_nvl_bytes, num_rdma_bytes: DeepEP's buffer sizes; recorded, not allocated
                (pass DeepEP-sized values such as 1e9 freely), except num_rdma_bytes with
                enable_shrink: the low-latency buffer's node-shared memory, allocated here
                (get_low_latency_rdma_size_hint).
            low_latency_mode: recorded; both modes are always available.
            num_qps_per_rank, allow_nvlink_for_low_latency_mode, allow_mnnvl: GPU/RDMA
                settings, accepted and ignored.
            explicitly_destroy: if set, ``destroy()`` must be called to release the memory.
            enable_shrink: DeepEP's shrink mode for the low-latency calls: a rank that does not
                take part in a low-latency dispatch, combine or clean within ``shrink_timeout``
                (or that is seen to fail) is masked on every live rank, and the call completes
                for the others (no rows to or from it; combine sums only the experts of
                unmasked ranks). See low_latency_query_mask_buffer.
            comm: an mpi4py communicator, used only when group is None (its size must match).
            shrink_timeout: moed's extension: seconds a rank waits for a peer in shrink mode
                before masking it (default: $MOED_SHRINK_TIMEOUT, else 10; DeepEP's is a
                compile-time constant).
        """
        if group is None:
            if comm is None:
                raise ValueError("Either 'group' or 'comm' must be provided.")
            moed_group = current_group()
            if comm.Get_size() != moed_group.size():
                raise ValueError(f"comm has {comm.Get_size()} ranks but moed's group has {moed_group.size()}")
        else:
            moed_group = as_group(group)
        for name, value in (("num_nvl_bytes", num_nvl_bytes), ("num_rdma_bytes", num_rdma_bytes)):
            if value < 0:
                raise ValueError(f"{name} = {value} must be >= 0")
        self.rank = moed_group.rank()
        self._num_nodes = moed_group.num_nodes()
        self.group = group if group is not None else comm
        self.group_size = moed_group.size()
        self.num_nvl_bytes = int(num_nvl_bytes)
        self.num_rdma_bytes = int(num_rdma_bytes)
        self.low_latency_mode = low_latency_mode
        self.explicitly_destroy = explicitly_destroy
        self.enable_shrink = enable_shrink
        if shrink_timeout is None:
            shrink_timeout = float(os.environ.get("MOED_SHRINK_TIMEOUT", "10"))
        self.shrink_timeout = float(shrink_timeout)
        # Shrink mode allocates num_rdma_bytes now (the low-latency buffer is made on it later
        # without a collective, so a rank lost before the first call does not stop it).
        self.runtime = _C.DeepEpBuffer(moed_group.handle, enable_shrink=bool(enable_shrink),
                                       shrink_timeout=self.shrink_timeout,
                                       num_rdma_bytes=self.num_rdma_bytes,
                                       num_channels=max(self.num_sms // 2, 1))

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
        return completed()

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
        with _profile.phase("get_dispatch_layout"):
            a, b, c, d = self._rt().get_dispatch_layout(topk_idx, int(num_experts))
        return a, b, c, d, completed()

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
            handle: DeepEP's handle. In one node its intranode handle (rank_prefix_matrix
                `[R, R]`, channel_prefix_matrix `[R, C]`, recv_channel_prefix_matrix `[R, C]`,
                recv_src_idx, is_token_in_rank, send_head), C = num_sms / 2; across nodes its
                internode handle (is_token_in_rank, rdma_channel_prefix_matrix,
                gbl_channel_prefix_matrix `[R, C]`, recv_rdma_channel_prefix_matrix,
                recv_rdma_rank_prefix_sum, recv_gbl_channel_prefix_matrix `[R, C]`,
                recv_gbl_rank_prefix_sum `[R]` (inclusive: the rows received from ranks 0..i),
                recv_src_meta, send_rdma_head, send_nvl_head), None for the RDMA-stage and
                kernel-bookkeeping arrays, which moed's two hops keep in their own plan.
            event: a complete EventOverlap.
        The returned tensors are views of moed's memory that no later dispatch writes while
        they are held, and they may outlive the buffer (every world).
        In cached mode the last four are None, as in DeepEP.
        """
        x, x_scales = x if isinstance(x, tuple) else (x, None)
        args = _C.NormalDispatchArgs(
            x=x, x_scales=x_scales, topk_idx=topk_idx, topk_weights=topk_weights,
            num_tokens_per_rank=num_tokens_per_rank, is_token_in_rank=is_token_in_rank,
            num_tokens_per_expert=num_tokens_per_expert,
            handle=None if handle is None else _impl(handle), expert_alignment=int(expert_alignment),
            num_worst_tokens=int(num_worst_tokens), out=out)
        with _profile.phase("dispatch"):
            r = self._rt().dispatch(args)
        recv_x = (r.recv_x, r.recv_x_scales) if x_scales is not None else r.recv_x
        if handle is not None:
            return recv_x, None, None, None, None, completed()
        return recv_x, r.recv_topk_idx, r.recv_topk_weights, r.num_recv_tokens_per_expert_list, \
            _NormalHandle(self._handle_layout(r.handle_arrays), r.handle), completed()

    def _handle_layout(self, arrays):
        """DeepEP's handle tuple for this Buffer's world from moed's six intranode arrays."""
        if self._num_nodes == 1:
            return arrays
        rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, _, is_token_in_rank, _ = arrays
        recv_gbl_rank_prefix_sum = rank_prefix_matrix[:, self.rank].contiguous()
        return (is_token_in_rank, None, channel_prefix_matrix, None, None, recv_channel_prefix_matrix,
                recv_gbl_rank_prefix_sum, None, None, None)

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
        args = _C.NormalCombineArgs(x=x, handle=_impl(handle), topk_weights=topk_weights, bias_0=bias_0,
                                    bias_1=bias_1, out=out)
        with _profile.phase("combine"):
            r = self._rt().combine(args)
        return r.combined_x, r.combined_topk_weights, completed()

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
        self._rt().clean_low_latency_buffer(num_max_dispatch_tokens_per_rank, hidden, num_experts)

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor,
                             num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                             dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None,
                             use_fp8: bool = True, round_scale: bool = False, use_ue8m0: bool = False,
                             async_finish: bool = False, return_recv_hook: bool = False) -> \
            Tuple[Tuple[torch.Tensor, torch.Tensor], torch.Tensor, Tuple, EventOverlap, Callable]:
        """Low-latency dispatch into fixed per-expert slots (no count exchange).
        As in DeepEP, the returned tensors are the caller's: no later call writes into them and
        they stay valid after the Buffer is destroyed (moed receives into memory it reuses only
        once nothing holds it any more).

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
        args = _C.LowLatencyDispatchArgs(
            x=x, topk_idx=topk_idx, num_max_dispatch_tokens_per_rank=int(num_max_dispatch_tokens_per_rank),
            num_experts=int(num_experts), cumulative_local_expert_recv_stats=cumulative_local_expert_recv_stats,
            use_fp8=bool(use_fp8), round_scale=bool(round_scale), use_ue8m0=bool(use_ue8m0),
            return_recv_hook=bool(return_recv_hook))
        with _profile.phase("dispatch"):
            r = self._rt().low_latency_dispatch(args)
        handle = _LowLatencyHandle((r.src_info, r.layout_range, num_max_dispatch_tokens_per_rank, x.size(1),
                                    num_experts), r.handle)
        recv_x = (r.recv_x, r.recv_x_scales) if use_fp8 else r.recv_x
        return recv_x, r.recv_count, handle, completed(), _profile.hook("dispatch", r.hook)

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: tuple, use_logfmt: bool = False, zero_copy: bool = False,
                            async_finish: bool = False, return_recv_hook: bool = False,
                            out: Optional[torch.Tensor] = None,
                            combine_wait_recv_cost_stats: Optional[torch.Tensor] = None,
                            *, order: Optional[torch.Tensor] = None) -> \
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
            order: moed's extension, `[num_tokens, num_topk]`: each token's experts are summed
                in ascending order of this key instead of the expert id; with redundant experts
                (moed.ExpertReplicas) the logical ids, so the result does not depend on the
                replica that served a slot.

        Returns:
            combined_x: `[num_tokens, hidden]` bf16; event; hook (None without return_recv_hook).
        """
        args = _C.LowLatencyCombineArgs(x=x, topk_idx=topk_idx, topk_weights=topk_weights, handle=_impl(handle),
                                        zero_copy=bool(zero_copy), return_recv_hook=bool(return_recv_hook),
                                        out=out, order=order)
        with _profile.phase("combine"):
            r = self._rt().low_latency_combine(args)
        return r.combined_x, completed(), _profile.hook("combine", r.hook)

    def get_next_low_latency_combine_buffer(self, handle: object):
        """A bf16 `[num_local_experts, num_ranks * num_max_dispatch_tokens_per_rank, hidden]`
        tensor for the experts to write into; the next low_latency_combine(zero_copy=True)
        reads it. moed's combine writes every row once from wherever it is, so this buffer is
        moed-owned memory that saves the caller an intermediate tensor, as in DeepEP.

        The one low-latency tensor that is a view of the Buffer, as in DeepEP: two such buffers
        alternate, so this one is handed out again (and rewritten by its experts) for the
        zero-copy combine two after the one that reads it. It stays valid memory while held,
        also after the Buffer is destroyed."""
        return self._rt().get_next_low_latency_combine_buffer(_impl(handle))

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False):
        """
        Mask (unmask) a rank during communication (dispatch, combine, and clean). Needs
        enable_shrink. An unmasked rank must be in step with the others (the same low-latency
        calls), or it is masked again at the next call's deadline.

        Arguments:
            rank_to_mask: the rank to mask (unmask).
            mask: if True, will mask the rank (do not recv from/send to the rank), otherwise will unmask the rank.
        """
        self._rt().update_mask(int(rank_to_mask), bool(mask))

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor):
        """
        Query the mask status of all ranks (all zero without enable_shrink).

        Arguments:
            mask_status: `[num_ranks]` with `torch.int`, the mask status of each rank. `1` means mask and `0` means unmasked.
        """
        if mask_status.dtype != torch.int or mask_status.numel() != self.group_size:
            raise ValueError(f"mask_status must be [{self.group_size}] torch.int; got "
                             f"{list(mask_status.shape)} {mask_status.dtype}")
        mask_status.copy_(torch.tensor(self._rt().query_mask(), dtype=torch.int).view_as(mask_status))

    def low_latency_clean_mask_buffer(self):
        """
        Clean the mask buffer (unmask every rank). Needs enable_shrink.
        """
        self._rt().clean_mask()


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
