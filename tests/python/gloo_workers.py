"""What the processes of test_gloo.py run: torch.multiprocessing.spawn starts them, each joins
a torch.distributed gloo group and runs one scenario over moed's gloo world, then saves what it
got (or the error it raised) to <out>/<rank>.pt for the test to compare. Not a test module."""
import os
import signal
import subprocess
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


def scenario_ownership(g, pg, rank):
    """test_ownership.py's reproductions in gloo processes, as many runs each as it has: RUNS
    in a world of 2, 5 in larger ones."""
    import test_ownership as cases
    runs = cases.RUNS if g.size() == 2 else 5
    assert cases.case_held_low_latency(g, runs, False, False)
    assert cases.case_held_low_latency(g, 5, True, True)
    for destroy in (True, False):
        assert cases.case_outlive_buffer(g, runs, destroy) == [True] * runs
    assert cases.case_zero_copy_outlives_buffer(g, runs)
    return True


def scenario_all(g, pg, rank):
    return dict(dist=_dist(g, pg), deep_ep=_deep_ep(g, pg), dispatchers=_dispatchers(g, pg))


def subgroups():
    """(name, torch group) of this process for scenario_groups (4 processes): new_group's
    halves {0, 2} / {1, 3}, and on torch 2.x device_mesh's rows and columns of a 2 x 2 mesh."""
    rank = dist.get_rank()
    halves = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # every rank makes both
    groups = [("new_group", halves[rank % 2])]
    if int(torch.__version__.split(".")[0]) >= 2:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
        groups += [("mesh_ep", mesh.get_group("ep")), ("mesh_dp", mesh.get_group("dp"))]
    return groups


def subgroup_body(g):
    """What scenario_groups runs on each 2-rank group (and the test on 2 rank threads): Flex
    in bf16 and the legacy Buffer in bf16 and fp8, each checked inside against the reference;
    the Flex results come back for a bitwise comparison with the threads world's."""
    from test_megatron import LAYOUTS, body
    import test_deep_ep as cases
    flex = body(g, "flex", 24, 1, torch.bfloat16, LAYOUTS["dropless"], False, True, True)
    assert cases.case_normal(g, 8, 2, 100, 11) and cases.case_fp8(g, 11)
    return flex


def scenario_groups(g, pg, rank):
    import moed
    from moed import _world
    out = {}
    for name, sub in subgroups():
        sg = moed.from_torch(sub, timeout=60.0, threads_per_rank=1)
        assert sg.size() == 2 and sg.rank() == dist.get_rank(sub), (name, sg.rank())
        _world._local.group = sg  # what the dispatchers' default group resolves to here
        try:
            out[name] = dict(rank=sg.rank(), result=subgroup_body(sg))
        finally:
            _world._local.group = None
        moed.dist.destroy_process_group(sub)
    return out


def compiled_layer(d, buffer, x, rmap, probs, topk_idx, topk_weights, E):
    """An MoE-shaped caller of moed's calls (Megatron's six steps and DeepEP's Buffer) with torch
    ops around them, for torch.compile: every moed call is a graph break."""
    h = x * 2
    h, p = d.dispatch_preprocess(h, rmap, probs)
    h, p = d.token_dispatch(h, p)
    ei, _, _ = d.dispatch_postprocess(h, p)
    y = d.combine_postprocess(d.token_combine(d.combine_preprocess(ei * 0.5 + 1)))
    ntpr, _, ntpe, itir, _ = buffer.get_dispatch_layout(topk_idx, E)
    recv_x, _, recv_w, _, handle, _ = buffer.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=itir,
                                                      num_tokens_per_expert=ntpe, topk_idx=topk_idx,
                                                      topk_weights=topk_weights)
    z, _, _ = buffer.combine(recv_x.float().mul(3).to(x.dtype), handle)
    return y.float() + z.float()


