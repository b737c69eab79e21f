"""The three worlds side by side: dispatch + combine through moed's C++ API loop (no Python
per iteration) in the threads world (moed.launch), the MPI world (mpirun, moed.init) and the
gloo world (torch.multiprocessing.spawn + init_process_group("gloo"), moed.from_torch), same
shapes, same run, rounds interleaved so that load from elsewhere hits every world alike.

    python3 bench/python/bench_worlds.py --shape decode --ranks 4
    python3 bench/python/bench_worlds.py --shape mixtral --ranks 4 --iters 5 --json
    python3 bench/python/bench_worlds.py --peers --shape mixtral --ranks 4 --iters 20

--peers: the gloo world's processes only, each iteration Megatron-Core's AlltoAll algorithm
written on torch's own gloo all_to_all_single (permute, counts all-gathered, rows all-to-all-v,
chunks sorted by local expert; the way back: unsorted, all-to-all-v, unpermuted by scatter_add)
beside moed's AlltoAll and Flex through moed.megatron, same routing, order alternating. Every
iteration's rows and combined tokens are compared bitwise (fp32: Megatron's scatter_add adds a
token's rows in expert order from zero, moed's order); the figure is the median over rank 0's
iterations of dispatch + combine, and each moed dispatcher's ratio to torch's.

Figures: per world and dispatcher, the median over every round's iterations of rank 0's time
for dispatch + combine (one node: every rank on this host). gloo / MPI is the median over rounds
of each round's ratio of medians (the two worlds ran back to back in that round), with its 95%
interval (bootstrap over the rounds, stats.py) and the verdict against the target of issue 17,
within 10% of MPI: met (the whole interval at or below 1.10), missed, or undecided.
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile

import torch

import moed
from stats import median_ci, verdict

SHAPES = {"tiny": (64, 256, 8, 2), "mixtral": (2048, 4096, 8, 2), "dsv3": (4096, 7168, 256, 8),
          "decode": (128, 7168, 256, 8)}
HERE = os.path.abspath(__file__)


def body(group, shape, kinds, iters, warmup):
    from moed import _C
    T, H, E, K = SHAPES[shape]
    E = max(E, group.size()) // group.size() * group.size()
    g = torch.Generator().manual_seed(7 + group.rank())
    topv, topi = torch.randn(T, E, generator=g).topk(K, dim=1)
    rmap = torch.zeros(T, E, dtype=torch.bool).scatter_(1, topi, True)
    probs = torch.zeros(T, E).scatter_(1, topi, torch.softmax(topv, 1))
    x = torch.randn(T, H, generator=g).bfloat16()
    res = {}
    for kind in kinds:
        c = _C.TokenDispatcher(group.handle, _C.DispatchConfig(kind=kind, num_experts=E))
        res[kind] = list(c._bench_cpp(x, rmap, probs, K, iters, warmup))
        c.close()
    return res


def gloo_rank(rank, size, port, args, out):
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size)
    g = moed.from_torch(timeout=300, threads_per_rank=1)
    res = body(g, *args)
    if rank == 0:
        torch.save(res, out)
    moed.dist.destroy_process_group(dist.group.WORLD)
    dist.destroy_process_group()


def torch_alltoall_dispatch(x, rmap, pg, R):
    """Megatron-Core's AlltoAll dispatch (ep = R, tp = 1) on torch.distributed: the expert-major
    rows this rank's experts get, and what the combine needs."""
    import torch.distributed as dist
    T, E = rmap.shape
    L = E // R
    me = dist.get_rank(pg)
    per_expert = rmap.sum(0)                                        # [E]
    counts = [torch.empty_like(per_expert) for _ in range(R)]
    dist.all_gather(counts, per_expert, group=pg)                    # Megatron: the gather of counts
    counts = torch.stack(counts)[:, me * L:(me + 1) * L]             # [R, L] rows for my experts
    sorted_idx = torch.arange(T).expand(E, T).masked_select(rmap.t().contiguous())  # permute
    rows = x.index_select(0, sorted_idx)
    in_splits = per_expert.view(R, L).sum(1).tolist()
    out_splits = counts.sum(1).tolist()
    got = rows.new_empty(sum(out_splits), x.size(1))
    dist.all_to_all_single(got, rows, out_splits, in_splits, group=pg)
    chunks = got.split(counts.reshape(-1).tolist())                 # rank-major chunks
    expert_major = torch.cat([chunks[r * L + j] for j in range(L) for r in range(R)])
    return expert_major, dict(counts=counts, sorted_idx=sorted_idx, in_splits=in_splits,
                              out_splits=out_splits, T=T, L=L)


