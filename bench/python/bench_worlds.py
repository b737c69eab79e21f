"""The three worlds side by side: dispatch + combine through moed's C++ API loop (no Python
per iteration) in the threads world (moed.launch), the MPI world (mpirun, moed.init) and the
gloo world (torch.multiprocessing.spawn + init_process_group("gloo"), moed.from_torch), same
shapes, same run, rounds interleaved so that load from elsewhere hits every world alike.

    python3 bench/python/bench_worlds.py --shape decode --ranks 4
    python3 bench/python/bench_worlds.py --shape mixtral --ranks 4 --iters 5 --json

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
        c = _C.TokenDispatcher(group.handle, kind, E)
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
    a = ap.parse_args()
    kinds = a.kinds.split(",")
    torch.set_num_threads(1)
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
