"""DeepEP V2's ElasticBuffer (``deep_ep/buffers/elastic.py``) on CPU tensors, over moed's C++
runtime (moed._C.ElasticBuffer; one argument object in, one result object out, every check in
C++ on every rank). Names, arguments, defaults and return tuples are V2's, so V2 code runs with
moed's `deep_ep` (moed.deep_ep.install()) and ``device='cpu'`` tensors:

    buffer = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=4096, hidden=7168, num_topk=8)
    recv_x, recv_topk_idx, recv_topk_weights, handle, event = buffer.dispatch(
        x, topk_idx=topk_idx, topk_weights=topk_weights, num_experts=256)
    combined_x, combined_topk_weights, event = buffer.combine(expert_out, handle)

One engine, two layouts: ``do_expand=False`` is the rank-major receive of the legacy Buffer
(each token once per receiving rank); ``do_expand=True`` is Flex's expert-major layout (one row
per (token, local expert), each expert's rows padded to expert_alignment, padding zeroed).
Received rows are always in DeepEP's deterministic order (source rank, then token), and the
combine sums in DeepEP V2's reference order for the buffer's recipe (moed/combine_recipe.h),
bit for bit. Differences from DeepEP, all documented on the methods: CPU ranks have no SMs,
QPs, streams or GPU timeouts (those arguments are accepted and recorded); every call has
finished when it returns (events are complete); the handle's hybrid-mode internals
(token_metadata_at_forward, channel_linked_list) are None, moed's two hops keep their own;
Engram is not available (NotImplementedError).
"""
import math
from contextlib import contextmanager
from typing import Callable, Optional, Sequence, Tuple, Union

import torch

from .. import _C
from .._world import as_group
from . import _profile
from .event import EventHandle, EventOverlap, completed

_ALIGNMENT_BYTES = 2 << 20  # DeepEP's buffer sizes are multiples of 2 MiB
# NOTE: DeepEP's recv_src_metadata is int32, and its users index tensors with its columns;
# torch before 2.0 indexes with int64 only, so there it is handed out as int64 (same values).
_INDEX_INT32 = int(torch.__version__.split(".")[0]) >= 2
_SF_PACK_ALIGNMENT = 4  # rows of DeepEP's TMA-aligned column-major scales


def _align(x: int, y: int) -> int:
    return (x + y - 1) // y * y


class EPHandle:
    """V2's dispatch handle: reuse it for a cached dispatch, pass it to combine.

    Attributes (V2's): do_expand, num_experts, expert_alignment, num_max_tokens_per_rank,
    num_sms, topk_idx, num_recv_tokens, num_expanded_tokens, num_recv_tokens_per_expert_list,
    psum_num_recv_tokens_per_scaleup_rank, psum_num_recv_tokens_per_expert,
    num_unaligned_recv_tokens_per_expert, recv_src_metadata, dst_buffer_slot_idx (views of
    moed's handle; a caller may rebind them, moed uses its own), token_metadata_at_forward and
    channel_linked_list (None: moed's two hops keep their own plan)."""

    def __init__(self, impl, num_experts: int, expert_alignment: int, num_max_tokens_per_rank: int,
                 num_sms: int, topk_idx: Optional[torch.Tensor]) -> None:
        self._moed = impl
        arrays = impl.arrays()
        self.do_expand = impl.do_expand
        self.num_experts = num_experts
        self.expert_alignment = expert_alignment
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.num_sms = num_sms
        self.topk_idx = arrays["topk_idx"] if topk_idx is None else topk_idx
        self.psum_num_recv_tokens_per_scaleup_rank = arrays["psum_num_recv_tokens_per_scaleup_rank"]
        self.psum_num_recv_tokens_per_expert = arrays["psum_num_recv_tokens_per_expert"]
        self.num_unaligned_recv_tokens_per_expert = arrays["num_unaligned_recv_tokens_per_expert"]
        self.num_recv_tokens_per_expert_list = list(impl.num_recv_tokens_per_expert_list)
        self.recv_src_metadata = arrays["recv_src_metadata"]
        if not _INDEX_INT32:
            self.recv_src_metadata = self.recv_src_metadata.long()
        self.dst_buffer_slot_idx = arrays["dst_buffer_slot_idx"]
        self.token_metadata_at_forward = None
        self.channel_linked_list = None
        self.num_recv_tokens = impl.num_recv_tokens
        self.num_expanded_tokens = impl.num_expanded_tokens
        self.cached_recv_src_metadata_before_sort = self.recv_src_metadata

    def deterministic_sort(self, *args, **kwargs) -> None:
        """V2's sort of the received tokens into source order: moed receives them in that
        order already, so there is nothing to do."""


