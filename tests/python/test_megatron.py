"""The Megatron-style dispatchers: bitwise against the reference and the C++ API (forward and
autograd), gradients against finite differences, bad inputs."""
import pytest
import torch

import moed
from moed import _C
from moed.megatron import MoEConfig, make_dispatcher

from conftest import WORLDS, WORLD_IDS, make_routing, run

E = 24  # divisible by every world size tested (1, 2, 3, 4, 8)
KINDS = ["allgather", "alltoall", "flex"]
# Layout options (design.md §3.2) as MoEConfig fields, with the reference's names beside them.
LAYOUTS = {
    "dropless": {},
    "cap1_probs": dict(moe_expert_capacity_factor=1.0),
    "cap05_pos_pad": dict(moe_expert_capacity_factor=0.5, moe_token_drop_policy="position",
                          moe_pad_expert_input_to_capacity=True),
    "align4": dict(moe_expert_alignment=4),
    "router_pad4": dict(moe_router_padding_multiple=4),
}


def ref_layout(cfg):
    return dict(capacity_factor=cfg.get("moe_expert_capacity_factor"),
                drop_policy=cfg.get("moe_token_drop_policy", "probs"),
                pad_to_capacity=cfg.get("moe_pad_expert_input_to_capacity", False),
                expert_alignment=cfg.get("moe_expert_alignment", 1),
                router_padding_multiple=cfg.get("moe_router_padding_multiple", 0))


