"""Redundant experts (EPLB-style placement, as DeepSeek's EPLB, vLLM and SGLang use them).

Each logical expert has one or more physical replicas, given by the caller; physical expert p
lives on rank p // num_local_experts of the low-latency buffer (num_experts = num_physical).
route() turns logical top-k ids into physical ones, deterministically: slot (t, k) of logical
expert e with replicas r_0..r_{n-1} takes r_{(t + k) % n}, or, when that replica's rank is
masked, the next one in cyclic order whose rank is not. With no live replica the slot is -1
and counted in ``lost``. Pass the logical ids as the combine's ``order`` so the sum does not
depend on which replica served a slot: with a replica left of every expert, a lost rank
changes no bit of the output::

    replicas = moed.ExpertReplicas([[0, 4], [1, 5], [2, 6], [3, 7]], num_physical=8, num_ranks=4)
    mask = torch.zeros(4, dtype=torch.int)
    buffer.low_latency_query_mask_buffer(mask)
    physical, lost = replicas.route(logical_topk_idx, mask)
    recv_x, count, handle, _, _ = buffer.low_latency_dispatch(x, physical, M, 8, use_fp8=False)
    y = experts(recv_x)                     # every replica of e computes logical expert e
    out, _, _ = buffer.low_latency_combine(y, physical, topk_weights, handle,
                                           order=logical_topk_idx)
"""
import torch

from . import _C


class ExpertReplicas:
    """The map from logical experts to their physical replicas (moed/replicas.h)."""

    def __init__(self, replicas, num_physical, num_ranks):
        self._map = _C.ExpertReplicas([[int(p) for p in r] for r in replicas], int(num_physical),
                                      int(num_ranks))
        self.num_ranks = int(num_ranks)

    @property
    def num_logical(self):
        return self._map.num_logical

    @property
    def num_physical(self):
        return self._map.num_physical

    def replicas(self, logical):
        return self._map.replicas(int(logical))

    def route(self, topk_idx, mask_status=None):
        """(physical topk_idx [T, K] int64, lost slots) for logical topk_idx [T, K] (-1 =
        none); mask_status [num_ranks] (nonzero = masked; None = none masked)."""
        masked = [] if mask_status is None else [int(v) for v in torch.as_tensor(mask_status).tolist()]
        return self._map.route(topk_idx, masked)