def torch_alltoall_combine(y, st, pg, R):
    """Megatron-Core's AlltoAll combine: chunks back to rank-major, all-to-all-v, and the rows
    of each token summed by scatter_add (unweighted: the experts applied the probs)."""
    import torch.distributed as dist
    L, counts = st["L"], st["counts"]
    chunks = y.split(counts.t().reshape(-1).tolist())               # expert-major chunks
    rank_major = torch.cat([chunks[j * R + r] for r in range(R) for j in range(L)])
    back = y.new_empty(sum(st["in_splits"]), y.size(1))
    dist.all_to_all_single(back, rank_major, st["in_splits"], st["out_splits"], group=pg)
    out = y.new_zeros(st["T"], y.size(1))
    return out.scatter_add_(0, st["sorted_idx"][:, None].expand(-1, y.size(1)), back)


def peers_rank(rank, size, port, a, out):
    """--peers: torch's gloo AlltoAll (Megatron's algorithm) against moed's, in these processes."""
    import time
    import torch.distributed as dist
    from moed.megatron import make_dispatcher
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size)
    pg = dist.group.WORLD
    g = moed.from_torch(pg, timeout=300, threads_per_rank=1)
    T, H, E, K = SHAPES[a.shape]
    E = max(E, size) // size * size
    L = E // size
    gen = torch.Generator().manual_seed(7 + rank)
    topv, topi = torch.randn(T, E, generator=gen).topk(K, dim=1)
    rmap = torch.zeros(T, E, dtype=torch.bool).scatter_(1, topi, True)
    probs = torch.zeros(T, E).scatter_(1, topi, torch.softmax(topv, 1))
    x = torch.randn(T, H, generator=gen)
    scale = torch.tensor([1.0 + (rank * L + j) / 8.0 for j in range(L)])

    def experts(rows, tpe):
        return rows * torch.repeat_interleave(scale, tpe)[:, None]

    def torch_step():
        rows, st = torch_alltoall_dispatch(x, rmap, pg, size)
        return rows, torch_alltoall_combine(experts(rows, st["counts"].sum(0)), st, pg, size)

    dispatchers = {k: make_dispatcher(k, group=g, num_moe_experts=E, moe_router_topk=K)
                   for k in ("alltoall", "flex")}

    def moed_step(d):
        h, p = d.dispatch_preprocess(x, rmap, probs)
        rows, tpe, _ = d.dispatch_postprocess(*d.token_dispatch(h, p))
        y = experts(rows, tpe)
        return rows, d.combine_postprocess(d.token_combine(d.combine_preprocess(y)))

    steps = dict(torch=torch_step, **{k: (lambda d=d: moed_step(d)) for k, d in dispatchers.items()})
    times = {k: [] for k in steps}
    same = True
    for i in range(a.warmup + a.iters):
        order = list(steps) if i % 2 == 0 else list(reversed(steps))
        res = {}
        for k in order:
            dist.barrier(pg)
            t0 = time.perf_counter()
            res[k] = steps[k]()
            if i >= a.warmup:
                times[k].append(time.perf_counter() - t0)
        for k in dispatchers:
            same &= torch.equal(res[k][0], res["torch"][0]) and torch.equal(res[k][1], res["torch"][1])
    flags = torch.tensor([int(same)])
    dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=pg)
    if rank == 0:
        torch.save(dict(times=times, bitwise=bool(flags.item())), out)
    for d in dispatchers.values():
        d.close()
    moed.dist.destroy_process_group(pg)
    dist.destroy_process_group()


