"""Expert parallelism for Hugging Face transformers' MoE models, with moed moving the tokens.

    model = Qwen3MoeForCausalLM(config)                  # every rank: the same weights
    moed.integrations.transformers.expert_parallel(model, group)
    ids = model.generate(this_ranks_prompts, ...)        # each rank its own batch

transformers (5.x) runs each sparse-MoE block as router -> experts module (-> shared experts):
the experts module is called with (hidden_states [T, H], top_k_index [T, K] of global expert
ids, top_k_weights [T, K]) and returns each token's weighted sum of its K expert outputs. The
model names these modules in its ``ep_plan`` with the style "ep_dispatch_experts" (where
transformers' own expert parallelism hooks in). expert_parallel keeps, in each of them, the
L = E / R experts of this rank (dim 0 of every per-expert parameter) and replaces its forward
with moed's dispatch -> the module's own forward on the received rows -> moed's combine. The
routers, attention, norms, embeddings and shared experts stay replicated and untouched.

Numerics (docs/design.md §4): each received row goes through the
module's own forward as top-1 (its local expert id and routing weight), so every weighted expert
output is the one transformers computes (where the weights are fp32 and the states bf16, the
experts run unweighted and moed's weighted combine makes the fp32 product, as transformers
does); moed's combine then adds a token's terms in fp32 from 0, experts ascending, and rounds
once to the model's dtype. transformers' default experts ("grouped_mm") add the K terms in fp32
in top-k slot order and round once: with K = 2 the same bits. What may differ is the expert
GEMMs' rounding, since a GEMM sees every rank's rows of its expert instead of one process's.
"""
import functools
import re

import torch

_DISPATCHERS = ("flex", "alltoall", "allgather")
_DTYPES = (torch.float32, torch.bfloat16)


def expert_module_names(model):
    """The names of the modules that ``model``'s ``ep_plan`` runs as "ep_dispatch_experts"
    (its MoE blocks' experts), in ``named_modules`` order."""
    plan = getattr(model, "ep_plan", None) or {}
    # transformers writes a layer number as "*" in its plans.
    patterns = [re.compile(re.escape(k).replace(r"\*", r"\d+"))
                for k, style in plan.items() if style == "ep_dispatch_experts"]
    return [name for name, _ in model.named_modules() if any(p.fullmatch(name) for p in patterns)]


class _ExpertParallelForward:
    """An experts module's forward across the group: dispatch, the local experts, combine."""

    def __init__(self, local_forward, make_dispatcher, num_local_experts):
        self.local_forward = local_forward      # the module's own forward, on local expert ids
        self.make_dispatcher = make_dispatcher  # weighted combine or not -> a dispatcher
        self.dispatchers = {}
        self.local_ids = torch.arange(num_local_experts)

    def __call__(self, hidden_states, top_k_index, top_k_weights):
        if hidden_states.dtype not in _DTYPES:
            raise TypeError(f"moed's dispatchers move float32 and bfloat16 rows; the experts got "
                            f"{hidden_states.dtype}")
        # NOTE: where the routing weights are float32 and the states bf16 (Mixtral's and
        # DeepSeek-V3's routers), transformers multiplies each bf16 expert output by its fp32
        # weight in fp32 and sums before rounding; moed's weighted combine does that product
        # (docs/design.md), so the experts run unweighted. Otherwise the product is in the
        # states' dtype and the experts make it, as in one process.
        weighted = hidden_states.dtype == torch.bfloat16 and top_k_weights.dtype == torch.float32
        d = self.dispatchers.get(weighted)
        if d is None:  # made on the first forward, which every rank runs at the same time
            d = self.dispatchers[weighted] = self.make_dispatcher(weighted)
        # moed takes the weights in float32: exact for bf16 ones, and cast back exactly below.
        x, w = d.dispatch_preprocess(hidden_states, None, top_k_weights.float(),
                                     topk_idx=top_k_index)
        rows, tokens_per_expert, row_weights = d.dispatch_postprocess(*d.token_dispatch(x, w))
        if rows.shape[0]:
            # Expert-major rows: segment j is local expert j's.
            ids = torch.repeat_interleave(self.local_ids, tokens_per_expert,
                                          output_size=rows.shape[0]).unsqueeze(1)
            if weighted:
                row_weights = torch.ones_like(row_weights)
            y = self.local_forward(rows, ids, row_weights.unsqueeze(1).to(top_k_weights.dtype))
        else:
            y = rows  # nothing to compute here; combine still runs (it is collective)
        return d.combine_postprocess(d.token_combine(d.combine_preprocess(y)))


