"""The gloo world: moed inside processes that torch.multiprocessing.spawn started and
torch.distributed joined with a gloo group (gloo_workers.py is what they run). Each result is
compared bitwise with the threads world's (or the reference the threads world matches); faults
(a rank that raises, with and without `with group:`, and a killed process) must end every other
rank with an error naming rank 1, through moed's failure channel rather than its timeout; and
no shared-memory segment may be left in /dev/shm."""
import os
import shutil
import socket
import tempfile
import time

import pytest
import torch

import moed
import gloo_workers

pytestmark = pytest.mark.skipif(not moed._C.has_gloo(), reason="moed built without gloo")

# (processes, ranks_per_node): one node of 2 and 4, and 2 emulated nodes of 2.
WORLDS = [(2, 0), (4, 0), (4, 2)]
WORLD_IDS = ["P2", "P4", "P4_G2"]
TIMEOUT = 60.0  # the world's; faults must be seen long before it


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def segments():
    # The gloo world's (moed-<world id>-...); MPI worlds of other test runs may come and go.
    return {f for f in os.listdir("/dev/shm")
            if f.startswith("moed-") and not f.startswith("moed-mpi-")}


def run_workers(scenario, nprocs, out, budget, ranks_per_node=0, timeout=TIMEOUT, stalled=None,
                meanwhile=None):
    """Runs gloo_workers.main(scenario) in nprocs spawned processes saving into `out`; returns
    (exit codes, records by rank: None where a process saved nothing). Waits at most `budget`
    seconds, then kills. Rank `stalled` is expected to be stopped: it is killed once the others
    have ended. meanwhile(processes, deadline), if given, runs once they are started."""
    ctx = torch.multiprocessing.spawn(
        gloo_workers.main, nprocs=nprocs, join=False,
        args=(nprocs, "127.0.0.1", free_port(), scenario, ranks_per_node, timeout, out))
    deadline = time.monotonic() + budget
    if meanwhile is not None:
        meanwhile(ctx.processes, deadline)
    for r, p in enumerate(ctx.processes):
        if r != stalled:
            p.join(max(0.0, deadline - time.monotonic()))
    if stalled is not None:
        ctx.processes[stalled].kill()
    left = [r for r, p in enumerate(ctx.processes) if p.is_alive() and r != stalled]
    for p in ctx.processes:
        if p.is_alive():
            p.kill()
        p.join()
    assert not left, f"ranks {left} still running after {budget} s"
    recs = []
    for r in range(nprocs):
        path = os.path.join(out, f"{r}.pt")
        recs.append(torch.load(path) if os.path.exists(path) else None)
    return [p.exitcode for p in ctx.processes], recs


def spawn(scenario, nprocs, ranks_per_node=0, budget=240.0, timeout=TIMEOUT, stalled=None):
    """run_workers in a temporary directory of its own."""
    out = tempfile.mkdtemp(prefix="moed-gloo-test-")
    codes, recs = run_workers(scenario, nprocs, out, budget, ranks_per_node, timeout, stalled)
    shutil.rmtree(out)
    return codes, recs


def spawn_ok(scenario, nprocs, ranks_per_node=0):
    """spawn, every rank exiting 0 with its record ok: the records."""
    codes, recs = spawn(scenario, nprocs, ranks_per_node)
    assert codes == [0] * nprocs, (codes, [r and r.get("error") for r in recs])
    for r, rec in enumerate(recs):
        assert rec["ok"], f"rank {r}: {rec['error']}"
    return recs


def threads_dispatchers(R, G):
    from test_megatron import LAYOUTS, body

    def fn(g):
        out = {}
        for kind in ("allgather", "alltoall", "flex"):
            out[kind] = body(g, kind, 40, 2, torch.float32, LAYOUTS["cap1_probs"], True, False, False)
            out[kind + "_bf16"] = body(g, kind, 24, 1, torch.bfloat16, LAYOUTS["dropless"], False,
                                       True, True)
        return out
    return moed.launch(fn, R, ranks_per_node=G, timeout=60.0, threads_per_rank=1)


def equal(a, b, where):
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            equal(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.bfloat16 else a,
                           b.view(torch.uint8) if b.dtype == torch.bfloat16 else b), where
    else:
        assert a == b, where


