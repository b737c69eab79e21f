"""An MoE layer in PyTorch over moed's Megatron-style dispatchers, trained for a few steps.

Router (a linear layer, softmax top-k), dispatcher (allgather / alltoall / flex), grouped
SwiGLU experts in torch (each rank holds its experts' weights), combine. The router is
replicated: its gradients are summed over the ranks with moed.dist.all_reduce.

    python3 python/examples/moe_layer.py --ranks 4 --kind flex          # 4 rank threads
    mpirun -np 4 python3 python/examples/moe_layer.py --mpi --kind alltoall   # 4 processes
"""
import argparse

import torch

import moed
from moed.megatron import MoEConfig, make_dispatcher


class MoELayer(torch.nn.Module):
    def __init__(self, group, kind, hidden, ffn, num_experts, topk, seed=0):
        super().__init__()
        self.topk = topk
        cfg = MoEConfig(num_moe_experts=num_experts, moe_router_topk=topk)
        self.dispatcher = make_dispatcher(kind, cfg, group=group)
        L = self.dispatcher.num_local_experts
        g = torch.Generator().manual_seed(seed)  # the router is the same on every rank
        self.router = torch.nn.Linear(hidden, num_experts, bias=False)
        with torch.no_grad():
            self.router.weight.copy_(torch.randn(num_experts, hidden, generator=g) / hidden ** 0.5)
        g = torch.Generator().manual_seed(seed + 1 + group.rank())  # this rank's experts
        self.w1 = torch.nn.Parameter(torch.randn(L, hidden, 2 * ffn, generator=g) / hidden ** 0.5)
        self.w2 = torch.nn.Parameter(torch.randn(L, ffn, hidden, generator=g) / ffn ** 0.5)

    def route(self, x):
        scores = torch.softmax(self.router(x), dim=-1)
        topv, topi = scores.topk(self.topk, dim=-1)
        routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, topi, True)
        probs = torch.zeros_like(scores).scatter(1, topi, topv / topv.sum(-1, keepdim=True))
        return routing_map, probs

    def experts(self, x, tokens_per_expert, permuted_probs):
        outs = []
        for j, rows in enumerate(x.split(tokens_per_expert.tolist())):
            a, b = (rows @ self.w1[j]).chunk(2, dim=-1)
            outs.append((torch.nn.functional.silu(a) * b) @ self.w2[j])
        y = torch.cat(outs) if outs else x.new_zeros(0, x.shape[1])
        return y * permuted_probs[:, None]  # probs applied in the experts, as Megatron does

    def forward(self, x):
        d = self.dispatcher
        routing_map, probs = self.route(x)
        h, p = d.dispatch_preprocess(x, routing_map, probs)
        h, p = d.token_dispatch(h, p)
        expert_in, tokens_per_expert, permuted_probs = d.dispatch_postprocess(h, p)
        y = self.experts(expert_in, tokens_per_expert, permuted_probs)
        y = d.combine_preprocess(y)
        y = d.token_combine(y)
        return d.combine_postprocess(y)


def train(group, kind, steps, tokens=64, hidden=32, ffn=48, num_experts=8, topk=2, lr=0.5):
    layer = MoELayer(group, kind, hidden, ffn, num_experts, topk)
    opt = torch.optim.SGD(layer.parameters(), lr=lr)
    # A generator per rank: rank threads share torch's global one.
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(100 + group.rank()))
    target = torch.tanh(x.flip(-1))
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(layer(x), target)
        loss.backward()
        moed.dist.all_reduce(layer.router.weight.grad)  # the replicated router
        layer.router.weight.grad /= group.size()
        opt.step()
        total = loss.detach().clone()
        moed.dist.all_reduce(total)
        losses.append(total.item() / group.size())
    return losses


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4, help="rank threads (ignored with --mpi)")
    ap.add_argument("--ranks-per-node", type=int, default=0, help="emulated nodes of this many ranks")
    ap.add_argument("--kind", default="alltoall", choices=["allgather", "alltoall", "flex"])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--mpi", action="store_true", help="one process per rank (run under mpirun)")
    a = ap.parse_args()
    if a.mpi:
        group = moed.init(ranks_per_node=a.ranks_per_node)
        losses = train(group, a.kind, a.steps)
        rank = group.rank()
    else:
        losses = moed.launch(train, a.ranks, a.kind, a.steps, ranks_per_node=a.ranks_per_node)[0]
        rank = 0
    if rank == 0:
        print(f"moe_layer {a.kind}: loss " + " -> ".join(f"{v:.4f}" for v in losses))


if __name__ == "__main__":
    main()
