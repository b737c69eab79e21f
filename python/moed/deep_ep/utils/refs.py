"""deep_ep.utils.refs for moed's DeepEP on CPU: DeepEP V2's reference dispatch and combine, the
independent answers its tests compare ElasticBuffer with. Written here from their definitions
(DeepEP's docstrings); the rows travel with moed.dist.all_to_all_single, since torch 1.13's gloo
all_to_all rejects bfloat16.

The combine recipes fix the reduction order bit for bit. For each token, over its top-k slots:
  - (reduce_in_local, reduce_in_scaleup) = (False, False): acc = bias sum; acc += y[slot] for
    the slots in order; rounded once.
  - (True, False): the slots of one rank are first summed among themselves (fp32 from 0, slot
    order) and rounded to y's dtype; that partial takes the place of the rank's last slot,
    and the partials are then added as above.
  - (True, True): as (True, False), then the rank partials of one scale-up domain (node) are
    summed the same way (their positions in slot order) and rounded, before the final sum.
"""
import math
from typing import Optional, Tuple, Union

import torch
import torch.distributed as dist

import moed.dist as moed_dist

from .envs import get_global_seed
from .math import ceil_div


def dispatch(x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]],
             topk_idx: torch.Tensor, topk_weights: Optional[torch.Tensor],
             num_max_tokens_per_rank: int, num_experts: int):
    """Every rank's tokens sent once to each rank that holds one of their experts, received
    rank-major (source rank ascending, then source token ascending).

    Returns (recv_x (or (data, scales)), recv_topk_idx (local expert ids, -1 elsewhere),
    recv_topk_weights, recv_src_token_idx (src_rank * num_max_tokens_per_rank + token),
    num_recv_tokens_per_rank)."""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    assert num_experts % num_ranks == 0
    per_rank = num_experts // num_ranks
    data, sf = x if isinstance(x, tuple) else (x, None)
    num_tokens, hidden = data.shape
    if sf is not None:
        assert sf.shape == (num_tokens, ceil_div(hidden, 128))
    if topk_weights is None:
        topk_weights = torch.zeros(topk_idx.shape, dtype=torch.float32)
    owner = torch.where(topk_idx >= 0, topk_idx // per_rank, torch.full_like(topk_idx, -1))

    parts = {"x": [], "sf": [], "idx": [], "w": [], "src": []}
    send_counts = []
    for dst in range(num_ranks):
        tokens = (owner == dst).any(dim=1).nonzero().flatten()
        send_counts.append(tokens.numel())
        parts["x"].append(data[tokens])
        parts["sf"].append(sf[tokens] if sf is not None else None)
        idx = topk_idx[tokens]
        parts["idx"].append(torch.where(owner[tokens] == dst, idx, torch.full_like(idx, -1)))
        parts["w"].append(topk_weights[tokens])
        parts["src"].append(tokens.to(torch.int32) + rank * num_max_tokens_per_rank)

    counts = torch.tensor(send_counts, dtype=torch.int64)
    recv_counts = torch.empty_like(counts)
    moed_dist.all_to_all_single(recv_counts, counts)
    send_counts, recv_list = send_counts, recv_counts.tolist()
    total = sum(recv_list)

    def exchange(chunks, like, width):
        out = torch.empty((total,) + width, dtype=like.dtype)
        moed_dist.all_to_all_single(out, torch.cat(chunks, dim=0), recv_list, send_counts)
        return out

    recv_x = exchange(parts["x"], data, (hidden,))
    recv_sf = exchange(parts["sf"], sf, (sf.size(1),)) if sf is not None else None
    recv_idx = exchange(parts["idx"], topk_idx, (topk_idx.size(1),))
    recv_w = exchange(parts["w"], topk_weights, (topk_idx.size(1),))
    recv_src = exchange(parts["src"], parts["src"][0], ())
    first = rank * per_rank
    local = (recv_idx >= first) & (recv_idx < first + per_rank)
    recv_idx = torch.where(local, recv_idx - first, torch.full_like(recv_idx, -1))
    recv_x = (recv_x, recv_sf) if sf is not None else recv_x
    return recv_x, recv_idx, recv_w, recv_src, torch.tensor(recv_list, dtype=torch.int)


def generate_pre_combine_data(src_token_global_idx: torch.Tensor, num_max_tokens_per_rank: int,
                              num_topk: int, hidden: int) -> torch.Tensor:
    """A deterministic expert output for each (token, slot): y[i, j, k] = sin((s * 131071 %
    m + 1) / m * (k + 1) + sin(seed)) in bfloat16, with s = src_token_global_idx[i] * num_topk
    + j, m = world size * num_max_tokens_per_rank * num_topk and seed the global seed, so the
    ranks that hold a token's experts and its home compute the same rows independently.
    Returns [num_tokens, num_topk, hidden]."""
    modulus = dist.get_world_size() * num_max_tokens_per_rank * num_topk
    seeds = src_token_global_idx.long().unsqueeze(1) * num_topk + torch.arange(num_topk).unsqueeze(0)
    phase = ((seeds * 131071 % modulus).float() + 1) / modulus
    channels = torch.arange(1, hidden + 1, dtype=torch.float32)
    y = torch.sin(phase.unsqueeze(-1) * channels + math.sin(float(get_global_seed())))
    return y.to(torch.bfloat16)


def ordered_accumulate(data: torch.Tensor, initial_value: Optional[torch.Tensor] = None) -> torch.Tensor:
    """data [T, K, H]: fp32 acc = initial_value (or 0), then += data[:, j] for j ascending;
    rounded once to data's dtype."""
    acc = torch.zeros((data.size(0), data.size(2)), dtype=torch.float32) if initial_value is None \
        else initial_value.float().clone()
    for j in range(data.size(1)):
        acc += data[:, j].float()
    return acc.to(data.dtype)


def _group_partials(y: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """For each token, the slots with the same group id are summed (fp32 from 0, slot order)
    and rounded to y's dtype; the sum sits at the group's last slot, the group's other slots
    become 0. y [T, K, H], group [T, K]."""
    T, K, H = y.shape
    out = torch.zeros_like(y)
    for last in range(K):
        later = group[:, last + 1:] == group[:, last:last + 1] if last + 1 < K else \
            torch.zeros((T, 0), dtype=torch.bool)
        is_last = ~later.any(dim=1)
        acc = torch.zeros((T, H), dtype=torch.float32)
        for j in range(last + 1):
            member = (group[:, j] == group[:, last]).unsqueeze(1)
            acc += torch.where(member, y[:, j].float(), torch.zeros(()))
        out[:, last] = torch.where(is_last.unsqueeze(1), acc.to(y.dtype), torch.zeros((), dtype=y.dtype))
    return out


def combine(y: torch.Tensor, topk_idx: torch.Tensor, num_scaleout_ranks: int, num_scaleup_ranks: int,
            num_experts: int, bias: Optional[Union[Tuple[torch.Tensor, torch.Tensor], torch.Tensor]],
            reduce_in_local: bool, reduce_in_scaleup: bool) -> torch.Tensor:
    """The combined rows [T, H] of y [T, K, H] (the expert outputs of each token's slots, 0 for
    slots with topk_idx -1) under one of the recipes in the module docstring."""
    assert reduce_in_local or not reduce_in_scaleup, 'scale-up reduction needs the local one'
    per_rank = num_experts // (num_scaleout_ranks * num_scaleup_ranks)
    if reduce_in_local:
        y = _group_partials(y, torch.div(topk_idx, per_rank, rounding_mode='floor'))
    if reduce_in_scaleup:
        y = _group_partials(y, torch.div(topk_idx, per_rank * num_scaleup_ranks, rounding_mode='floor'))
    if isinstance(bias, tuple):
        start = bias[0].float() + bias[1].float()
    else:
        start = bias.float() if bias is not None else None
    return ordered_accumulate(y, start)