def scenario_compile(g, pg, rank):
    """The same layer eager and torch.compile'd (backends eager and aot_eager; twice each, the
    second call from the compiled code): the compiled results are the eager ones, bit for bit."""
    import moed
    import moed.deep_ep as deep_ep
    from moed.megatron import MoEConfig, make_dispatcher
    from conftest import make_routing
    E, K, H = 2 * g.size(), 2, 64
    rmap, probs, topk_idx = make_routing(70 + rank, 5 + 3 * rank, E, K)
    x = torch.randn(rmap.size(0), H, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
    topk_weights = torch.rand(topk_idx.shape, generator=torch.Generator().manual_seed(9 + rank))
    d = make_dispatcher("flex", MoEConfig(num_moe_experts=E, moe_router_topk=K), group=pg)
    buffer = deep_ep.Buffer(pg, int(1e9))
    args = (d, buffer, x, rmap, probs, topk_idx, topk_weights, E)
    want = compiled_layer(*args)
    for backend in ("eager", "aot_eager"):
        torch._dynamo.reset()
        layer = torch.compile(compiled_layer, backend=backend)
        for _ in range(2):
            got = layer(*args)
            assert torch.equal(got, want), backend
    return want


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


# ---- shrink mode (test_shrink.py): a decode loop that goes on without a lost rank ----

SHRINK_STEPS, SHRINK_FAULT_AT, SHRINK_TOKENS, SHRINK_HIDDEN, SHRINK_TOPK = 10, 4, 6, 256, 3


def shrink_inputs(rank, step, num_logical):
    """Rank `rank`'s tokens of step `step`: x [T, H] bf16, logical topk_idx [T, K], weights."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = (torch.randint(-16, 17, (SHRINK_TOKENS, SHRINK_HIDDEN), generator=g).float() / 8).to(
        torch.bfloat16)
    idx = torch.stack([torch.randperm(num_logical, generator=g)[:SHRINK_TOPK]
                       for _ in range(SHRINK_TOKENS)])
    w = torch.randint(0, 64, (SHRINK_TOKENS, SHRINK_TOPK), generator=g).float() / 32
    return x, idx, w


def expert_scale(logical):
    """Logical expert e computes y = x * (1 + e / 8) in bf16 (on every replica alike)."""
    return 1.0 + logical / 8.0


def shrink_layout(R, replicas):
    """(logical experts, physical experts, the replica map or None): with replicas, logical
    expert e has physical replicas e and e + E on ranks e // 2 and e // 2 + R // 2."""
    if not replicas:
        return 2 * R, 2 * R, None
    E = R
    return E, 2 * E, [[e, e + E] for e in range(E)]


def _shrink_loop(g, pg, rank, fault, replicas, after=None):
    import moed
    import moed.deep_ep as deep_ep
    R = g.size()
    E_log, E_phys, reps = shrink_layout(R, replicas)
    L = E_phys // R
    rmap = moed.ExpertReplicas(reps, E_phys, R) if reps else None
    buffer = deep_ep.Buffer(pg, 0, deep_ep.Buffer.get_low_latency_rdma_size_hint(
        SHRINK_TOKENS, SHRINK_HIDDEN, R, E_phys), low_latency_mode=True, enable_shrink=True,
        shrink_timeout=2.0)
    mask = torch.zeros(R, dtype=torch.int)
    steps = []

    def step(i):
        # With replicas, a step whose calls masked a rank is run again on the new mask, so
        # tokens routed to a lost replica go to a live one (a killed rank: every survivor saw
        # the same calls miss it, so they all run it again). Without, the step is right as it
        # is for the mask it ended with, and running it again could pair one rank's retry with
        # a node-mate's next step where only one of them saw a message lost (a cut link).
        x, logical, w = shrink_inputs(rank, i, E_log)
        for attempt in range(R if rmap else 1):
            buffer.low_latency_query_mask_buffer(mask)
            before = mask.clone()
            physical, lost = rmap.route(logical, mask) if rmap else (logical, 0)
            hook = i % 2 == 1
            recv_x, count, handle, _, h = buffer.low_latency_dispatch(
                x, physical, SHRINK_TOKENS, E_phys, use_fp8=False, return_recv_hook=hook)
            if hook:
                h()
            y = torch.empty_like(recv_x)
            for j in range(L):
                e = (rank * L + j) % E_log
                y[j] = (recv_x[j].float() * expert_scale(e)).to(torch.bfloat16)
            out, _, h = buffer.low_latency_combine(y, physical, w, handle, return_recv_hook=hook,
                                                   order=logical)
            if hook:
                h()
            buffer.low_latency_query_mask_buffer(mask)
            if torch.equal(mask, before):
                break
        steps.append(dict(step=i, out=out.clone(), mask=mask.clone(), lost=int(lost),
                          attempts=attempt + 1, done=time.time()))

    for i in range(SHRINK_STEPS):
        if rank == 1 and i == SHRINK_FAULT_AT:
            fault()
        step(i)
    if after is not None:
        after(step)
    return steps


def _fault_file(name):
    return os.path.join(os.environ["MOED_SHRINK_DIR"], name)


def _kill_self():
    with open(_fault_file("fault_time"), "w") as f:
        f.write(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


def scenario_shrink_kill(g, pg, rank):
    return _shrink_loop(g, pg, rank, _kill_self, replicas=False)


def scenario_shrink_kill_replicas(g, pg, rank):
    return _shrink_loop(g, pg, rank, _kill_self, replicas=True)


def scenario_shrink_stop(g, pg, rank):
    """Rank 1 stops itself (SIGSTOP) at the fault step; the test continues it once the others
    have finished their steps. Its next call must say it was removed; the others then run three
    more steps, which must still be right (it wrote nothing into their memory)."""
    def stop_self():
        with open(_fault_file("fault_time"), "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGSTOP)  # continued: the loop's next call must fail

    def after(step):
        with open(_fault_file(f"steps_done_{rank}"), "w"):
            pass
        deadline = time.time() + 120
        while not os.path.exists(_fault_file("victim_done")) and time.time() < deadline:
            time.sleep(0.05)
        for i in range(SHRINK_STEPS, SHRINK_STEPS + 3):
            step(i)

    if rank != 1:
        return _shrink_loop(g, pg, rank, None, replicas=False, after=after)
    try:
        _shrink_loop(g, pg, rank, stop_self, replicas=False)
    except Exception as e:  # noqa: B902 (the removed rank's error is the result)
        open(_fault_file("victim_done"), "w").close()
        return dict(removed_error=f"{type(e).__name__}: {e}")
    return dict(removed_error=None)


def scenario_shrink_cut(g, pg, rank):
    """Across 2 test hosts (test_gloo_hosts.py): before step SHRINK_FAULT_AT rank 1 cuts the
    link between its host and the other (every packet between the two hosts' addresses
    dropped, in its host's network namespace; mpirun's own links stay), and each host's ranks
    go on, masking the other host's."""
    def cut():
        other = os.environ["MOED_HOSTS"].split(",")[1].split(":")[0]  # rank 1 is on host 0
        rules = (f"table inet moedcut {{\n"
                 f"  chain in {{ type filter hook input priority 0; ip saddr {other} drop; }}\n"
                 f"  chain out {{ type filter hook output priority 0; ip daddr {other} drop; }}\n"
                 f"}}\n")
        subprocess.run(["nft", "-f", "-"], input=rules, text=True, check=True)
        with open(os.path.join(os.environ["MOED_SHRINK_DIR"], "fault_time"), "w") as f:
            f.write(repr(time.time()))
    return _shrink_loop(g, pg, rank, cut, replicas=False)


# ---- a world that shrinks and grows back (test_shrink.py) ----

def elastic_step(g, kind):
    """One Megatron-style dispatch and combine on group g (test_megatron's inputs and experts,
    by g's ranks): what the threads world of g's size returns, bit for bit."""
    from test_megatron import E, inputs, expert_fn, six_steps, combine_steps
    from moed.megatron import MoEConfig, make_dispatcher
    r = g.rank()
    x, rmap, probs, _, _ = inputs(r, 16, 2, torch.float32)
    d = make_dispatcher(kind, MoEConfig(num_moe_experts=E, moe_router_topk=2), group=g)
    ei, _, _ = six_steps(d, x, rmap, probs, False)
    return combine_steps(d, expert_fn(ei, r), False).detach()


def _grown_steps(g3):
    return [{k: elastic_step(g3, k) for k in ("alltoall", "flex")} for _ in range(2)]


def scenario_elastic(g, pg, rank):
    """Rank 1 is killed in a loop of dispatches; the others see its loss, shrink to 3 ranks and
    go on, then grow back to 4 with a replacement (main_join) that takes rank 1."""
    import moed
    out = dict(full=[])
    try:
        for step in range(100):
            if rank == 1 and step == 2:
                _kill_self()
            out["full"].append(elastic_step(g, "alltoall"))
    except moed.AbortedError as e:
        out["seen"] = f"{e}"
        out["seen_time"] = time.time()
    g2 = g.shrink()
    out["members2"] = g2.members
    out["shrunk"] = [{k: elastic_step(g2, k) for k in ("alltoall", "flex")} for _ in range(2)]
    out["shrunk_time"] = time.time()
    open(_fault_file(f"shrunk_{rank}"), "w").close()
    g3 = g2.grow(1)
    out["members3"] = g3.members
    out["grown"] = _grown_steps(g3)
    return out


def main_join(port, out):
    """The replacement process of scenario_elastic: joins the shrunken world, runs its steps."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    torch.set_num_threads(1)
    import moed
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # moed.join's default store
    g3 = moed.join(timeout=120.0, threads_per_rank=1)
    rec = dict(rank=g3.rank(), members3=g3.members, grown=_grown_steps(g3))
    torch.save(rec, os.path.join(out, "join.pt"))
