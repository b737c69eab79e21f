"""DeepEP's HybridEPBuffer (its hybrid-ep branch) on CPU ranks, over moed's Flex dispatcher.

Megatron-Core's Flex dispatcher with moe_flex_dispatcher_backend="hybridep" makes one buffer
and calls two methods, each of them a fused permute + all-to-all + permute:

    buffer = deep_ep.HybridEPBuffer(group, hidden_dim=H, max_num_of_tokens_per_rank=T,
                                    num_local_experts=L)
    x, probs, _, tokens_per_expert, handle = buffer.dispatch_with_permute(
        hidden=x, routing_map=routing_map, probs=probs, num_of_experts_per_rank=L)
    ... experts: segment j of x has tokens_per_expert[j] rows ...
    y, _ = buffer.combine_with_unpermute(hidden=y, handle=handle)

The rows come out in HybridEP's layout, which is moed's canonical one: one segment per local
expert, each ordered by source rank, then source token, padded with zero rows to a multiple of
`pad_multiple` (docs/design.md). Dispatch moves each row once, straight into that place; combine
sums each token's rows over every rank in moed's fixed order, so the result has the same bits
as every other moed dispatcher's.

The same two calls are each other's backward, as Megatron's HybridEPDispatch / HybridEPCombine
use them: dispatch_with_permute(hidden=grad, handle=handle) sends a combine's gradient back to
the rows, and combine_with_unpermute(hidden=grad, probs=grad_probs, handle=handle) returns the
gradients of a dispatch's hidden and probs ([T, E], zero where not routed).

What a CPU rank cannot do raises NotImplementedError naming it: FP8 dispatch (use_fp8,
scaling_factor), the non-permuting dispatch / combine pair, and update_template_config (the
CUDA kernels' template).
"""
import torch

from .. import _C
from .._world import as_group

# DeepEP's handle is an 11-tuple (hybrid_ep_buffer.py); moed keeps its places so code that
# unpacks it works. The places holding HybridEP's kernel maps are None here.
_HANDLE_LEN = 11
_NUM_DISPATCHED, _LOCAL_ROUTING_MAP, _TOKENS_PER_EXPERT, _NUM_TOKENS, _CONFIG, _OVERFLOW = (
    3, 4, 7, 8, 9, 10)


class _HybridEPState:
    """Place 9 of a moed handle (DeepEP's `config`): what combine and the backward calls need."""

    def __init__(self, box, handle, routing_map, pad_multiple, num_rows, num_permuted):
        self.box = box                  # the moed Flex dispatcher (one per pad_multiple)
        self.handle = handle            # its DispatchHandle
        self.routing_map = routing_map  # [T, E] bool, for a later dispatch of new probs
        self.pad_multiple = pad_multiple
        self.num_rows = num_rows        # rows moed laid out (padded segments)
        self.num_permuted = num_permuted  # rows handed out (>= num_rows: num_permuted_tokens)


