"""What the processes of test_gloo.py run: torch.multiprocessing.spawn starts them, each joins
a torch.distributed gloo group and runs one scenario over moed's gloo world, then saves what it
got (or the error it raised) to <out>/<rank>.pt for the test to compare. Not a test module."""
import os
import signal
import sys
import time

import torch
import torch.distributed as dist


def _dispatchers(g, pg):
    from test_megatron import LAYOUTS, body, dispatch_out_body, held_output_body
    import moed
    out = {}
    for kind in ("allgather", "alltoall", "flex"):
        out[kind] = body(g, kind, 40, 2, torch.float32, LAYOUTS["cap1_probs"], True, False, False)
        out[kind + "_bf16"] = body(g, kind, 24, 1, torch.bfloat16, LAYOUTS["dropless"], False,
                                   True, True)
        # Into a caller's tensor; a wrong one on the last rank is every rank's ValueError.
        ok, errors, _ = dispatch_out_body(g, kind, torch.float32, 0, False)
        assert all(ok) and len(errors) == 1 and f"rank {g.size() - 1}: out is" in errors[0], \
            (ok, errors)
        assert held_output_body(g, kind), kind  # and outlives its dispatcher
    # The dispatchers take the torch group itself, and reach the same moed world.
    d = moed.megatron.make_dispatcher("alltoall", group=pg, num_moe_experts=2 * g.size(),
                                      moe_router_topk=1)
    assert d.group is g
    return out


def _deep_ep(g, pg):
    import moed.deep_ep as deep_ep
    import test_deep_ep as cases
    # Buffer(group) with the torch group: `group` stays the object passed (Megatron-Core keeps
    # its buffer only while buffer.group == group), moed's world is the same.
    buffer = deep_ep.Buffer(pg, int(1e9))
    assert buffer.group is pg and buffer.group_size == g.size() and buffer.rank == g.rank()
    assert cases.case_normal(g, 8, 2, 100, 11)
    assert cases.case_normal(g, 8, 8, 36, 12)
    assert cases.case_normal(g, 8, 3, 100, 3, 64, 4)
    assert cases.case_fp8(g, 11)
    assert cases.case_held_recv(g, 8, 2, 64, 21)
    for mode in ("bf16", "bf16_hook", "fp8_round_hook", "ue8m0"):
        use_fp8 = mode.startswith("fp8") or mode == "ue8m0"
        assert cases.case_low_latency(g, 6, 512, 8, 3, 9, use_fp8, use_fp8, mode == "ue8m0",
                                      mode.endswith("hook"))
    # DeepEP V2's ElasticBuffer, both layouts, and the Megatron-shaped client with the torch
    # group itself (Megatron compares buffer.group with it).
    import test_clients
    import test_elastic
    test_elastic.case_elastic(g, 8, 3, 256, 5, False, 1, None, True, True, True, 2)
    test_elastic.case_elastic(g, 8, 3, 256, 6, True, 4, "col", True, False, True, 1)
    for v2 in (False, True):
        worst, buffers, kept = test_clients.case_megatron(pg, v2)
        assert worst < 1e-5 and buffers == 1 and kept, (v2, worst, buffers, kept)
    return True


def _dist(g, pg):
    import moed
    r, R = g.rank(), g.size()
    t = torch.full((5,), float(r) + 0.25)
    moed.dist.all_reduce(t, group=pg)
    parts = [torch.empty(2, dtype=torch.int64) for _ in range(R)]
    moed.dist.all_gather(parts, torch.tensor([r, -r]), group=pg)
    b = torch.arange(3.0) if r == R - 1 else torch.zeros(3)
    moed.dist.broadcast(b, src=R - 1)  # group=None: torch's default group
    assert moed.dist.get_rank() == r and moed.dist.get_world_size(pg) == R
    return dict(sum=t, parts=parts, bcast=b)


def scenario_all(g, pg, rank):
    return dict(dist=_dist(g, pg), deep_ep=_deep_ep(g, pg), dispatchers=_dispatchers(g, pg))


def large_inputs(r):
    """Rank r's tensors for scenario_large (the test rebuilds them to check the results)."""
    g = torch.Generator().manual_seed(300 + r)
    return dict(red=[torch.randn(n, generator=g) for n in (5, 300_001, 1_000_003)],
                part=torch.randn(7 + 4099 * r, generator=g),
                bcast=torch.randn(524_289, generator=g))