def run_peers(a):
    fd, out = tempfile.mkstemp(suffix=".pt")
    os.close(fd)
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        torch.multiprocessing.spawn(peers_rank, nprocs=a.ranks, args=(a.ranks, port, a, out))
        res = torch.load(out)
    finally:
        os.remove(out)
    med = {k: statistics.median(v) * 1e6 for k, v in res["times"].items()}
    ratio = {k: med[k] / med["torch"] for k in ("alltoall", "flex")}
    if a.json:
        print(json.dumps(dict(shape=a.shape, ranks=a.ranks, iters=a.iters, median_us=med,
                              moed_over_torch=ratio, bitwise=res["bitwise"])))
        return 0 if res["bitwise"] else 1
    print(f"{a.shape}, {a.ranks} gloo processes, dispatch + combine through Python, median us of "
          f"rank 0 over {a.iters} iterations; every iteration's outputs bitwise equal: "
          f"{res['bitwise']}")
    print(f"{'torch gloo (Megatron AlltoAll)':34}{med['torch']:12.1f}")
    for k in ("alltoall", "flex"):
        print(f"{'moed ' + k:34}{med[k]:12.1f}   {ratio[k]:.3f} of torch's")
    if not res["bitwise"]:
        sys.exit("moed's rows or combined tokens differ from torch's")


def run_world(world, a, kinds):
    args = (a.shape, kinds, a.iters, a.warmup)
    if world == "threads":
        return moed.launch(body, a.ranks, *args, threads_per_rank=1)[0]
    fd, out = tempfile.mkstemp(suffix=".pt")
    os.close(fd)
    try:
        if world == "gloo":
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            torch.multiprocessing.spawn(gloo_rank, nprocs=a.ranks, args=(a.ranks, port, args, out))
        else:
            env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
            subprocess.run(["mpirun", "--oversubscribe", "--bind-to", "none", "-np", str(a.ranks),
                            sys.executable, HERE, "--mpi-child", out, "--shape", a.shape,
                            "--kinds", ",".join(kinds), "--iters", str(a.iters), "--warmup",
                            str(a.warmup)], check=True, env=env)
        return torch.load(out)
    finally:
        os.remove(out)


def main():
    ap = argparse.ArgumentParser(description="moed worlds side by side (threads, MPI, gloo)")
    ap.add_argument("--shape", default="decode", choices=sorted(SHAPES))
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--kinds", default="allgather,alltoall,flex")
    ap.add_argument("--worlds", default="threads,mpi,gloo")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--mpi-child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--peers", action="store_true",
                    help="torch's gloo all_to_all_single (Megatron's AlltoAll) vs moed's, gloo only")
    a = ap.parse_args()
    kinds = a.kinds.split(",")
    torch.set_num_threads(1)
    if a.peers:
        sys.exit(run_peers(a))
    if a.mpi_child:
        g = moed.init(timeout=300, threads_per_rank=1)
        res = body(g, a.shape, kinds, a.iters, a.warmup)
        if g.rank() == 0:
            torch.save(res, a.mpi_child)
        return
    worlds = a.worlds.split(",")
    times = {w: {k: [] for k in kinds} for w in worlds}
    round_med = {w: {k: [] for k in kinds} for w in worlds}
    for _ in range(a.rounds):
        for w in worlds:
            for k, t in run_world(w, a, kinds).items():
                times[w][k] += t
                round_med[w][k].append(statistics.median(t))
    med = {w: {k: statistics.median(v) * 1e6 for k, v in times[w].items()} for w in worlds}
    both = "gloo" in worlds and "mpi" in worlds
    ratio = {}
    if both:
        for k in kinds:
            r, lo, hi = median_ci([g / m for g, m in zip(round_med["gloo"][k], round_med["mpi"][k])])
            ratio[k] = dict(gloo_vs_mpi=r, ci=[lo, hi], verdict=verdict(lo, hi, 1.10))
    if a.json:
        print(json.dumps(dict(shape=a.shape, ranks=a.ranks, rounds=a.rounds, median_us=med,
                              gloo_vs_mpi=ratio)))
        return
    print(f"{a.shape}, {a.ranks} ranks on one node, dispatch + combine, median us of rank 0, "
          f"{a.rounds} rounds")
    print(f"{'kind':10}" + "".join(f"{w:>12}" for w in worlds) +
          (f"  {'gloo/mpi [95%]':>22}  verdict (<= 1.10)" if both else ""))
    for k in kinds:
        line = f"{k:10}" + "".join(f"{med[w][k]:12.1f}" for w in worlds)
        if both:
            r = ratio[k]
            line += f"  {r['gloo_vs_mpi']:6.3f} [{r['ci'][0]:.3f}, {r['ci'][1]:.3f}]  {r['verdict']}"
        print(line)

if __name__ == "__main__":
    main()