class HybridEPBuffer:
    """DeepEP's HybridEPBuffer: dispatch_with_permute / combine_with_unpermute on CPU ranks.

    Arguments (DeepEP's names and order):
        group: a torch.distributed ProcessGroup (gloo) or a moed.Group; kept as given in
            `group` (Megatron compares it).
        hidden_dim, max_num_of_tokens_per_rank, num_local_experts: the sizes DeepEP allocates
            for; moed sizes its buffers per call, so these are checked and kept, not limits.
        use_fp8: FP8 dispatch is not served here (NotImplementedError when True).
        num_sms_dispatch_api, num_sms_combine_api, num_sms_preprocessing_api,
        num_blocks_permute, num_blocks_unpermute, load_cached_kernels, use_shared_buffer,
        enable_custom_allgather, num_of_hybrid_ep_ranks_per_nvlink_domain, use_mnnvl: GPU
            occupancy and kernel-cache settings, accepted and without effect on CPU ranks.

    The NVLink domain is moed's node: `num_of_hybrid_ep_ranks_per_nvlink_domain` is the
    group's ranks per node (moed.from_torch's ranks_per_node)."""

    def __init__(self, group, hidden_dim: int, max_num_of_tokens_per_rank: int,
                 num_local_experts: int, use_fp8: bool = False, num_sms_dispatch_api: int = None,
                 num_sms_combine_api: int = None, num_sms_preprocessing_api: int = None,
                 num_blocks_permute: int = None, num_blocks_unpermute: int = None,
                 load_cached_kernels: bool = False, use_shared_buffer: bool = True,
                 enable_custom_allgather: bool = False,
                 num_of_hybrid_ep_ranks_per_nvlink_domain: int = None, use_mnnvl: bool = None):
        if use_fp8:
            raise NotImplementedError("HybridEPBuffer(use_fp8=True): moed's HybridEPBuffer "
                                      "dispatches bf16 / fp32 rows only")
        for name, v in (("hidden_dim", hidden_dim), ("num_local_experts", num_local_experts)):
            if int(v) <= 0:
                raise ValueError(f"HybridEPBuffer: {name} = {v} must be positive")
        if int(max_num_of_tokens_per_rank) < 0:
            raise ValueError(f"HybridEPBuffer: max_num_of_tokens_per_rank = "
                             f"{max_num_of_tokens_per_rank} is negative")
        self.group = group
        self._group = as_group(group)
        self.rank = self._group.rank()
        self.group_size = self._group.size()
        node = self._group.ranks_per_node() or self.group_size
        self.num_of_hybrid_ep_ranks_per_nvlink_domain = node
        self.local_rank = self.rank % node
        self.node_rank = self.rank // node
        self.num_of_nodes = self.group_size // node
        self.hidden_dim = int(hidden_dim)
        self.max_num_of_tokens_per_rank = int(max_num_of_tokens_per_rank)
        self.num_local_experts = int(num_local_experts)
        self.use_fp8 = False
        self._boxes = {}  # pad_multiple -> moed Flex dispatcher

    # ---- what DeepEP has and a CPU rank does not ----
    def update_template_config(self, *args, **kwargs):
        raise NotImplementedError("HybridEPBuffer.update_template_config: moed has no CUDA "
                                  "kernel template to configure")

    def dispatch(self, *args, **kwargs):
        raise NotImplementedError("HybridEPBuffer.dispatch (without permute): moed serves "
                                  "dispatch_with_permute / combine_with_unpermute only")

    def combine(self, *args, **kwargs):
        raise NotImplementedError("HybridEPBuffer.combine (without unpermute): moed serves "
                                  "dispatch_with_permute / combine_with_unpermute only")

    def empty_jit_cache(self):
        """DeepEP removes its compiled kernels; moed compiles none at run time, so there is
        nothing to remove."""

    # ---- the two calls ----
    def dispatch_with_permute(self, *, hidden, topk_idx=None, topk_weights=None,
                              num_of_experts_per_rank=None, num_of_experts=None, use_fp8=None,
                              routing_map=None, probs=None, scaling_factor=None,
                              num_permuted_tokens=None, pad_multiple=None, handle=None,
                              non_blocking=False, fuse_permute_dispatch=False,
                              num_dispatched_tokens=None, use_host_meta=None):
        """Sends each token to the ranks of its experts, laid out expert by expert.

        Arguments:
            hidden: [T, H] bf16 or fp32, this rank's tokens.
            routing_map: [T, E] bool (E = num_local_experts * group size), or topk_idx [T, K]
                (-1 = none) with num_of_experts; probs [T, E] fp32 (or topk_weights [T, K]),
                optional.
            num_of_experts_per_rank: checked against the buffer's num_local_experts.
            pad_multiple: each expert's segment padded with zero rows to a multiple of it.
            num_permuted_tokens: rows of the returned tensors (DeepEP's sync-free upper
                bound): rows past the real ones are zero; fewer than the real rows raise
                ValueError (DeepEP's overflow flag).
            handle: an earlier call's handle: send `hidden` (a combine's gradient, say) along
                the same layout without routing it again.
            non_blocking, fuse_permute_dispatch: accepted; moed's Flex always writes each row
                once, into its final place, and a CPU rank has no stream to leave running.
            scaling_factor, use_fp8: FP8 dispatch, NotImplementedError.

        Returns:
            (dispatched_hidden [N, H], dispatched_probs [N] fp32 or None, None,
             tokens_per_expert [L] int64 (padded counts), handle): N = the padded rows, or
            num_permuted_tokens. dispatched_hidden may view moed's node-shared output region,
            which no later dispatch writes while the tensor is held."""
        if use_fp8 or scaling_factor is not None:
            raise NotImplementedError("HybridEPBuffer.dispatch_with_permute: FP8 dispatch "
                                      "(use_fp8 / scaling_factor) is not served by moed")
        if use_host_meta is not None:
            non_blocking = not use_host_meta
        if num_permuted_tokens is not None:  # Megatron passes the previous call's count tensor
            num_permuted_tokens = int(num_permuted_tokens)
        if hidden.dim() != 2:
            raise ValueError(f"hidden must be [T, H], got shape {tuple(hidden.shape)}")
        if num_of_experts_per_rank is not None and int(num_of_experts_per_rank) != self.num_local_experts:
            raise ValueError(f"num_of_experts_per_rank = {num_of_experts_per_rank}, but the buffer "
                             f"was made for num_local_experts = {self.num_local_experts}")
        if handle is not None:
            state = self._state(handle, "dispatch_with_permute")
            if probs is None and topk_weights is None:
                # The backward of a combine: the gradient rows go back along the layout.
                grad_rows, _ = state.box.combine_backward(hidden.contiguous(), None, state.handle)
                n = state.num_permuted if num_permuted_tokens is None else num_permuted_tokens
                rows = self._pad_rows(grad_rows, n)
                return rows, None, None, state.handle.tokens_per_expert.clone(), handle
            routing_map = state.routing_map
            pad_multiple = state.pad_multiple
        num_tokens = hidden.size(0)
        E = self.num_local_experts * self.group_size
        if routing_map is None:
            if topk_idx is None:
                raise ValueError("dispatch_with_permute: pass routing_map, topk_idx or handle")
            if num_of_experts is None:
                raise ValueError("dispatch_with_permute: num_of_experts is needed with topk_idx")
            routing_map, probs = _indices_to_map(topk_idx, topk_weights, num_tokens, int(num_of_experts))
        if routing_map.dtype != torch.bool or routing_map.dim() != 2:
            raise ValueError(f"routing_map must be [T, E] bool, got {tuple(routing_map.shape)} "
                             f"{routing_map.dtype}")
        if routing_map.size(1) != E or routing_map.size(0) != num_tokens:
            raise ValueError(f"routing_map is {tuple(routing_map.shape)}, expected [{num_tokens}, {E}] "
                             f"(num_local_experts {self.num_local_experts} x {self.group_size} ranks)")
        if hidden.size(1) != self.hidden_dim:
            raise ValueError(f"hidden has {hidden.size(1)} columns, the buffer hidden_dim = "
                             f"{self.hidden_dim}")
        if num_tokens > self.max_num_of_tokens_per_rank:
            # DeepEP grows its buffer (update_template_config); so does this one.
            self.max_num_of_tokens_per_rank = num_tokens
        with_probs = probs is not None
        if with_probs and (probs.dtype != torch.float32 or tuple(probs.shape) != tuple(routing_map.shape)):
            raise ValueError(f"probs must be [T, E] float32 like routing_map, got "
                             f"{tuple(probs.shape)} {probs.dtype}")
        pad = int(pad_multiple or 0)
        box = self._box(pad)
        d = box.dispatch(
            hidden.contiguous(), routing_map=routing_map.contiguous(),
            probs=(probs if with_probs else routing_map.float()).contiguous(),
            num_topk=self._num_topk(routing_map))
        x, pprobs, tpe, moed_handle = d.expert_input, d.permuted_probs, d.tokens_per_expert, d.handle
        num_rows = int(x.size(0))
        if non_blocking and num_permuted_tokens is None:
            raise ValueError("dispatch_with_permute(non_blocking=True) needs num_permuted_tokens")
        num_permuted = num_rows if num_permuted_tokens is None else int(num_permuted_tokens)
        x = self._pad_rows(x, num_permuted)
        pprobs = self._pad_rows(pprobs, num_permuted) if with_probs else None
        state = _HybridEPState(box, moed_handle, routing_map, pad, num_rows, num_permuted)
        new_handle = self._handle(state, num_tokens)
        return x, pprobs, None, tpe, new_handle

    def combine_with_unpermute(self, *, hidden, probs=None, handle=None, pad_multiple=None,
                               fuse_unpermute_combine=False, num_dispatched_tokens=None):
        """Sums each token's expert rows back on the rank it came from.

        Arguments:
            hidden: [N, H] fp32 or bf16, rows in the layout of `handle`'s dispatch (N as that
                dispatch returned; rows past the real ones are ignored).
            probs: [N] fp32 or None: with it, also returns each row's value at its (token,
                expert) place of a [T, E] map (the gradient of the dispatch's probs).
            handle: dispatch_with_permute's handle (required).
            pad_multiple, fuse_unpermute_combine: accepted (the handle's layout is used).

        Returns:
            (combined_hidden [T, H] of hidden's dtype, combined_probs [T, E] fp32 or None)."""
        if handle is None:
            raise ValueError("combine_with_unpermute: the handle is necessary")
        state = self._state(handle, "combine_with_unpermute")
        if hidden.dim() != 2 or hidden.size(0) < state.num_rows:
            raise ValueError(f"combine_with_unpermute: hidden is {tuple(hidden.shape)}, the "
                             f"dispatch laid out {state.num_rows} rows")
        rows = hidden[:state.num_rows]
        if probs is None:
            out, _ = state.box.combine(rows.contiguous(), state.handle)
            return out, None
        # The gradient of a dispatch: its hidden part is the unweighted combine of the rows;
        # the probs part puts each row's value back at its (token, expert) place.
        out, probs_map = state.box.dispatch_backward(
            rows.contiguous(), probs[:state.num_rows].float().contiguous(), state.handle)
        return out, probs_map

    # ---- internals ----
    def _box(self, pad):
        box = self._boxes.get(pad)
        if box is None:
            E = self.num_local_experts * self.group_size
            box = _C.TokenDispatcher(self._group.handle, _C.DispatchConfig(
                kind="flex", num_experts=E, ep_size=self.group_size,
                expert_alignment=max(pad, 1), weighted_combine=False))
            self._boxes[pad] = box
        return box

    def _num_topk(self, routing_map):
        """The most experts any token of any rank has: moed's dispatch needs one top-k on every
        rank, and HybridEP's routing map carries none (a rank may even have no tokens)."""
        k = routing_map.sum(1).max().reshape(1) if routing_map.size(0) else torch.zeros(1, dtype=torch.int64)
        out = torch.empty(self.group_size, dtype=torch.int64)
        self._group.handle.all_gather_into(out, k.to(torch.int64).contiguous())
        return max(int(out.max()), 1)

    @staticmethod
    def _pad_rows(t, n):
        if n == t.size(0):
            return t
        if n < t.size(0):
            raise ValueError(f"num_permuted_tokens = {n} is fewer than the {t.size(0)} rows this "
                             f"rank receives (DeepEP's overflow)")
        out = t.new_zeros((n,) + tuple(t.shape[1:]))
        out[:t.size(0)] = t
        return out

    @staticmethod
    def _state(handle, where):
        if (not isinstance(handle, tuple) or len(handle) != _HANDLE_LEN
                or not isinstance(handle[_CONFIG], _HybridEPState)):
            raise ValueError(f"{where}: handle is not a handle of moed's dispatch_with_permute")
        return handle[_CONFIG]

    def _handle(self, state, num_tokens):
        h = state.handle
        L = self.num_local_experts
        # The tokens this rank received (each once), in global order, and their local experts.
        src = torch.as_tensor(h.row_src_rank, dtype=torch.int64)
        tok = torch.as_tensor(h.row_src_token, dtype=torch.int64)
        real = src >= 0
        expert = torch.repeat_interleave(torch.arange(L), h.tokens_per_expert)[real]
        keys, inverse = torch.unique(src[real] * (1 << 32) + tok[real], return_inverse=True)
        local_map = torch.zeros(keys.numel(), L, dtype=torch.bool)
        local_map[inverse, expert] = True
        slots = [None] * _HANDLE_LEN
        slots[_NUM_DISPATCHED] = torch.tensor([keys.numel()], dtype=torch.int32)
        slots[_LOCAL_ROUTING_MAP] = local_map
        slots[_TOKENS_PER_EXPERT] = h.tokens_per_expert_unpadded.clone()
        slots[_NUM_TOKENS] = num_tokens
        slots[_CONFIG] = state
        slots[_OVERFLOW] = torch.tensor(False)
        return tuple(slots)


def _indices_to_map(topk_idx, topk_weights, num_tokens, num_experts):
    """DeepEP's indices_to_map: top-k indices (and weights) as a [T, E] map (and probs)."""
    idx = topk_idx.to(torch.int64)
    valid = idx >= 0
    rows = torch.arange(num_tokens).unsqueeze(1).expand_as(idx)[valid]
    routing_map = torch.zeros(num_tokens, num_experts, dtype=torch.bool)
    routing_map[rows, idx[valid]] = True
    probs = None
    if topk_weights is not None:
        probs = torch.zeros(num_tokens, num_experts, dtype=torch.float32)
        probs[rows, idx[valid]] = topk_weights.float()[valid]
    return routing_map, probs
