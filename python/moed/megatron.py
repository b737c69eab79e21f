"""Megatron-Core-style token dispatchers over moed (AllGather, AlltoAll, Flex), for torch.

The six steps keep Megatron's names and shapes:

    d = moed.megatron.MoEAlltoAllTokenDispatcher(config=moed.megatron.MoEConfig(
            num_moe_experts=8, moe_router_topk=2))
    x, p = d.dispatch_preprocess(hidden_states, routing_map, probs)   # local
    x, p = d.token_dispatch(x, p)                                     # moves tokens
    expert_in, tokens_per_expert, permuted_probs = d.dispatch_postprocess(x, p)
    ... experts: segment j of expert_in has tokens_per_expert[j] rows ...
    y = d.combine_preprocess(expert_out)
    y = d.token_combine(y)
    out = d.combine_postprocess(y)                                    # hidden_states' shape

Dispatch and combine are torch.autograd.Functions whose backward is moed's own dispatch /
combine backward, so loss.backward() gives the hidden-state and probs gradients the C++ API
gives, bit for bit. The group is the calling rank's (moed.launch / moed.init / torch's default
gloo group) unless given (a moed.Group or a torch.distributed ProcessGroup).
Routing: routing_map bool [T, E] + probs float32 [T, E] (Megatron), or topk_idx int32/int64
[T, K] + probs float32 [T, K] (DeepEP) through dispatch_preprocess(..., topk_idx=idx).
"""
from dataclasses import dataclass, field, replace
from typing import Optional

import torch

from . import _C
from ._world import as_group, current_group


@dataclass
class MoEConfig:
    """The TransformerConfig fields a dispatcher reads (Megatron's names)."""
    num_moe_experts: int = 0
    moe_router_topk: int = 0  # K (the capacity formula needs it); 0 = max experts per token
    expert_model_parallel_size: int = 0  # 0 = world size / expert_tensor_parallel_size
    expert_tensor_parallel_size: int = 1
    moe_expert_capacity_factor: Optional[float] = None  # None = dropless
    moe_token_drop_policy: str = "probs"  # "probs" | "position"
    moe_pad_expert_input_to_capacity: bool = False
    moe_expert_alignment: int = 1  # each expert segment padded to a multiple of this
    moe_router_padding_multiple: int = 0  # Megatron's pad_routing_map (quantisation); 0 = off
    # Multiply each expert's output by its prob in combine (Megatron's unpermute with probs);
    # False: experts apply permuted_probs themselves, combine sums.
    moe_weighted_combine: bool = False
    moe_num_worst_tokens: int = 0  # Flex: size the output up front
    moe_num_channels: int = 0  # Flex: worker threads owning token ranges; 0 = the rank's pool
    extra: dict = field(default_factory=dict)


class _DispatchFn(torch.autograd.Function):
    """Forward: the rows moed already dispatched (computed by the steps); backward: moed's
    dispatch backward (an unweighted combine of the gradients, plus the probs gradient)."""

    @staticmethod
    def forward(ctx, hidden, probs, state):
        ctx.state = state
        x, pprobs = state.expert_input, state.permuted_probs
        # The state must not hold the outputs (output -> grad_fn -> ctx -> state cycle).
        state.expert_input = state.permuted_probs = None
        state.x_shape, state.x_dtype = tuple(x.shape), x.dtype
        return x, pprobs

    @staticmethod
    def backward(ctx, grad_x, grad_pprobs):
        s = ctx.state
        if grad_x is None:
            grad_x = torch.zeros(s.x_shape, dtype=s.x_dtype)
        grad_hidden, grad_probs = s.box.dispatch_backward(
            grad_x.contiguous(), None if grad_pprobs is None else grad_pprobs.contiguous(), s.handle)
        return grad_hidden.view(s.hidden_shape), s.probs_grad(grad_probs), None


class _CombineFn(torch.autograd.Function):
    """Forward: the combined rows moed computed; backward: moed's combine backward."""

    @staticmethod
    def forward(ctx, expert_output, probs, state, box):
        ctx.state = state
        if state.weighted:
            ctx.save_for_backward(expert_output)
        out, box[0] = box[0], None
        return out

    @staticmethod
    def backward(ctx, grad_out):
        s = ctx.state
        eo = ctx.saved_tensors[0] if s.weighted else None
        grad_eo, grad_probs = s.box.combine_backward(grad_out.reshape(-1, s.hidden).contiguous(), eo, s.handle)
        return grad_eo, (s.probs_grad(grad_probs) if s.weighted else None), None, None