@pytest.mark.parametrize("world", WORLDS, ids=WORLD_IDS)
def test_matches_threads_world(world):
    R, G = world
    before = segments()
    recs = spawn_ok("all", R, G)
    for rec in recs:
        assert rec["backend"] == "gloo" and rec["nodes"] == (R // G if G else 1)
    want = threads_dispatchers(R, G)
    for r, rec in enumerate(recs):
        res = rec["result"]
        equal(res["dispatchers"], want[r], f"rank {r} dispatchers")
        d = res["dist"]
        assert torch.equal(d["sum"], torch.full((5,), sum(float(s) + 0.25 for s in range(R))))
        assert [p.tolist() for p in d["parts"]] == [[s, -s] for s in range(R)]
        assert d["bcast"].tolist() == [0.0, 1.0, 2.0]
    assert segments() == before


@pytest.mark.parametrize("world", [(2, 0), (4, 2)], ids=["P2", "P4_G2"])
def test_results_are_the_callers(world):
    """test_ownership.py's reproductions (held low-latency results, results read after their
    Buffer is gone, a zero-copy buffer outliving its Buffer) in gloo processes."""
    R, G = world
    before = segments()
    spawn_ok("ownership", R, G)
    assert segments() == before


@pytest.mark.parametrize("single_copy", [None, "1"], ids=["default", "in_place"])
def test_large_payloads_through_shared_memory(single_copy, monkeypatch):
    """3 processes on one host: the data phases go through the staging segments (grown twice),
    bitwise equal to rank-order fp32 sums and to the threads world; nothing left in /dev/shm.
    in_place: every writer is read in place (MOED_GLOO_SINGLE_COPY=1), and the all-gathers
    whose blocks are all non-empty go round the ring."""
    from test_megatron import LAYOUTS, body
    if single_copy is not None:
        monkeypatch.setenv("MOED_GLOO_SINGLE_COPY", single_copy)
    R = 3
    before = segments()
    recs = spawn_ok("large", R)
    ins = [gloo_workers.large_inputs(r) for r in range(R)]
    want = moed.launch(lambda g: {kind: body(g, kind, 20_001, 2, torch.float32,
                                             LAYOUTS["dropless"], True, False, True)
                                  for kind in ("allgather", "alltoall", "flex")},
                       R, timeout=60.0, threads_per_rank=1)
    for r, rec in enumerate(recs):
        res = rec["result"]
        for i, got in enumerate(res["sums"]):
            acc = torch.zeros_like(got)
            for s in range(R):
                acc += ins[s]["red"][i]
            assert torch.equal(got, acc), (r, i)
        for s in range(R):
            p = ins[s]["part"]
            got = res["parts"][s]
            assert torch.equal(got[:p.numel()], p) and not got[p.numel():].any(), (r, s)
        assert torch.equal(res["bcast"], ins[R - 1]["bcast"])
        equal(res["dispatchers"], want[r], f"rank {r} dispatchers")
    assert segments() == before


def test_groups_of_new_group_and_device_mesh():
    """moed.from_torch over torch's subgroups: new_group's, and on torch 2.x the groups of a
    2 x 2 device_mesh (init_device_mesh("cpu", ...)); each 2-rank world gives the threads
    world's bits."""
    before = segments()
    recs = spawn_ok("groups", 4)
    want = moed.launch(gloo_workers.subgroup_body, 2, timeout=60.0, threads_per_rank=1)
    names = ["new_group"] + (["mesh_ep", "mesh_dp"] if int(torch.__version__.split(".")[0]) >= 2 else [])
    for r, rec in enumerate(recs):
        assert list(rec["result"]) == names
        for name, got in rec["result"].items():
            equal(got["result"], want[got["rank"]], f"rank {r} {name}")
    assert segments() == before


@pytest.mark.skipif(not hasattr(torch, "compile"), reason="torch.compile is torch 2's")
def test_compiled_caller():
    """torch.compile'd code that calls moed (graph breaks at each call) gives the eager bits,
    on 2 gloo processes (compiling is per process: Dynamo is not for concurrent threads)."""
    spawn_ok("compile", 2)


@pytest.mark.parametrize("scenario", ["raise", "raise_plain", "kill"])
def test_fault_ends_every_rank(scenario):
    R = 4
    before = segments()
    codes, recs = spawn(scenario, R, 2)
    assert codes[1] != 0, codes  # rank 1 raised or was killed
    for r in (0, 2, 3):
        assert codes[r] == 0 and recs[r] is not None, (r, codes)
        err = recs[r]["error"] if not recs[r]["ok"] else "no error"
        # Named, and through the failure channel: not a timeout ("waited N ms").
        assert err.startswith("AbortedError") and "rank 1" in err, (r, err)
        assert "waited" not in err, (r, err)
        if scenario == "raise":
            assert "rank 1 gave up on purpose" in err, (r, err)
    assert segments() == before


def test_stopped_rank_ends_every_other_rank_within_the_timeout():
    """Rank 1 stops (SIGSTOP) mid-dispatch: nothing waits without a bound, so every other rank
    ends with an error soon after the world's timeout (3 s): the rank whose wait ran out first
    a RuntimeError (deadline exceeded), the others AbortedError naming that rank. The first
    wait to run out may be on a live rank that itself waits for rank 1, so the message names
    a timeout, not necessarily rank 1."""
    R, timeout = 4, 3.0
    before = segments()
    codes, recs = spawn("stall", R, budget=120.0, timeout=timeout, stalled=1)
    for r in (0, 2, 3):
        assert codes[r] == 0 and recs[r] is not None, (r, codes)
        err = recs[r]["error"] if not recs[r]["ok"] else "no error"
        assert err.split(":")[0] in ("AbortedError", "RuntimeError"), (r, err)
        assert "waited" in err and "timeout 3000 ms" in err, (r, err)
        assert recs[r]["seconds"] < 60.0, (r, recs[r]["seconds"])
    assert segments() == before