class ElasticBuffer:
    """DeepEP V2's elastic buffer on CPU ranks: expert-parallel dispatch and combine (both
    layouts, FP8, cached handles, two hops across nodes), all-gather sessions (AGRS) and
    pipeline-parallel send / receive.

    Attributes (V2's): group (as passed), rank_idx, num_ranks, allow_hybrid_mode,
    allow_multiple_reduction, prefer_overlap_with_compute, deterministic, num_bytes,
    num_max_tokens_per_rank, num_allocated_qps, num_scaleout_ranks, num_scaleup_ranks,
    scaleout_rank_idx, scaleup_rank_idx, num_rdma_ranks, num_nvlink_ranks, explicitly_destroy,
    runtime (moed._C.ElasticBuffer).
    """

    def __init__(self, group, num_bytes: Optional[int] = None, num_cpu_bytes: int = 0,
                 num_max_tokens_per_rank: int = 0, hidden: int = 0, num_topk: int = 0,
                 use_fp8_dispatch: bool = False, deterministic: bool = False,
                 allow_hybrid_mode: bool = True, allow_multiple_reduction: bool = True,
                 prefer_overlap_with_compute: bool = True, sl_idx: int = 3, num_allocated_qps: int = 0,
                 num_cpu_timeout_secs: int = 300, num_gpu_timeout_secs: int = 100,
                 explicitly_destroy: bool = False) -> None:
        """Make the buffer (collective over the group).

        Arguments:
            group: a torch.distributed ProcessGroup (gloo; moed's world over it is made on first
                use) or a moed.Group; kept as passed in ``group``.
            num_bytes, num_cpu_bytes: recorded (moed allocates what each call needs); without
                num_bytes, the size hint of (num_max_tokens_per_rank, hidden, num_topk,
                use_fp8_dispatch) is recorded, as DeepEP does.
            num_max_tokens_per_rank: the default of dispatch.
            deterministic: accepted (moed's outputs are always in the deterministic order).
            allow_hybrid_mode: across nodes, scale-out = the nodes, scale-up = a node's ranks, and
                the combine reduces inside each node first (with allow_multiple_reduction).
            allow_multiple_reduction: the combine reduces each rank's terms before sending;
                without it (expanded layout) every term is added at home, in top-k slot order.
            prefer_overlap_with_compute, sl_idx, num_allocated_qps, num_gpu_timeout_secs: GPU /
                RDMA settings, recorded. num_cpu_timeout_secs: recorded; every wait is bounded by
                the world's timeout (moed.from_torch(..., timeout=)).
            explicitly_destroy: if set, destroy() must be called.
        """
        moed_group = as_group(group)
        self.group = group
        self._group = moed_group
        self.rank_idx = moed_group.rank()
        self.num_ranks = moed_group.size()
        self.allow_hybrid_mode = allow_hybrid_mode
        self.allow_multiple_reduction = allow_multiple_reduction
        self.prefer_overlap_with_compute = prefer_overlap_with_compute
        self.deterministic = deterministic
        self.explicitly_destroy = explicitly_destroy
        self.num_cpu_timeout_secs = num_cpu_timeout_secs
        self.num_gpu_timeout_secs = num_gpu_timeout_secs
        self.sl_idx = sl_idx
        if num_bytes is None:
            num_bytes = ElasticBuffer.get_buffer_size_hint(
                moed_group, num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch,
                allow_hybrid_mode, allow_multiple_reduction) if num_max_tokens_per_rank > 0 and hidden > 0 else 0
        self.num_bytes = int(num_bytes)
        self.num_cpu_bytes = int(num_cpu_bytes)
        self.num_max_tokens_per_rank = int(num_max_tokens_per_rank)
        if num_allocated_qps == 0:
            num_allocated_qps = 129 if allow_hybrid_mode else 17
        self.num_allocated_qps = num_allocated_qps
        self.runtime = _C.ElasticBuffer(moed_group.handle, self.num_max_tokens_per_rank,
                                        bool(allow_hybrid_mode), bool(allow_multiple_reduction))
        self.num_scaleout_ranks, self.num_scaleup_ranks = self.get_logical_domain_size()
        self.scaleout_rank_idx = self.rank_idx // self.num_scaleup_ranks
        self.scaleup_rank_idx = self.rank_idx % self.num_scaleup_ranks
        self.num_rdma_ranks, self.num_nvlink_ranks = self.get_physical_domain_size()
        self._agrs = None  # (max session bytes, max all-gathers) once agrs_set_config ran
        self._session = None  # [bytes, all-gathers] of the open session

    def destroy(self) -> None:
        """Release the runtime (needs explicitly_destroy=True, as DeepEP)."""
        assert self.explicitly_destroy
        if self.runtime is not None:
            self.runtime.close()
            self.runtime = None

    def _rt(self):
        if self.runtime is None:
            raise RuntimeError("this ElasticBuffer was destroyed")
        return self.runtime

    # ---- sizes ----

    @staticmethod
    def get_buffer_size_hint(group, num_max_tokens_per_rank: int, hidden: int, num_topk: int = 0,
                             use_fp8_dispatch: bool = False, allow_hybrid_mode: bool = True,
                             allow_multiple_reduction: bool = True) -> int:
        """Bytes (2 MiB-aligned) of the largest receive block moed allocates per rank for these
        shapes: every rank's tokens once (hidden bytes, FP8 scales, the top-k, the source),
        or their expert outputs back."""
        num_ranks = as_group(group).size()
        num_topk = num_topk or 32  # DeepEP's assumption when the top-k is not given
        elem = 1 if use_fp8_dispatch else 2
        token = hidden * elem + (math.ceil(hidden / 128) * 4 if use_fp8_dispatch else 0) + num_topk * 12 + 4
        dispatch = num_ranks * num_max_tokens_per_rank * token
        combine = num_ranks * num_max_tokens_per_rank * (hidden * 2 + num_topk * 4)
        return _align(max(dispatch, combine, 1), _ALIGNMENT_BYTES)

    @staticmethod
    def get_engram_storage_size_hint(num_entries: int, hidden: int, num_max_tokens_per_rank: int,
                                     dtype: torch.dtype = torch.bfloat16) -> Tuple[int, int]:
        """V2's Engram sizes (arithmetic only; Engram itself is not available on moed)."""
        entry = _align(hidden * torch.tensor([], dtype=dtype).element_size(), 32)
        return (_align(entry * num_max_tokens_per_rank, _ALIGNMENT_BYTES),
                _align(entry * num_entries, _ALIGNMENT_BYTES))

    @staticmethod
    def get_pp_buffer_size_hint(num_max_tensor_bytes: int, num_max_inflight_tensors: int) -> int:
        """V2's pipeline-parallel buffer size: send and receive, both neighbours."""
        return _align(_align(num_max_tensor_bytes, 32) * num_max_inflight_tensors * 4, _ALIGNMENT_BYTES)

    @staticmethod
    def get_agrs_num_max_session_bytes(group, shapes, dtype: torch.dtype) -> int:
        """Bytes one all-gather session of these local shapes gathers (each rounded to 32)."""
        num_ranks = as_group(group).size()
        if not isinstance(shapes[0], (tuple, list, torch.Size)):
            shapes = (shapes,)
        item = torch.tensor([], dtype=dtype).element_size()
        return sum(_align(num_ranks * math.prod(s) * item, 32) for s in shapes)

    @staticmethod
    def get_agrs_buffer_size_hint(group, num_max_session_bytes: int) -> int:
        return _align(num_max_session_bytes, _ALIGNMENT_BYTES)

    # ---- domains, SMs, events ----

    def get_physical_domain_size(self) -> Tuple[int, int]:
        """(nodes, ranks per node) of the group's world (DeepEP: RDMA ranks, NVLink ranks)."""
        return tuple(self._rt().physical_domain())

    def get_logical_domain_size(self) -> Tuple[int, int]:
        """(scale-out, scale-up) ranks: (nodes, ranks per node) in hybrid mode across nodes,
        else (1, all ranks)."""
        return tuple(self._rt().logical_domain())

    def get_theoretical_num_sms(self, num_experts: int, num_topk: int, num_scaleout_topk: int = 0,
                                rdma_gbs: float = 0, nvlink_gbs: float = 0, sm_read_gbs: float = 200,
                                sm_write_gbs: float = 50) -> int:
        """The workers a CPU rank runs a call on (moed's channels: its share of the host's
        cores), DeepEP's "SMs"; the bandwidth arguments describe GPUs and are not used."""
        return self._rt().num_channels()

    def get_theoretical_num_qps(self, num_sms: int) -> int:
        """DeepEP's QP count for num_sms (recorded in handles; CPU ranks use no QPs)."""
        num_qps = min(num_sms, 8 + 1)
        if self.allow_hybrid_mode:
            num_qps = num_sms * 16 + 1
        return min(num_qps, self.num_allocated_qps)

    @staticmethod
    def capture() -> EventHandle:
        """An event on the "current stream": complete on CPU."""
        return EventHandle()

    def get_comm_stream(self):
        """No streams on CPU ranks: None."""
        return None

    def barrier(self, use_comm_stream: bool = True, with_cpu_sync: bool = False,
                sequential: bool = True) -> None:
        """A barrier over the group (the stream arguments mean nothing on CPU)."""
        with _profile.phase("barrier"):
            self._rt().barrier()

    # ---- expert parallelism ----

    def dispatch(self, x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]],
                 topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                 cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                 num_experts: Optional[int] = None, num_max_tokens_per_rank: Optional[int] = None,
                 expert_alignment: Optional[int] = None, num_sms: int = 0, num_qps: int = 0,
                 previous_event: Optional[EventHandle] = None,
                 previous_event_before_epilogue: Optional[EventHandle] = None,
                 async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False,
                 handle: Optional[EPHandle] = None, do_handle_copy: bool = True,
                 do_cpu_sync: Optional[bool] = None, do_expand: bool = False, do_zero_padding: bool = False,
                 use_tma_aligned_col_major_sf: bool = False):
        """Send each token to the ranks of its experts.

        Arguments:
            x: `[num_tokens, hidden]` bf16 (or float32), or FP8 `(data, scales)`: data in
                moed.fp8_dtype, scales float32 `[num_tokens, hidden / 128]` in either major
                order, or UE8M0 packs int32 `[num_tokens, hidden / 512]`.
            topk_idx: `[num_tokens, num_topk]` int64 (or int32), -1 = none; None with a handle.
            topk_weights: `[num_tokens, num_topk]` float32, optional (also with a handle).
            cumulative_local_expert_recv_stats: `[num_local_experts]` torch.int, += the
                (unaligned) tokens each local expert received.
            num_experts, num_max_tokens_per_rank, expert_alignment: the handle's in cached
                mode; num_max_tokens_per_rank defaults to the buffer's, expert_alignment to 1.
            handle: a dispatch's EPHandle: cached mode (no count exchange).
            do_handle_copy: whether the handle keeps a copy of topk_idx (moed always keeps its
                own; False makes handle.topk_idx the caller's tensor, as DeepEP's).
            do_cpu_sync: False sizes the outputs for the worst case (rows past the received
                ones are zero, indices -1); default True, and with a handle its sizes.
            do_expand: one row per (token, local expert), expert-major, each expert padded to
                expert_alignment (padding always zero, so do_zero_padding is moot).
            use_tma_aligned_col_major_sf: FP8 scales come back column-major (rows padded to 4).
            num_sms, num_qps, events, streams: GPU settings, accepted (num_sms is kept in the
                handle, as DeepEP's).

        Returns:
            recv_x (or (data, scales)), recv_topk_idx (`[rows, num_topk]` local expert ids, -1
            elsewhere; None when expanded), recv_topk_weights (`[rows, num_topk]`, or `[rows]`
            when expanded; None without weights), handle, event (complete).
        """
        x, x_scales = x if isinstance(x, tuple) else (x, None)
        if handle is not None:
            num_topk = handle.topk_idx.shape[1]
        else:
            num_topk = topk_idx.shape[1] if topk_idx is not None else 0
        num_sms = num_sms or (handle.num_sms if handle is not None else self.get_theoretical_num_sms(
            num_experts or 0, num_topk))
        args = _C.ElasticDispatchArgs(
            x=x, x_scales=x_scales, topk_idx=topk_idx, topk_weights=topk_weights,
            cumulative_local_expert_recv_stats=cumulative_local_expert_recv_stats,
            num_experts=int(num_experts or 0), num_max_tokens_per_rank=int(num_max_tokens_per_rank or 0),
            expert_alignment=int(expert_alignment or 0),
            handle=None if handle is None else handle._moed, do_cpu_sync=do_cpu_sync,
            do_expand=bool(do_expand))
        with _profile.phase("dispatch_impl"):
            r = self._rt().dispatch(args)
        if handle is None:
            handle = EPHandle(r.handle, int(num_experts), int(expert_alignment or 1),
                              int(num_max_tokens_per_rank or self.num_max_tokens_per_rank), num_sms,
                              None if do_handle_copy else topk_idx)
        recv_x = r.recv_x
        if x_scales is not None:
            scales = r.recv_x_scales
            if use_tma_aligned_col_major_sf:
                rows, packs = scales.shape
                col = torch.empty_strided((rows, packs), (1, _align(rows, _SF_PACK_ALIGNMENT)),
                                          dtype=scales.dtype)
                col.copy_(scales)
                scales = col
            recv_x = (recv_x, scales)
        return recv_x, r.recv_topk_idx, r.recv_topk_weights, handle, completed()

    def combine(self, x: torch.Tensor, handle: EPHandle, topk_weights: Optional[torch.Tensor] = None,
                bias: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]] = None, num_sms: int = 0,
                num_qps: int = 0, previous_event: Optional[EventHandle] = None,
                previous_event_before_epilogue: Optional[EventHandle] = None,
                async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False, *,
                out: Optional[torch.Tensor] = None):
        """Reduce the expert outputs back to the tokens' ranks, in DeepEP V2's order for this
        buffer's recipe (moed/combine_recipe.h), bit for bit its reference's.

        Arguments:
            x: `[rows, hidden]` bf16 (or float32), rows as the dispatch gave them.
            handle: the dispatch's EPHandle.
            topk_weights: `[rows, num_topk]` (`[rows]` when expanded) float32, optional: each
                slot's weight comes back from its expert's rank (not multiplied into x).
            bias: 0, 1 or 2 `[num_tokens, hidden]` tensors of x's dtype, the start of the sum.
            out (keyword-only, moed's): `[num_tokens, hidden]` of x's dtype to write into.
            num_sms, num_qps, events, streams: GPU settings, accepted.

        Returns:
            combined_x `[num_tokens, hidden]`, combined_topk_weights (`[num_tokens, num_topk]`,
            0 for -1 slots; None without weights), event (complete).
        """
        bias_0, bias_1 = (bias, None) if isinstance(bias, torch.Tensor) else (bias or (None, None))
        args = _C.ElasticCombineArgs(x=x, handle=handle._moed if isinstance(handle, EPHandle) else handle,
                                     topk_weights=topk_weights, bias_0=bias_0, bias_1=bias_1, out=out)
        with _profile.phase("combine_impl"):
            r = self._rt().combine(args)
        return r.combined_x, r.combined_topk_weights, completed()

    # ---- all-gather sessions (AGRS) ----

    def agrs_set_config(self, num_max_session_bytes: int, num_max_all_gathers_per_session: int) -> None:
        """Limits of one session (checked by all_gather), after a barrier."""
        self.barrier()
        self._agrs = (int(num_max_session_bytes), int(num_max_all_gathers_per_session))

    def create_agrs_session(self) -> None:
        if self._agrs is None:
            raise RuntimeError("create_agrs_session before agrs_set_config")
        if self._session is not None:
            raise RuntimeError("an AGRS session is already open")
        self._session = [0, 0]

    def destroy_agrs_session(self) -> None:
        if self._session is None:
            raise RuntimeError("no AGRS session is open")
        self._session = None
        self.barrier()

    @contextmanager
    def agrs_new_session(self, enabled: bool = True):
        if not enabled:
            yield
            return
        self.create_agrs_session()
        try:
            yield
        finally:
            self.destroy_agrs_session()

    def agrs_get_inplace_tensor(self, shapes, dtype: torch.dtype):
        """Tensor(s) to fill and pass to all_gather (on CPU any tensor gathers in place as
        well; these are fresh ones of the asked shapes)."""
        batched = isinstance(shapes[0], (tuple, list, torch.Size))
        tensors = tuple(torch.empty(tuple(s), dtype=dtype) for s in (shapes if batched else (shapes,)))
        return tensors if batched else tensors[0]

    def all_gather(self, t: Union[torch.Tensor, Sequence[torch.Tensor]]):
        """Gathers every rank's tensor(s) inside the open session: `(gathered, handle)`, or
        `(*gathered, handle)` for a sequence; gathered has a leading dimension of num_ranks and
        is complete when handle() returns (at once on CPU). Collective."""
        from .. import dist
        if self._session is None:
            raise RuntimeError("all_gather outside an AGRS session (create_agrs_session first)")
        tensors = (t,) if isinstance(t, torch.Tensor) else tuple(t)
        size = sum(_align(self.num_ranks * u.numel() * u.element_size(), 32) for u in tensors)
        max_bytes, max_count = self._agrs
        if self._session[0] + size > max_bytes or self._session[1] + len(tensors) > max_count:
            raise ValueError(f"this session would gather {self._session[0] + size} bytes in "
                             f"{self._session[1] + len(tensors)} all-gathers; agrs_set_config allows "
                             f"{max_bytes} bytes and {max_count}")
        self._session[0] += size
        self._session[1] += len(tensors)
        out = []
        for u in tensors:
            gathered = torch.empty((self.num_ranks,) + tuple(u.shape), dtype=u.dtype)
            dist.all_gather_into_tensor(gathered, u.contiguous(), group=self._group)
            out.append(gathered)
        done = lambda: None  # noqa: E731
        return (out[0], done) if isinstance(t, torch.Tensor) else (*out, done)

    # ---- pipeline parallelism ----

    def pp_set_config(self, num_max_tensor_bytes: int, num_max_inflight_tensors: int) -> None:
        """Sizes of the pipeline-parallel ring (after a barrier, as DeepEP's)."""
        self._rt().pp_set_config(int(num_max_tensor_bytes), int(num_max_inflight_tensors))

    def pp_send(self, t: torch.Tensor, dst_rank_idx: int, num_sms: int = 0) -> None:
        """Send t to the previous or next rank of the ring; returns once t is copied (at most
        num_max_inflight_tensors sends wait for their receives)."""
        with _profile.phase("send_impl"):
            self._rt().pp_send(t, int(dst_rank_idx))

    def pp_recv(self, t: torch.Tensor, src_rank_idx: int, num_sms: int = 0) -> None:
        """Receive the next tensor from the previous or next rank of the ring into t."""
        with _profile.phase("recv_impl"):
            self._rt().pp_recv(t, int(src_rank_idx))

    # ---- Engram ----

    def engram_write(self, storage: torch.Tensor, sf: Optional[torch.Tensor] = None) -> None:
        raise NotImplementedError("moed.deep_ep.ElasticBuffer: Engram (engram_write) is not "
                                  "available on moed")

    def engram_fetch(self, indices: torch.Tensor, num_qps: int = 0,
                     use_tma_aligned_col_major_sf: bool = False) -> Callable:
        raise NotImplementedError("moed.deep_ep.ElasticBuffer: Engram (engram_fetch) is not "
                                  "available on moed")