class _DispatchState:
    """One dispatch in flight / done: what combine and both backward passes need."""

    def __init__(self, box, hidden_shape, probs, topk_idx, weighted):
        self.box = box
        self.hidden_shape = hidden_shape
        self.hidden = hidden_shape[-1]
        self.probs = probs
        self.topk_idx = topk_idx
        self.weighted = weighted
        self.handle = None
        self.expert_input = None
        self.permuted_probs = None

    def probs_grad(self, grad_map):
        """moed's [T, E] probs gradient in the shape the probs came in ([T, E] or [T, K])."""
        if self.topk_idx is None:
            return grad_map.to(self.probs.dtype)
        idx = self.topk_idx.long()
        g = grad_map.gather(1, idx.clamp(min=0))
        return g.masked_fill(idx < 0, 0).to(self.probs.dtype)


class MoETokenDispatcher:
    """The six steps over one moed dispatcher (``kind``: allgather, alltoall, flex)."""

    kind = None

    def __init__(self, num_local_experts=None, local_expert_indices=None, config=None, group=None,
                 **fields):
        config = replace(config or MoEConfig(), **fields)
        self.config = config
        self.group = as_group(group)  # a moed.Group, a torch ProcessGroup, or None
        c = config
        self._box = _C.TokenDispatcher(
            self.group.handle, self.kind, int(c.num_moe_experts), ep_size=int(c.expert_model_parallel_size),
            etp_size=int(c.expert_tensor_parallel_size), capacity_factor=c.moe_expert_capacity_factor,
            drop_policy=c.moe_token_drop_policy, pad_to_capacity=bool(c.moe_pad_expert_input_to_capacity),
            expert_alignment=int(c.moe_expert_alignment),
            router_padding_multiple=int(c.moe_router_padding_multiple),
            weighted_combine=bool(c.moe_weighted_combine), num_worst_tokens=int(c.moe_num_worst_tokens),
            num_channels=int(c.moe_num_channels))
        R = self.group.size()
        self.tp_size = int(c.expert_tensor_parallel_size)
        self.ep_size = int(c.expert_model_parallel_size) or R // self.tp_size
        self.num_local_experts = self._box.num_local_experts
        ep_rank = self.group.rank() // self.tp_size
        first = ep_rank * self.num_local_experts
        self.local_expert_indices = list(range(first, first + self.num_local_experts))
        if num_local_experts is not None and int(num_local_experts) != self.num_local_experts:
            raise ValueError(f"num_local_experts = {num_local_experts}, but moed places "
                             f"{self.num_local_experts} experts on each rank")
        if local_expert_indices is not None and list(local_expert_indices) != self.local_expert_indices:
            raise ValueError(f"local_expert_indices = {list(local_expert_indices)}, but this rank holds "
                             f"experts {self.local_expert_indices}")
        self._state = None   # the dispatch in progress (steps 1-3)
        self._last = None    # the latest finished dispatch (what combine uses)
        self._combine_in = None

    # ---- dispatch ----
    def dispatch_preprocess(self, hidden_states, routing_map, probs, topk_idx=None, scales=None,
                            *, out=None):
        """Local: checks the inputs and prepares the layout. hidden_states [..., H] (f32, bf16,
        or fp8 with `scales`); routing_map bool [T, E] and probs [T, E], or routing_map=None and
        topk_idx [T, K] with probs [T, K]. Returns (hidden_states as [T, H], probs).

        out (keyword-only, moed's extension): a [rows, H] tensor of hidden_states' dtype (rows
        may be strided) that dispatch_postprocess returns as dispatched_input, filled. rows is
        what this rank receives (Flex's moe_num_worst_tokens when set; else what the routing
        gives, e.g. an earlier dispatch's handle.num_rows for the same routing); a wrong `out`
        on one rank raises ValueError on every rank, naming it."""
        shape = tuple(hidden_states.shape)
        x = hidden_states.reshape(-1, shape[-1]) if len(shape) != 2 else hidden_states
        state = _DispatchState(self._box, shape, probs, topk_idx, bool(self.config.moe_weighted_combine))
        if routing_map is not None:
            self._box.dispatch_preprocess(x, scales, routing_map=routing_map, probs=probs,
                                          num_topk=int(self.config.moe_router_topk), out=out)
        else:
            if topk_idx is None:
                raise ValueError("pass routing_map (with probs [T, E]) or topk_idx (with probs [T, K])")
            self._box.dispatch_preprocess(x, scales, topk_idx=topk_idx, topk_weights=probs, out=out)
        self._state = state
        return x, probs

    def token_dispatch(self, hidden_states, probs, async_op=False):
        """Moves the tokens (async_op=True may return before they have moved; the next step
        waits). Returns its inputs, as Megatron's does."""
        self._need(self._state, "token_dispatch", "dispatch_preprocess")
        self._box.token_dispatch(bool(async_op))
        return hidden_states, probs

    def dispatch_postprocess(self, hidden_states, probs):
        """Returns (dispatched_input [rows, H], tokens_per_expert [L] int64, permuted_probs
        [rows] f32), in moed's canonical layout (expert-major, padded as configured)."""
        s = self._need(self._state, "dispatch_postprocess", "dispatch_preprocess")
        x, scales, pprobs, tpe, handle = self._box.dispatch_postprocess()
        s.handle = handle
        self._state = None
        self._last = s
        if (hidden_states.requires_grad or (probs is not None and probs.requires_grad)) and (
                torch.is_grad_enabled() and x.is_floating_point()):
            # Handed to the Function through the state, which drops them at once: a state that
            # kept the outputs would keep their slot of moed's output ring after the caller
            # let them go, so the next dispatch would write colder memory.
            s.expert_input, s.permuted_probs = x, pprobs
            x, pprobs = _DispatchFn.apply(hidden_states, probs, s)
        return x, tpe, pprobs

    # ---- combine ----
    def combine_preprocess(self, hidden_states, *, out=None):
        """hidden_states: expert outputs [rows, H] (f32 or bf16) in the dispatch's layout.

        out (keyword-only, moed's extension): a [T, H] tensor of hidden_states' dtype (rows
        may be strided; T = this rank's tokens of the dispatch) that combine_postprocess
        returns, filled, as it is (not viewed in dispatch_preprocess's hidden_states shape);
        a wrong `out` on one rank raises ValueError on every rank, naming it, and then no
        rank's `out` is written."""
        s = self._need(self._last, "combine_preprocess", "dispatch_postprocess")
        self._box.combine_preprocess(hidden_states, s.handle, out=out)
        self._combine_in = (hidden_states, s, out)
        return hidden_states

    def token_combine(self, hidden_states, async_op=False):
        self._need(self._combine_in, "token_combine", "combine_preprocess")
        self._box.token_combine(bool(async_op))
        return hidden_states

    def combine_postprocess(self, hidden_states):
        """The combined tokens in dispatch_preprocess's hidden_states shape (combine_preprocess's
        `out`, as given, when there was one)."""
        eo, s, given = self._need(self._combine_in, "combine_postprocess", "combine_preprocess")
        self._combine_in = None
        out, _ = self._box.combine_postprocess()
        probs = s.probs if s.weighted else None
        if (eo.requires_grad or (probs is not None and probs.requires_grad)) and torch.is_grad_enabled():
            out = _CombineFn.apply(eo, probs, s, [out])
        # NOTE: a [T, H] input needs no view back. At decode each torch call costs several us
        # (the kernels' rows between two calls have evicted torch's code and data from the
        # caches), so the calls that change nothing are left out.
        return out if given is not None or len(s.hidden_shape) == 2 else out.view(s.hidden_shape)

    # ---- Megatron's older two-call API ----
    def token_permutation(self, hidden_states, probs, routing_map):
        x, p = self.dispatch_preprocess(hidden_states, routing_map, probs)
        x, p = self.token_dispatch(x, p)
        return self.dispatch_postprocess(x, p)

    def token_unpermutation(self, hidden_states, bias=None):
        if bias is not None:
            raise ValueError("bias is not supported by moed's dispatchers")
        y = self.combine_preprocess(hidden_states)
        y = self.token_combine(y)
        return self.combine_postprocess(y), None

    @property
    def handle(self):
        """The latest dispatch's moed handle (layout, source of every row, effective routing)."""
        return None if self._last is None else self._last.handle

    def close(self):
        self._box.close()

    @staticmethod
    def _need(value, step, before):
        if value is None:
            raise RuntimeError(f"{step} called before {before}")
        return value


class MoEAllGatherTokenDispatcher(MoETokenDispatcher):
    """Every rank gathers all tokens and keeps its experts' rows (Megatron's allgather)."""
    kind = "allgather"


class MoEAlltoAllTokenDispatcher(MoETokenDispatcher):
    """Counts, then one all-to-all of the rows each rank needs (Megatron's alltoall)."""
    kind = "alltoall"


class MoEFlexTokenDispatcher(MoETokenDispatcher):
    """DeepEP-style: node-shared buffers inside a node, each token once per node across
    nodes (Megatron's flex / DeepEP). dispatched_input is a view of its node-shared output
    region, which no later dispatch writes while the tensor is held."""
    kind = "flex"


_KINDS = {"allgather": MoEAllGatherTokenDispatcher, "alltoall": MoEAlltoAllTokenDispatcher,
          "flex": MoEFlexTokenDispatcher}


def make_dispatcher(kind, config=None, group=None, **fields):
    """The dispatcher class named by kind ("allgather", "alltoall", "flex")."""
    try:
        cls = _KINDS[kind]
    except KeyError:
        raise ValueError(f"kind = {kind!r} is not one of {sorted(_KINDS)}") from None
    return cls(config=config, group=group, **fields)