def scenario_large(g, pg, rank):
    """Payloads past the host's 16 KiB collective slots and the first 1 MiB staging segment,
    odd sizes, a rank with no tokens (tokens_of(1) == 0), hidden not a multiple of 16."""
    from test_megatron import LAYOUTS, body
    import moed
    R = g.size()
    ins = large_inputs(rank)
    sums = []
    for t in ins["red"]:
        t = t.clone()
        moed.dist.all_reduce(t, group=pg)
        sums.append(t)
    # all_gather_v with a different size per rank (zero-padded to one shape for moed.dist).
    n = 7 + 4099 * (R - 1)
    part = torch.zeros(n)
    part[:ins["part"].numel()] = ins["part"]
    parts = [torch.empty(n) for _ in range(R)]
    moed.dist.all_gather(parts, part, group=pg)
    b = ins["bcast"].clone()
    moed.dist.broadcast(b, src=R - 1, group=pg)
    disp = {kind: body(g, kind, 20_001, 2, torch.float32, LAYOUTS["dropless"], True, False, True)
            for kind in ("allgather", "alltoall", "flex")}
    return dict(sums=sums, parts=parts, bcast=b, dispatchers=disp)


def _until_error(g, rank, fault):
    """Dispatches until the world fails; rank 1 causes the fault after a few steps."""
    import moed.deep_ep as deep_ep
    import test_deep_ep as cases
    xs, idxs, ws = cases.make_inputs(g.size(), 8, 2, 64, 5)
    buffer = deep_ep.Buffer(g, int(1e9))
    for step in range(10 ** 6):
        if rank == 1 and step == 3:
            fault()
        layout = buffer.get_dispatch_layout(idxs[rank], 8)
        recv = buffer.dispatch(xs[rank], topk_idx=idxs[rank], topk_weights=ws[rank],
                               num_tokens_per_rank=layout[0], num_tokens_per_rdma_rank=layout[1],
                               is_token_in_rank=layout[3], num_tokens_per_expert=layout[2])
        buffer.combine(recv[0], recv[4])


def scenario_raise(g, pg, rank):
    def fault():
        raise ValueError("rank 1 gave up on purpose")
    with g:  # an exception leaving the block fails this rank in every other rank's eyes
        _until_error(g, rank, fault)


def scenario_raise_plain(g, pg, rank):
    def fault():
        raise ValueError("rank 1 gave up on purpose")  # no guard: its process just ends
    _until_error(g, rank, fault)


def scenario_kill(g, pg, rank):
    def fault():
        os.kill(os.getpid(), signal.SIGKILL)
    _until_error(g, rank, fault)


def scenario_stall(g, pg, rank):
    def fault():
        os.kill(os.getpid(), signal.SIGSTOP)  # the test kills it once the others are done
    _until_error(g, rank, fault)


def main(rank, size, master, port, scenario, ranks_per_node, timeout, out):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=rank,
                            world_size=size)
    import moed
    pg = dist.group.WORLD
    g = moed.from_torch(pg, ranks_per_node=ranks_per_node, timeout=timeout, threads_per_rank=1)
    t0 = time.monotonic()
    try:
        rec = dict(ok=True, result=globals()["scenario_" + scenario](g, pg, rank))
    except BaseException as e:  # noqa: B902 (the test reads every rank's outcome)
        rec = dict(ok=False, error=f"{type(e).__name__}: {e}")
        if rank == 1 and scenario.startswith("raise"):
            raise
    finally:
        pass
    rec["seconds"] = time.monotonic() - t0
    rec["backend"] = g.backend
    rec["nodes"] = g.num_nodes()
    torch.save(rec, os.path.join(out, f"{rank}.pt"))
    moed.dist.destroy_process_group(pg)
    dist.destroy_process_group()


def main_on_host(local, host, per_host, size, master, port, scenario, ranks_per_node, timeout,
                 out):
    """main() for the `local`-th process of test host `host` (gloo_hosts.py spawns these)."""
    main(host * per_host + local, size, master, port, scenario, ranks_per_node, timeout, out)