def expert_parallel(model, group=None, *, dispatcher="flex"):
    """Makes ``model``'s MoE blocks expert-parallel over ``group``, in place; returns ``model``.

    Collective: every rank of the group calls it on the same model (same configuration and
    weights, e.g. built with ``from_config`` under the same seed or loaded from one checkpoint).
    Afterwards each rank holds the experts ``[rank * L, (rank + 1) * L)`` (L = E / R) of every
    MoE block, and every forward is collective: all ranks run the model the same number of
    times, each on its own batch (any number of tokens, 0 included). ``generate`` with a fixed
    number of new tokens does so; where ranks may stop at different steps (EOS), pass
    ``synced_gpus=True`` so finished ranks keep stepping.

    Arguments:
        model: a transformers model (or any module with transformers' ``ep_plan``) whose
            experts modules take ``(hidden_states, top_k_index, top_k_weights)``: Mixtral,
            Qwen3-MoE, OLMoE, DeepSeek-V3, GPT-OSS, ... .
        group: a ``moed.Group``, a ``torch.distributed`` gloo ``ProcessGroup``, or None (the
            calling rank's group).
        dispatcher: ``"flex"`` (default: DeepEP-style node-shared buffers, each token copied
            once per node), ``"alltoall"`` or ``"allgather"`` (``moed.megatron``'s dispatchers;
            all three give the same bits).

    Returns:
        ``model``, with its experts sliced and their forward replaced (parameter names kept,
        shapes ``[L, ...]``; ``module.num_experts`` is L, as transformers' own EP sets it).
    """
    from .. import megatron
    from .._world import as_group

    if dispatcher not in _DISPATCHERS:
        raise ValueError(f"dispatcher = {dispatcher!r} is not one of {list(_DISPATCHERS)}")
    g = as_group(group)
    num_ranks, rank = g.size(), g.rank()
    names = expert_module_names(model)
    if not names:
        raise ValueError(f"{type(model).__name__} names no \"ep_dispatch_experts\" module in its "
                         f"ep_plan: no MoE experts to distribute")
    modules = [(name, model.get_submodule(name)) for name in names]
    # Every check before any change, so a refused model is left as it was.
    for name, experts in modules:
        if isinstance(getattr(experts, "forward", None), _ExpertParallelForward):
            raise ValueError(f"{name} is expert-parallel already")
        num_experts = int(experts.num_experts)
        if num_experts % num_ranks:
            raise ValueError(f"{name}: num_experts = {num_experts} is not a multiple of the "
                             f"group's {num_ranks} ranks")
        for pname, param in experts.named_parameters(recurse=False):
            if param.dim() == 0 or param.shape[0] != num_experts:
                raise ValueError(f"{name}.{pname}: shape {tuple(param.shape)} has no leading "
                                 f"expert dimension of {num_experts}")
    for name, experts in modules:
        num_experts = int(experts.num_experts)
        num_local = num_experts // num_ranks
        first = rank * num_local
        for pname, param in list(experts.named_parameters(recurse=False)):
            # A copy, so the whole tensor is freed.
            experts._parameters[pname] = torch.nn.Parameter(
                param.data[first:first + num_local].clone(), requires_grad=param.requires_grad)
        experts.num_experts = num_local
        make = functools.partial(_make_dispatcher, megatron, dispatcher, g, num_experts)
        # The class's forward (transformers' experts implementation), bound to this module.
        experts.forward = _ExpertParallelForward(type(experts).forward.__get__(experts), make,
                                                 num_local)
    return model


def _make_dispatcher(megatron, kind, group, num_experts, weighted):
    return megatron.make_dispatcher(kind, group=group, num_moe_experts=num_experts,
                                    moe_weighted_combine=weighted)