def tokens_of(rank):
    return [5, 0, 9, 1, 7, 3, 6, 2][rank % 8] + 3 * (rank // 8)  # rank 1 has no tokens


def inputs(rank, H, K, dtype, skew=False):
    T = tokens_of(rank)
    rmap, probs, topi = make_routing(1000 + rank, T, E, K, skew=skew)
    g = torch.Generator().manual_seed(2000 + rank)
    x = torch.randn(T, H, generator=g).to(dtype)
    w = torch.randn(T, H, generator=g).to(dtype)  # d loss / d out
    return x, rmap, probs, topi, w


def expert_fn(ei, rank):
    return ei * (0.5 + rank)  # exact in torch; the test applies the same op to the reference


def six_steps(d, x, rmap, probs, async_op, topk_idx=None):
    h, p = d.dispatch_preprocess(x, rmap, probs, topk_idx=topk_idx)
    h, p = d.token_dispatch(h, p, async_op=async_op)
    return d.dispatch_postprocess(h, p)


def combine_steps(d, eo, async_op):
    y = d.combine_preprocess(eo)
    y = d.token_combine(y, async_op=async_op)
    return d.combine_postprocess(y)


def body(g, kind, H, K, dtype, layout, weighted, async_op, skew, etp=1):
    r = g.rank()
    x, rmap, probs, topi, w = inputs(r, H, K, dtype, skew)
    x.requires_grad_()
    probs.requires_grad_()
    cfg = MoEConfig(num_moe_experts=E, moe_router_topk=K, moe_weighted_combine=weighted,
                    expert_tensor_parallel_size=etp, **layout)
    d = make_dispatcher(kind, cfg)
    ei, tpe, pprobs = six_steps(d, x, rmap, probs, async_op)
    eo = expert_fn(ei, r)
    out = combine_steps(d, eo, async_op)
    (out.float() * w.float()).sum().backward()
    # The C++ API directly (one call per op) on the same inputs, through a second dispatcher.
    c = _C.TokenDispatcher(g.handle, _C.DispatchConfig(kind=kind, num_experts=E, etp_size=etp,
                                                       weighted_combine=weighted,
                                                       **ref_layout(layout)))
    d = c.dispatch(x.detach(), routing_map=rmap, probs=probs.detach(), num_topk=K)
    cx, cpp, ctpe, ch = d.expert_input, d.permuted_probs, d.tokens_per_expert, d.handle
    cout, _ = c.combine(expert_fn(cx, r), ch)
    ceo_grad, cgp_combine = c.combine_backward(w, expert_fn(cx, r) if weighted else None, ch)
    cgx, cgp_dispatch = c.dispatch_backward(expert_fn(ceo_grad, r), None, ch)
    cpp_api = dict(ei=cx, pprobs=cpp, tpe=ctpe, out=cout, gx=cgx, gp=cgp_combine + cgp_dispatch)
    return dict(ei=ei.detach(), tpe=tpe, pprobs=pprobs.detach(), out=out.detach(),
                gx=x.grad, gp=probs.grad, cpp=cpp_api)


def reference(world, H, K, dtype, layout, weighted, skew, etp=1):
    R = world[0]
    ins = [inputs(r, H, K, dtype, skew) for r in range(R)]
    p = _C.ReferenceProblem(num_experts=E, ep_size=R // etp, etp_size=etp, weighted_combine=weighted, num_topk=K,
                            routing_maps=[i[1] for i in ins], probs=[i[2] for i in ins],
                            hidden=[i[0] for i in ins], **ref_layout(layout))
    disp = _C.reference_dispatch(p)
    eo = [expert_fn(disp[r]["expert_input"], r) for r in range(R)]
    out = _C.reference_combine(p, eo)
    geo, gp_c = _C.reference_combine_backward(p, [i[4] for i in ins], eo)
    gx, gp_d = _C.reference_dispatch_backward(p, [expert_fn(geo[r], r) for r in range(R)], [None] * R)
    return disp, out, gx, [a + b for a, b in zip(gp_c, gp_d)]


def check_against_reference(world, kind, H=40, K=2, dtype=torch.float32, layout="dropless",
                            weighted=True, async_op=False, skew=False, etp=1):
    lay = LAYOUTS[layout]
    got = run(body, world, kind, H, K, dtype, lay, weighted, async_op, skew, etp)
    disp, out, gx, gp = reference(world, H, K, dtype, lay, weighted, skew, etp)
    for r, o in enumerate(got):
        assert torch.equal(o["ei"], disp[r]["expert_input"]), f"rank {r} expert_input"
        assert torch.equal(o["tpe"], disp[r]["tokens_per_expert"]), f"rank {r} tokens_per_expert"
        assert torch.equal(o["pprobs"], disp[r]["permuted_probs"]), f"rank {r} permuted_probs"
        assert torch.equal(o["out"], out[r]), f"rank {r} combine"
        assert torch.equal(o["gx"], gx[r]), f"rank {r} grad hidden"
        assert torch.equal(o["gp"], gp[r]), f"rank {r} grad probs"
        c = o["cpp"]
        for key in ("ei", "pprobs", "tpe", "out", "gx", "gp"):
            assert torch.equal(o[key], c[key]), f"rank {r} {key} differs from the C++ API"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("world", WORLDS, ids=WORLD_IDS)
def test_matches_reference_and_cpp_api(world, kind):
    check_against_reference(world, kind)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_options(kind, layout):
    check_against_reference((4, 2), kind, layout=layout, skew=True)


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_unweighted_async_k1_and_k_equals_e(kind):
    check_against_reference((3, 0), kind, H=130, dtype=torch.bfloat16, weighted=False, async_op=True)
    check_against_reference((2, 0), kind, K=1)
    check_against_reference((2, 0), kind, K=E, H=17)


@pytest.mark.parametrize("kind", KINDS)
def test_expert_tensor_parallel(kind):
    check_against_reference((4, 2), kind, etp=2)
    check_against_reference((8, 4), kind, etp=4, dtype=torch.bfloat16, layout="cap1_probs")


def topk_idx_as(topi, form):
    """int32 / int64 are read in place; int16 and a strided view are copied by the binding."""
    if form == "strided":
        return torch.stack([topi, topi], 2)[..., 0]  # stride (2K, 2)
    return topi.to({"int32": torch.int32, "int64": torch.int64, "int16": torch.int16}[form])


@pytest.mark.parametrize("idx_form", ["int32", "int64", "int16", "strided"])
def test_topk_form_gives_the_map_forms_gradients(idx_form):
    H, K = 24, 3

    def body2(g):
        x, rmap, probs, topi, w = inputs(g.rank(), H, K, torch.float32)
        out = {}
        for form in ("map", "topk"):
            xx = x.clone().requires_grad_()
            if form == "map":
                pp = probs.clone().requires_grad_()
                args = (rmap, pp, None)
            else:
                pp = probs.gather(1, topi).requires_grad_()
                args = (None, pp, topk_idx_as(topi, idx_form))
            d = make_dispatcher("alltoall", num_moe_experts=E, moe_router_topk=K, moe_weighted_combine=True)
            ei, _, _ = six_steps(d, xx, args[0], args[1], False, topk_idx=args[2])
            y = combine_steps(d, ei * 2, False)
            (y * w).sum().backward()
            out[form] = (y.detach(), xx.grad, pp.grad)
        return out, topi
    for out, topi in run(body2, (3, 0)):
        assert torch.equal(out["map"][0], out["topk"][0])
        assert torch.equal(out["map"][1], out["topk"][1])
        assert torch.equal(out["map"][2].gather(1, topi), out["topk"][2])


def test_gradients_against_finite_differences():
    """f32: d loss / d hidden and d loss / d probs of a small layer (experts tanh, weighted
    combine), central differences on a few coordinates of rank 0."""
    H, K, R = 6, 2, 2

    def loss_of(g, x, probs, rmap, w):
        d = make_dispatcher("flex", num_moe_experts=E, moe_router_topk=K, moe_weighted_combine=True)
        ei, _, pp = six_steps(d, x, rmap, probs, False)
        y = combine_steps(d, torch.tanh(ei) * (1 + pp[:, None]), False)
        loss = (y * w).sum()
        total = loss.detach().clone()
        moed.dist.all_reduce(total)
        return loss, total.item()

    def body3(g):
        x, rmap, probs, _, w = inputs(g.rank(), H, K, torch.float32)
        x.requires_grad_()
        probs.requires_grad_()
        loss, _ = loss_of(g, x, probs, rmap, w)
        loss.backward()
        checks = []
        coords = [("x", (0, 1)), ("x", (3, 4))]
        for t, j in ((2, 0), (4, -1)):  # the same number of collective calls on every rank
            coords.append(("p", (t, int(rmap[t].nonzero()[j])) if g.rank() == 0 else None))
        for which, coord in coords:  # rank 0 perturbs; every rank recomputes the loss
            vals = []
            for sgn in (1, -1):
                xx, pp = x.detach().clone(), probs.detach().clone()
                if g.rank() == 0:
                    (xx if which == "x" else pp)[coord] += sgn * 1e-2
                with torch.no_grad():
                    vals.append(loss_of(g, xx, pp, rmap, w)[1])
            fd = (vals[0] - vals[1]) / 2e-2
            an = (x.grad if which == "x" else probs.grad)[coord].item() if g.rank() == 0 else 0.0
            checks.append((which, coord, fd, an))
        return checks
    for which, coord, fd, an in run(body3, (R, 0))[0]:
        assert abs(fd - an) <= 2e-2 * max(1.0, abs(an)), f"{which}{coord}: fd {fd} vs autograd {an}"


def test_flex_outputs_stay_unchanged_after_the_next_dispatch():
    def body4(g):
        x, rmap, probs, _, _ = inputs(g.rank(), 16, 2, torch.float32)
        d = make_dispatcher("flex", num_moe_experts=E, moe_router_topk=2)
        first, _, _ = six_steps(d, x, rmap, probs, False)
        keep = first.clone()
        six_steps(d, x * 3, rmap, probs, False)
        return torch.equal(first, keep)
    assert all(run(body4, (2, 0)))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_dispatcher_keeps_no_output_the_caller_dropped(kind, grad):
    """Once the caller (and autograd) let the outputs go, nothing of the dispatcher's holds
    them: a held Flex output keeps its ring slot, so the next dispatch would write elsewhere."""
    import weakref

    def body5(g):
        x, rmap, probs, _, _ = inputs(g.rank(), 16, 2, torch.float32)
        x.requires_grad_(grad)
        d = make_dispatcher(kind, num_moe_experts=E, moe_router_topk=2)
        ei, tpe, pp = six_steps(d, x, rmap, probs, False)
        y = combine_steps(d, ei, False)
        refs = [weakref.ref(t) for t in (ei, pp, y)]
        del ei, tpe, pp, y
        return [r() is None for r in refs]
    assert all(all(v) for v in run(body5, (3, 0)))


def dispatch_out_body(g, kind, dtype, worst, grad):
    """dispatch_preprocess(..., out=): the rows land in the caller's (strided) tensor, bit for
    bit moed's own expert_input, and combine / backward give the same bits; then a wrong `out`
    on the last rank is a ValueError on every rank and no rank's `out` is written."""
    R, r = g.size(), g.rank()
    H = 37
    x, rmap, probs, _, _ = inputs(r, H, 2, dtype)
    d = make_dispatcher(kind, num_moe_experts=E, moe_router_topk=2, moe_num_worst_tokens=worst)
    want, want_tpe, want_pp = six_steps(d, x, rmap, probs, False)
    want = want.detach().clone()
    want_y = combine_steps(d, want.float().to(dtype) * 2, False).detach().clone()
    rows = want.size(0)
    big = torch.full((rows, H + 3), float("nan"), dtype=dtype)
    out = big[:, :H]
    xg = x.detach().clone().requires_grad_(grad)
    pg = probs.detach().clone().requires_grad_(grad)
    h, p = d.dispatch_preprocess(xg, rmap, pg, out=out)
    h, p = d.token_dispatch(h, p)
    got, tpe, pp = d.dispatch_postprocess(h, p)
    ok = [torch.equal(got, want), torch.equal(tpe, want_tpe), torch.equal(pp, want_pp),
          bool(torch.isnan(big[:, H:].float()).all()), got.data_ptr() == out.data_ptr()]
    if not grad:
        ok.append(got is out)
    y = combine_steps(d, got * 2, False)
    ok.append(torch.equal(y.detach(), want_y))
    if grad:
        y.float().sum().backward()
        ok.append(xg.grad is not None and pg.grad is not None)
    def dispatch_into(bad):
        h, p = d.dispatch_preprocess(x, rmap, probs, out=bad)
        d.dispatch_postprocess(*d.token_dispatch(h, p))
    errors, untouched = rejected_out(dispatch_into, (rows + 1 if r == R - 1 else rows, H), dtype)
    d.close()
    return ok + [untouched], errors, rows


def rejected_out(call, shape, dtype):
    """call(bad) with a NaN-filled `bad` of `shape`: (the ValueError messages, whether `bad`
    is still all NaN)."""
    bad = torch.full(shape, float("nan"), dtype=dtype)
    errors = []
    try:
        call(bad)
    except ValueError as e:
        errors.append(str(e))
    return errors, bool(torch.isnan(bad.float()).all())


@pytest.mark.parametrize("kind,worst,grad", [("flex", 40, False), ("alltoall", 0, True),
                                             ("flex", 0, True)])
def test_dispatch_into_callers_tensor_bf16_worst_and_autograd(kind, worst, grad):
    for ok, errors, _ in run(dispatch_out_body, (4, 0), kind, torch.bfloat16, worst, grad):
        assert all(ok), ok
        assert len(errors) == 1 and "rank 3: out is" in errors[0], errors


def combine_out_body(g, kind, dtype, grad, weighted):
    """combine_preprocess(..., out=): the combined rows land in the caller's (strided) [T, H]
    tensor, bit for bit moed's own result, backward gives the same gradients; then a wrong
    `out` on the last rank is a ValueError on every rank and no rank's `out` is written."""
    R, r = g.size(), g.rank()
    H = 37
    x, rmap, probs, _, w = inputs(r, H, 2, dtype)
    d = make_dispatcher(kind, num_moe_experts=E, moe_router_topk=2, moe_weighted_combine=weighted)

    def forward(out):
        xg = x.detach().clone().requires_grad_(grad)
        pg = probs.detach().clone().requires_grad_(grad)
        ei, _, _ = six_steps(d, xg, rmap, pg, False)
        y = d.combine_preprocess(ei * 2, out=out)
        y = d.combine_postprocess(d.token_combine(y))
        if grad:
            (y.float() * w.float()).sum().backward()
            return y.detach().clone(), xg.grad, pg.grad
        return y, None, None

    want, want_gx, want_gp = forward(None)
    want = want.clone()
    T = x.size(0)
    big = torch.full((T, H + 3), float("nan"), dtype=dtype)
    out = big[:, :H]
    got, gx, gp = forward(out)
    ok = [torch.equal(got, want), bool(torch.isnan(big[:, H:].float()).all()),
          torch.equal(out, want)]
    if grad:
        ok += [torch.equal(gx, want_gx), torch.equal(gp, want_gp)]
    else:
        ok.append(got is out)
    ei, _, _ = six_steps(d, x, rmap, probs, False)
    errors, untouched = rejected_out(
        lambda bad: d.combine_postprocess(d.token_combine(d.combine_preprocess(ei, out=bad))),
        (T + 1 if r == R - 1 else T, H), dtype)
    d.close()
    return ok + [untouched], errors, T


@pytest.mark.parametrize("step", ["dispatch", "combine"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("world", [(1, 0), (3, 0), (4, 2), (8, 0)], ids=["R1", "R3", "R4_G2", "R8"])
def test_into_callers_tensor(step, kind, world):
    """dispatch_preprocess(..., out=) and combine_preprocess(..., out=), f32; the last rank's
    wrong `out` names its shape on every rank."""
    R = world[0]
    if step == "dispatch":
        results = run(dispatch_out_body, world, kind, torch.float32, 0, False)
    else:
        results = run(combine_out_body, world, kind, torch.float32, False, False)
    last_rows = results[R - 1][2]
    for ok, errors, _ in results:
        assert all(ok), ok
        assert len(errors) == 1, errors
        assert f"rank {R - 1}: out is [{last_rows + 1}, 37]; expected [{last_rows}, 37]" in errors[0]


@pytest.mark.parametrize("kind,weighted", [("alltoall", True), ("flex", False), ("allgather", True)])
def test_combine_into_callers_tensor_bf16_autograd(kind, weighted):
    for ok, errors, _ in run(combine_out_body, (4, 0), kind, torch.bfloat16, True, weighted):
        assert all(ok), ok
        assert len(errors) == 1 and "rank 3: out is" in errors[0], errors


def test_combine_out_returned_as_given():
    """hidden_states of any shape: combine_postprocess returns the caller's [T, H] `out`."""
    def body(g):
        d = make_dispatcher("alltoall", num_moe_experts=E, moe_router_topk=2)
        x, rmap, probs, _, _ = inputs(g.rank(), 16, 2, torch.float32)
        ei, _, _ = six_steps(d, x.view(1, -1, 16), rmap, probs, False)
        want = combine_steps(d, ei, False)
        out = torch.empty(x.size(0), 20)[:, :16]
        y = d.combine_postprocess(d.token_combine(d.combine_preprocess(ei, out=out)))
        d.close()
        return y is out and tuple(want.shape) == (1, x.size(0), 16) and torch.equal(y, want.view(-1, 16))
    assert all(run(body, (2, 0)))


# ---- bad inputs: an exception naming the value, on every rank, never a hang ----

def expect_everywhere(world, fn, exc, words):
    def wrapped(g):
        try:
            fn(g)
        except exc as e:
            return str(e)
        return None
    msgs = run(wrapped, world, timeout=30)
    for m in msgs:
        assert m is not None, "a rank did not raise"
        for w in words:
            assert w in m, m


def test_bad_config_every_rank():
    expect_everywhere((3, 0), lambda g: make_dispatcher("alltoall", num_moe_experts=8), ValueError, ["num_experts = 8"])
    expect_everywhere((2, 0), lambda g: make_dispatcher("flex", num_moe_experts=8,
                                                        moe_expert_capacity_factor=-1.0), ValueError, [])
    with pytest.raises(ValueError, match="kind"):
        run(lambda g: make_dispatcher("ring", num_moe_experts=8), (1, 0))


@pytest.mark.parametrize("kind", KINDS)
def test_mismatched_hidden_across_ranks(kind):
    def fn(g):
        H = 16 + 8 * g.rank()
        x, rmap, probs, _, _ = inputs(g.rank(), H, 2, torch.float32)
        d = make_dispatcher(kind, num_moe_experts=E, moe_router_topk=2)
        six_steps(d, x, rmap, probs, False)
    expect_everywhere((2, 0), fn, ValueError, ["rank"])


@pytest.mark.parametrize("case, exc, words", [
    ("double", TypeError, ["hidden_states", "torch.float64"]),
    ("map_shape", ValueError, ["probs", "expected"]),
    ("probs_int", TypeError, ["probs", "torch.int64"]),
    ("map_strided", ValueError, ["routing_map", "contiguous"]),
    ("hidden_strided", ValueError, ["hidden_states", "strides"]),
    ("no_routing", ValueError, ["routing_map"]),
    ("map_nan", ValueError, ["prob", "nan"]),
    ("map_u8", ValueError, ["routing_map", "is not 0 or 1"]),
    ("combine_rows", ValueError, []),
    ("combine_dtype", TypeError, ["expert_output", "torch.int64"]),
])
def test_bad_inputs_raise_on_every_rank(case, exc, words):
    def fn(g):
        x, rmap, probs, _, _ = inputs(g.rank(), 16, 2, torch.float32)
        d = make_dispatcher("alltoall", num_moe_experts=E, moe_router_topk=2)
        bad_rank = g.rank() == 0
        if case == "combine_rows":
            ei, _, _ = six_steps(d, x, rmap, probs, False)
            combine_steps(d, torch.zeros(ei.shape[0] + (1 if bad_rank else 0), 16), False)
            return
        if case == "combine_dtype":  # an argument error in combine_preprocess
            ei, _, _ = six_steps(d, x, rmap, probs, False)
            combine_steps(d, ei.long() if bad_rank else ei, False)
            return
        if bad_rank:
            if case == "double":
                x = x.double()
            elif case == "map_shape":
                probs = probs[:, :4].contiguous()
            elif case == "probs_int":
                probs = probs.long()
            elif case == "map_strided":
                rmap = rmap.t().contiguous().t()
            elif case == "hidden_strided":
                x = torch.randn(16, x.shape[0]).t()
            elif case == "no_routing":
                rmap = None
            elif case == "map_nan":
                probs = probs.masked_fill(rmap, float("nan"))
            elif case == "map_u8":
                rmap = rmap.to(torch.uint8) * 3
        six_steps(d, x, rmap, probs, False)
    if case == "combine_rows":
        expect_everywhere((2, 0), fn, ValueError, words)
        return

    def wrapped(g):
        try:
            fn(g)
        except Exception as e:  # noqa: BLE001
            return type(e), str(e)
        return None
    # Every rank raises, none waits: the bad rank (0) its own argument error, the others moed's,
    # naming rank 0 (the argument error travels in token_dispatch's agreement).
    got = run(wrapped, (3, 0), timeout=30)
    assert all(g is not None for g in got), got
    assert issubclass(got[0][0], exc), got[0]
    for r, (kind, msg) in enumerate(got):
        for w in words:
            assert w in msg, (r, msg)
        if r > 0:
            assert issubclass(kind, ValueError) and "rank 0: " in msg, (r, kind, msg)


def test_use_after_launch_raises():
    keep = run(lambda g: make_dispatcher("flex", num_moe_experts=E), (2, 0))
    with pytest.raises(RuntimeError, match="ended"):
        keep[0].dispatch_preprocess(torch.zeros(1, 4), torch.zeros(1, E, dtype=torch.bool), torch.zeros(1, E))


def test_steps_out_of_order():
    def fn(g):
        d = make_dispatcher("alltoall", num_moe_experts=E)
        with pytest.raises(RuntimeError, match="before"):
            d.combine_preprocess(torch.zeros(0, 4))
        with pytest.raises(RuntimeError, match="before"):
            d.token_dispatch(None, None)
    run(fn, (1, 0))


@pytest.mark.parametrize("kind", KINDS)
def test_example_layer_trains_on_threads(kind):
    import importlib.util
    import os
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python", "examples", "moe_layer.py")
    spec = importlib.util.spec_from_file_location("moe_layer", path)
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    losses = moed.launch(ex.train, 4, kind, 3, ranks_per_node=2)
    assert losses[0] == losses[3] and losses[0][-1] < losses[0][0]
    if kind != "allgather":  # every dispatcher trains to the same bits
        ref = moed.launch(ex.train, 4, "allgather", 3, ranks_per_node=2)
        assert losses == ref


def held_output_body(g, kind):
    """An output torch still holds is never written by a later dispatch, and outlives its
    dispatcher (the lifetime rule; Flex's region stays mapped in every world)."""
    r = g.rank()
    cfg = MoEConfig(num_moe_experts=E, moe_router_topk=2)
    d = make_dispatcher(kind, cfg)
    x, rmap, probs, _, _ = inputs(r, 20, 2, torch.float32)
    first, _, _ = six_steps(d, x, rmap, probs, False)
    kept = first.clone()
    for step in range(3):
        later, _, _ = six_steps(d, x * (3 + step) + 1, rmap, probs, False)
        d.combine_postprocess(d.token_combine(d.combine_preprocess(later), async_op=False))
    d.combine_postprocess(d.token_combine(d.combine_preprocess(first), async_op=False))
    unchanged = torch.equal(first, kept)
    d.close()
    del d
    g.barrier()  # every rank's dispatcher is gone
    return unchanged and torch.equal(first, kept)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("world", [(4, 0), (4, 2)], ids=["R4", "R4_2nodes"])
def test_held_output_is_never_overwritten(kind, world):
    ranks, rpn = world
    assert all(moed.launch(held_output_body, ranks, kind, ranks_per_node=rpn))


# ---- Megatron-Core's config, constructor arguments and MoELayer hooks ----

# TransformerConfig's knobs that do not apply on CPU, at non-default values: all accepted.
CPU_KNOBS = dict(moe_permute_fusion=True, moe_enable_deepep=True, moe_token_dispatcher_type="flex",
                 moe_flex_dispatcher_backend="hybridep", moe_router_dtype="fp32",
                 moe_shared_expert_overlap=True, moe_deepep_num_sms=24, moe_hybridep_num_sms=8,
                 fp8="e4m3", fp8_recipe="blockwise", fp4=None, fp4_recipe="nvfp4")


class MegatronLikeConfig:
    """An object with Megatron's attribute names (as a TransformerConfig has), and others."""

    def __init__(self, **kw):
        self.num_moe_experts, self.moe_router_topk = E, 2
        self.expert_model_parallel_size, self.expert_tensor_parallel_size = 1, None
        self.moe_expert_capacity_factor, self.moe_token_drop_policy = None, "probs"
        self.moe_pad_expert_input_to_capacity = False
        self.hidden_size, self.num_layers, self.add_bias_linear = 64, 2, False  # not moed's
        for k, v in {**CPU_KNOBS, **kw}.items():
            setattr(self, k, v)


def test_config_takes_megatrons_knobs_and_objects():
    c = MoEConfig(num_moe_experts=E, moe_router_topk=2, **CPU_KNOBS)
    assert c.moe_flex_dispatcher_backend == "hybridep" and c.router_padding_multiple() == 0
    m = MoEConfig.from_config(MegatronLikeConfig(moe_expert_capacity_factor=1.5))
    assert (m.num_moe_experts, m.moe_router_topk, m.expert_tensor_parallel_size) == (E, 2, 1)
    assert m.moe_expert_capacity_factor == 1.5 and m.moe_token_dispatcher_type == "flex"
    assert MoEConfig.from_config(m, moe_router_topk=3).moe_router_topk == 3
    # Megatron pads the routing map for quantised GEMMs (get_align_size_for_quantization).
    pads = [MoEConfig(moe_router_padding_for_quantization=True, **kw).router_padding_multiple()
            for kw in (dict(fp8="e4m3"), dict(fp8="e4m3", fp8_recipe="mxfp8"), dict(fp4="e2m1"))]
    assert pads == [16, 32, 128]
    assert MoEConfig(moe_router_padding_for_fp8=True, fp8="e4m3",
                     moe_router_padding_multiple=8).router_padding_multiple() == 8
    with pytest.raises(TypeError):
        MoEConfig(moe_no_such_knob=1)


class Groups:
    """Megatron's ProcessGroupCollection, as far as a dispatcher reads it."""

    def __init__(self, g):
        self.ep = self.tp_ep = g
        self.expt_tp = None


def case_megatron_arguments(g):
    H, K = 16, 2
    cfg = MegatronLikeConfig(moe_shared_expert_overlap=False)
    L = E // g.size()
    mine = list(range(g.rank() * L, g.rank() * L + L))
    d = make_dispatcher(None, cfg, num_local_experts=L, local_expert_indices=mine,
                        pg_collection=Groups(g))
    assert type(d).kind == "flex" and d.ep_size == g.size() and d.tp_size == 1
    assert d.shared_experts is None and d.routing_map is None
    assert d.get_expert_zero_copy_buffers() == (None, None)
    with pytest.raises(NotImplementedError, match="Shared expert overlap is not supported"):
        d.set_shared_experts(object())
    x, rmap, probs, topi, _ = inputs(g.rank(), H, K, torch.float32)
    h, p = d.dispatch_preprocess(x, rmap, probs)
    assert d.routing_map is rmap
    d.dispatch_postprocess(*d.token_dispatch(h, p, async_finish=True, allocate_on_comm_stream=True))
    assert d.routing_map is rmap  # kept for combine, as Megatron's AlltoAll keeps it
    a = make_dispatcher("alltoall", cfg, pg_collection=Groups(g))
    a.dispatch_preprocess(x, None, probs.gather(1, topi), topk_idx=topi)
    got = a.routing_map
    with pytest.raises(ValueError, match="moe_shared_expert_overlap"):
        a.set_shared_experts(object())
    with pytest.raises(ValueError, match="num_local_experts = 1"):
        make_dispatcher("alltoall", cfg, num_local_experts=1, pg_collection=Groups(g))
    return torch.equal(got, rmap)


def test_megatron_constructor_arguments_and_hooks():
    assert all(run(case_megatron_arguments, (4, 0)))


class OverlappedSharedMLP(torch.nn.Module):
    """A shared expert in the protocol Megatron's SharedExpertMLP follows with
    moe_shared_expert_overlap (the dispatcher calls the five methods in order), computing
    fc2(gelu(fc1(x))) without tensor parallelism; it records the calls."""

    def __init__(self, H, F, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.fc1 = torch.nn.Parameter(torch.randn(F, H, generator=g) * 0.2)
        self.fc2 = torch.nn.Parameter(torch.randn(H, F, generator=g) * 0.2)
        self.calls, self.cached = [], None

    def forward(self, x):
        return torch.nn.functional.gelu(x @ self.fc1.t()) @ self.fc2.t()

    def pre_forward_comm(self, x):
        self.calls.append("pre_forward_comm")
        self.cached = x

    def linear_fc1_forward_and_act(self, overlapped_comm_output=None):
        self.calls.append("linear_fc1_forward_and_act")
        self.cached = torch.nn.functional.gelu(self.cached @ self.fc1.t())

    def linear_fc2_forward(self, overlapped_comm_output=None):
        self.calls.append("linear_fc2_forward")
        self.cached = self.cached @ self.fc2.t()

    def post_forward_comm(self):
        self.calls.append("post_forward_comm")

    def get_output(self):
        self.calls.append("get_output")
        out, self.cached = self.cached, None
        return out


def case_shared_experts(g, kind):
    H, K = 16, 2
    x, rmap, probs, _, w = inputs(g.rank(), H, K, torch.float32)
    out = {}
    for overlap in (False, True):
        shared = OverlappedSharedMLP(H, 24, 7)
        xx = x.clone().view(-1, 1, H).requires_grad_()
        d = make_dispatcher(kind, MoEConfig(num_moe_experts=E, moe_router_topk=K,
                                            moe_shared_expert_overlap=overlap))
        if overlap:
            d.set_shared_experts(shared)
        ei, _, pp = six_steps(d, xx, rmap, probs, False)
        y = combine_steps(d, ei * pp[:, None], False)
        if not overlap:
            y = y + shared(xx)  # what Megatron's MoELayer does without the overlap
        (y.view(-1, H) * w).sum().backward()
        out[overlap] = (y.detach(), xx.grad, shared.fc1.grad, shared.calls)
    return out


@pytest.mark.parametrize("kind", ["allgather", "alltoall"])
def test_shared_experts_run_inside_the_steps(kind):
    order = ["pre_forward_comm", "linear_fc1_forward_and_act", "linear_fc2_forward",
             "post_forward_comm", "get_output"]
    for out in run(case_shared_experts, (3, 0), kind):
        (y0, gx0, gw0, _), (y1, gx1, gw1, calls) = out[False], out[True]
        assert calls == order
        assert torch.equal(y0, y1) and torch.equal(gx0, gx1) and torch.equal(gw0, gw1)
