"""Shared fixtures for the moed Python suite: worlds to parametrize over and routing makers."""
import pytest
import torch

import moed

# (num_ranks, ranks_per_node): 1, 2, 3, 4, 8 ranks on one node, and 2 emulated nodes.
WORLDS = [(1, 0), (2, 0), (3, 0), (4, 0), (8, 0), (4, 2)]
WORLD_IDS = [f"R{r}" + (f"_G{g}" if g else "") for r, g in WORLDS]


def world_params():
    return pytest.mark.parametrize("world", WORLDS, ids=WORLD_IDS)


def run(fn, world, *args, timeout=60.0):
    R, G = world
    return moed.launch(fn, R, *args, ranks_per_node=G, timeout=timeout, threads_per_rank=1)


def make_routing(seed, T, E, K, skew=False):
    """Random top-K routing of T tokens over E experts: (routing_map bool, probs f32, topk_idx)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g)
    if skew:
        logits[:, 0] += 3.0
    topv, topi = logits.topk(K, dim=1)
    w = torch.softmax(topv, dim=1)
    rmap = torch.zeros(T, E, dtype=torch.bool).scatter_(1, topi, True)
    probs = torch.zeros(T, E).scatter_(1, topi, w)
    return rmap, probs, topi
