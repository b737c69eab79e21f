"""deep_ep.utils.gate for moed's DeepEP on CPU: router scores for tests, balanced or with one
rank receiving about `ratio` times the tokens of the others."""
import torch


def _scores(num_tokens: int, num_experts: int, num_ranks: int, boost: float) -> torch.Tensor:
    """Uniform scores, rank 0's experts drawn from [0, boost) instead of [0, 1)."""
    scores = torch.rand((num_tokens, num_experts), dtype=torch.float32)
    scores[:, :num_experts // num_ranks] *= boost
    return scores


def _rank0_ratio(scores: torch.Tensor, num_ranks: int, num_topk: int) -> float:
    """Tokens rank 0 receives over the mean of the other ranks' (a token counts once per rank)."""
    per_rank = scores.size(1) // num_ranks
    ranks = scores.topk(num_topk, dim=1).indices // per_rank
    hit = torch.zeros((scores.size(0), num_ranks), dtype=torch.bool).scatter_(1, ranks, True)
    counts = hit.sum(dim=0).double()
    return (counts[0] / counts[1:].mean().clamp(min=1)).item() if num_ranks > 1 else 1.0


def get_unbalanced_scores(num_tokens: int, num_experts: int, num_ranks: int, num_topk: int,
                          ratio: float, precise: bool = False) -> torch.Tensor:
    """[num_tokens, num_experts] float32 scores. ratio = 1: balanced in expectation. ratio > 1:
    rank 0's experts are boosted until rank 0 receives about `ratio` times the tokens of the
    others (a bisection on the boost; with precise the bisection runs longer, so the ratio is
    met more closely)."""
    assert ratio >= 1.0, 'ratio must be no less than 1.0'
    if ratio == 1.0 or num_ranks == 1:
        return _scores(num_tokens, num_experts, num_ranks, 1.0)
    lo, hi = 1.0, 100.0
    for _ in range(40 if precise else 20):
        mid = (lo + hi) / 2
        if _rank0_ratio(_scores(num_tokens, num_experts, num_ranks, mid), num_ranks, num_topk) > ratio:
            hi = mid
        else:
            lo = mid
    return _scores(num_tokens, num_experts, num_ranks, lo)
