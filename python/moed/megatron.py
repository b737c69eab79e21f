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

Megatron's own arguments work too, so a Megatron MoELayer can hold one of these in place of its
dispatcher: config may be a real TransformerConfig (or any object with its moe_* attributes;
the knobs that do not apply on CPU are accepted), pg_collection its ProcessGroupCollection, and
the dispatchers have what MoELayer calls beside the six steps (routing_map, shared_experts,
set_shared_experts, get_expert_zero_copy_buffers).
"""
import dataclasses
from dataclasses import dataclass, field, replace
from typing import Optional

import torch

from . import _C
from ._world import as_group, current_group


@dataclass
class MoEConfig:
    """The TransformerConfig fields a dispatcher reads (Megatron's names), and the knobs of
    Megatron's that do not apply on CPU (accepted, without effect). MoEConfig.from_config
    reads them off a real TransformerConfig, or any object with Megatron's moe_* attributes."""
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
    # Megatron's knobs that a CPU dispatcher accepts and does without (Megatron's defaults;
    # docs/python.md says why each changes nothing here).
    moe_permute_fusion: bool = False  # fused CUDA permute kernels
    moe_enable_deepep: bool = False  # which GPU library: moed serves DeepEP itself
    moe_token_dispatcher_type: str = "allgather"  # the class: make_dispatcher(None, config) reads it
    moe_flex_dispatcher_backend: str = "deepep"  # deepep / hybridep: both are moed's Flex here
    moe_router_dtype: Optional[str] = None  # the router's precision: probs arrive computed
    moe_shared_expert_overlap: bool = False  # set_shared_experts requires it, as Megatron's
    moe_deepep_num_sms: int = 20  # GPU occupancy
    moe_hybridep_num_sms: int = 16
    fp8: Optional[str] = None  # the experts' GEMM precision (and the pad size below)
    fp8_recipe: str = "delayed"
    fp4: Optional[str] = None
    fp4_recipe: str = "nvfp4"
    # Megatron pads the routing map for quantised GEMMs; so does moed (router_padding_multiple).
    moe_router_padding_for_quantization: bool = False
    moe_router_padding_for_fp8: bool = False  # Megatron's deprecated name of the one above

    @classmethod
    def from_config(cls, config, **fields):
        """A MoEConfig from Megatron-Core's TransformerConfig (or any object with its moe_*
        attributes): every field above that the object has is read, the rest keep their
        defaults; `fields` override. Megatron's None for expert_tensor_parallel_size is 1."""
        if isinstance(config, MoEConfig):
            return replace(config, **fields)
        names = [f.name for f in dataclasses.fields(cls) if f.name != "extra"]
        got = {n: getattr(config, n) for n in names if hasattr(config, n)}
        if got.get("expert_tensor_parallel_size") is None:
            got["expert_tensor_parallel_size"] = 1
        if got.get("num_moe_experts") is None:
            got["num_moe_experts"] = 0
        if got.get("moe_router_topk") is None:
            got["moe_router_topk"] = 0
        got.update(fields)
        return cls(**got)

    def router_padding_multiple(self):
        """The routing map's pad multiple: moe_router_padding_multiple, or Megatron's
        get_align_size_for_quantization when it pads for quantization (16; mxfp8 32; fp4 128)."""
        if self.moe_router_padding_multiple or not (
                self.moe_router_padding_for_quantization or self.moe_router_padding_for_fp8):
            return int(self.moe_router_padding_multiple)
        if self.fp8:
            return 32 if str(getattr(self.fp8_recipe, "value", self.fp8_recipe)) == "mxfp8" else 16
        return 128 if self.fp4 else 16


class _DispatchFn(torch.autograd.Function):
    """Forward: the rows moed already dispatched (computed by the steps); backward: moed's
    dispatch backward (an unweighted combine of the gradients, plus the probs gradient)."""

    @staticmethod
    def forward(ctx, hidden, probs, state):
        ctx.state = state
        # The gradient takes the shape of this input: dispatch_preprocess's [T, H] view when
        # the steps pass it on (Megatron's MoELayer does), else the caller's own.
        ctx.hidden_shape = tuple(hidden.shape)
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
        return grad_hidden.view(ctx.hidden_shape), s.probs_grad(grad_probs), None


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

    def __init__(self, box, hidden_shape, probs, topk_idx, weighted, routing_map=None):
        self.box = box
        self.routing_map = routing_map
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

    def __init__(self, num_local_experts=None, local_expert_indices=None, config=None,
                 pg_collection=None, group=None, **fields):
        """Megatron's arguments: num_local_experts and local_expert_indices (checked against
        moed's placement), config (a MoEConfig, a TransformerConfig or any object with its
        moe_* attributes; `fields` override), pg_collection (Megatron's ProcessGroupCollection:
        the dispatch runs over its tp_ep group, EP and expert-TP sizes from its ep and expt_tp
        groups). group: moed's way (a moed.Group or a torch ProcessGroup; default the calling
        rank's), used when there is no pg_collection."""
        c = MoEConfig.from_config(config if config is not None else MoEConfig(), **fields)
        if pg_collection is not None:
            if group is None:
                group = getattr(pg_collection, "tp_ep", None)
                group = pg_collection.ep if group is None else group
            ep = getattr(pg_collection, "ep", None)
            etp = getattr(pg_collection, "expt_tp", None)
            c = replace(c, expert_model_parallel_size=ep.size() if ep is not None else 0,
                        expert_tensor_parallel_size=etp.size() if etp is not None else 1)
            self.ep_group, self.tp_group, self.tp_ep_group = ep, etp, group
        self.config = c
        self.pg_collection = pg_collection
        self.group = as_group(group)  # a moed.Group, a torch ProcessGroup, or None
        self._box = _C.TokenDispatcher(self.group.handle, _C.DispatchConfig(
            kind=self.kind, num_experts=int(c.num_moe_experts),
            ep_size=int(c.expert_model_parallel_size), etp_size=int(c.expert_tensor_parallel_size),
            capacity_factor=c.moe_expert_capacity_factor, drop_policy=c.moe_token_drop_policy,
            pad_to_capacity=bool(c.moe_pad_expert_input_to_capacity),
            expert_alignment=int(c.moe_expert_alignment),
            router_padding_multiple=c.router_padding_multiple(),
            weighted_combine=bool(c.moe_weighted_combine), num_worst_tokens=int(c.moe_num_worst_tokens),
            num_channels=int(c.moe_num_channels)))
        R = self.group.size()
        self.tp_size = int(c.expert_tensor_parallel_size)
        self.ep_size = int(c.expert_model_parallel_size) or R // self.tp_size
        self.tp_rank = self.group.rank() % self.tp_size
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
        # Megatron's MoELayer reads these: the shared experts run inside the steps once
        # set_shared_experts gave them; no CUDA graph captures anything here.
        self.shared_experts = None
        self.cudagraph_attrs = []
        self.valid_cudagraph_attrs = None
        self._state = None   # the dispatch in progress (steps 1-3)
        self._last = None    # the latest finished dispatch (what combine uses)
        self._combine_in = None

    # ---- Megatron's MoELayer hooks ----
    def set_shared_experts(self, shared_experts):
        """Megatron's shared-expert overlap: the dispatcher runs the shared experts' steps
        (pre_forward_comm, linear_fc1_forward_and_act, linear_fc2_forward, post_forward_comm,
        get_output) at the points Megatron's AlltoAll dispatcher does, and combine_postprocess
        adds their output. Requires config.moe_shared_expert_overlap, as Megatron's does."""
        if not self.config.moe_shared_expert_overlap:
            raise ValueError("set_shared_experts needs config.moe_shared_expert_overlap = True")
        self.shared_experts = shared_experts

    def get_expert_zero_copy_buffers(self):
        """Megatron's (output_buffer, grad_input_buffer) for the experts to write into:
        (None, None), as every Megatron backend but NCCL-EP's zero-copy mode (moed's
        dispatched_input is already a view of the rows as they arrived)."""
        return None, None

    @property
    def routing_map(self):
        """The routing of the latest dispatch_preprocess as Megatron keeps it: bool [T, E]
        (built from topk_idx when routed that way); None before the first."""
        s = self._state or self._last
        if s is None:
            return None
        if s.routing_map is None and s.topk_idx is not None:
            idx = s.topk_idx.long()
            m = torch.zeros(idx.size(0), int(self.config.num_moe_experts) + 1, dtype=torch.bool)
            m.scatter_(1, idx.masked_fill(idx < 0, m.size(1) - 1), True)
            s.routing_map = m[:, :-1]
        return s.routing_map

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
        state = _DispatchState(self._box, shape, probs, topk_idx, bool(self.config.moe_weighted_combine),
                               routing_map)
        if routing_map is not None:
            self._box.dispatch_preprocess(x, scales, routing_map=routing_map, probs=probs,
                                          num_topk=int(self.config.moe_router_topk), out=out)
        else:  # with neither form the binding raises, on every rank (in token_dispatch)
            self._box.dispatch_preprocess(x, scales, topk_idx=topk_idx, topk_weights=probs, out=out)
        self._state = state
        if self.shared_experts is not None:
            self.shared_experts.pre_forward_comm(hidden_states.view(shape))
        return x, probs

    def token_dispatch(self, hidden_states, probs, async_op=False, async_finish=None,
                       allocate_on_comm_stream=None):
        """Moves the tokens (async_op=True may return before they have moved; the next step
        waits). Returns its inputs, as Megatron's does. async_finish and
        allocate_on_comm_stream (Megatron's Flex arguments) concern CUDA streams: accepted."""
        self._need(self._state, "token_dispatch", "dispatch_preprocess")
        self._box.token_dispatch(bool(async_op))
        return hidden_states, probs

    def dispatch_postprocess(self, hidden_states, probs):
        """Returns (dispatched_input [rows, H], tokens_per_expert [L] int64, permuted_probs
        [rows] f32), in moed's canonical layout (expert-major, padded as configured)."""
        s = self._need(self._state, "dispatch_postprocess", "dispatch_preprocess")
        r = self._box.dispatch_postprocess()
        x, scales, pprobs, tpe = r.expert_input, r.scales, r.permuted_probs, r.tokens_per_expert
        s.handle = r.handle
        self._state = None
        self._last = s
        if (hidden_states.requires_grad or (probs is not None and probs.requires_grad)) and (
                torch.is_grad_enabled() and x.is_floating_point()):
            # Handed to the Function through the state, which drops them at once: a state that
            # kept the outputs would keep their slot of moed's output ring after the caller
            # let them go, so the next dispatch would write colder memory.
            s.expert_input, s.permuted_probs = x, pprobs
            x, pprobs = _DispatchFn.apply(hidden_states, probs, s)
        if self.shared_experts is not None:
            self.shared_experts.linear_fc1_forward_and_act(x)
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

    def token_combine(self, hidden_states, async_op=False, async_finish=None,
                      allocate_on_comm_stream=None):
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
        if self.shared_experts is not None:
            self.shared_experts.linear_fc2_forward(out)
            self.shared_experts.post_forward_comm()
            out = out + self.shared_experts.get_output().reshape(out.shape)
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

    def set_shared_experts(self, shared_experts):
        """As Megatron's Flex dispatcher: shared-expert overlap is not supported."""
        raise NotImplementedError("Shared expert overlap is not supported in Flex Token Dispatcher.")


_KINDS = {"allgather": MoEAllGatherTokenDispatcher, "alltoall": MoEAlltoAllTokenDispatcher,
          "flex": MoEFlexTokenDispatcher}


def make_dispatcher(kind, config=None, group=None, *, num_local_experts=None,
                    local_expert_indices=None, pg_collection=None, **fields):
    """The dispatcher class named by kind ("allgather", "alltoall", "flex"; None: the config's
    moe_token_dispatcher_type, as Megatron's MoELayer chooses), with Megatron's arguments."""
    if kind is None:
        kind = MoEConfig.from_config(config if config is not None else MoEConfig(),
                                     **fields).moe_token_dispatcher_type
    try:
        cls = _KINDS[kind]
    except KeyError:
        raise ValueError(f"kind = {kind!r} is not one of {sorted(_KINDS)}") from None
    return cls(num_local_experts, local_expert_indices, config=config, pg_collection=pg_collection,
               group=group, **fields)
