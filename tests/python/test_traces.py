"""Megatron-Core routing traces end to end: a small made-up MoE model traced by Megatron-Core's own
RouterTracer (when a Megatron-LM checkout is named by MOED_MEGATRON_LM) and by moed.traces'
writer, read back by moed.traces and by the `moed` program, and replayed through every dispatcher
bit for bit against the reference; each bad file raises the same error in Python and in C++."""
import importlib.util
import json
import os
import shutil
import subprocess

import pytest
import torch

import moed
import moed.deep_ep as deep_ep
import moed.traces as traces
from moed import _C
from moed.megatron import MoEConfig, make_dispatcher

from conftest import run

MOED_CLI = os.environ.get("MOED_CLI") or os.path.join(os.path.dirname(moed.__file__), "..", "..", "bin", "moed")
MEGATRON = os.environ.get("MOED_MEGATRON_LM", "")
ROUTER_TRACE_PY = os.path.join(MEGATRON, "megatron/core/transformer/moe/router_trace.py")
needs_megatron = pytest.mark.skipif(
    not MEGATRON or not os.path.exists(ROUTER_TRACE_PY),
    reason="MOED_MEGATRON_LM does not name a Megatron-LM checkout (its router_trace.py runs the tracer)")

E, K, H, R, SEQ, MBS, LAYERS, STEPS = 16, 3, 128, 4, 6, 2, 3, 2


class Router(torch.nn.Module):
    """Megatron's TopKRouter contract: forward(x [s, b, h]) -> (probs [T, E], routing_map [T, E] bool),
    and a `topk` attribute (RouterTracer reads both)."""

    def __init__(self, g):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(E, H, generator=g))
        self.topk = K

    def forward(self, x):
        scores = (x.reshape(-1, H).float() @ self.weight.t()).softmax(-1)
        v, i = torch.topk(scores, K, dim=-1)
        return torch.zeros_like(scores).scatter(1, i, v), torch.zeros_like(scores, dtype=torch.bool).scatter(1, i, True)


class MLP(torch.nn.Module):
    def __init__(self, g):
        super().__init__()
        self.router = Router(g)

    def forward(self, x):
        probs, _ = self.router(x)
        return x + (0.25 * probs.max(-1).values).reshape(x.shape[:-1] + (1,)).to(x.dtype)


class Layer(torch.nn.Module):
    def __init__(self, g):
        super().__init__()
        self.mlp = MLP(g)

    def forward(self, x):
        return self.mlp(x)


class Model(torch.nn.Module):
    """Module names as in Megatron's GPTModel: decoder.layers.<n>.mlp.router."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.decoder = torch.nn.Module()
        self.decoder.layers = torch.nn.ModuleList([Layer(g) for _ in range(LAYERS)])

    def forward(self, x):
        for layer in self.decoder.layers:
            x = layer(x)
        return x


def batch(rank, step):
    return torch.randn(SEQ, MBS, H, generator=torch.Generator().manual_seed(100 * rank + step)).to(torch.bfloat16)


def routers(model):
    return [(n, m) for n, m in model.named_modules() if isinstance(m, Router)]


def run_model(model, on_call):
    """Runs every rank's steps; on_call(rank, step, layer, router_input, routing_map) at each router."""
    for r in range(R):
        for step in range(STEPS):
            hooks = [m.register_forward_hook(
                lambda mod, inp, out, layer=i: on_call(r, step, layer, inp[0], out[1]))
                for i, (_, m) in enumerate(routers(model))]
            with torch.no_grad():
                model(batch(r, step))
            for h in hooks:
                h.remove()


def truth():
    """What every router saw and chose, recorded independently: {(step, layer): (idx, rows)} joined
    in rank order (indices ascending per token, as a routing map's nonzero gives them)."""
    calls = {}
    def on_call(r, step, layer, x, rmap):
        idx = rmap.nonzero()[:, 1].reshape(-1, K).to(torch.int32)
        calls.setdefault((step, layer), []).append((idx, x.reshape(-1, H).to(torch.bfloat16)))
    run_model(Model(), on_call)
    return {k: (torch.cat([a for a, _ in v]), torch.cat([b for _, b in v])) for k, v in calls.items()}


def megatron_trace(d):
    """Megatron-Core's RouterTracer, unchanged, hooked on the model as register_hooks does it."""
    spec = importlib.util.spec_from_file_location("megatron_router_trace", ROUTER_TRACE_PY)
    rt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rt)
    # NOTE: torch 1.13's CPU build raises in is_current_stream_capturing (no CUDA); no stream is
    # capturing here, which newer torch answers with False on CPU.
    capturing = torch.cuda.is_current_stream_capturing
    torch.cuda.is_current_stream_capturing = lambda: False
    try:
        model = Model()
        for r in range(R):
            tracer = rt.RouterTracer(d, max_steps=STEPS, rank=r, training_mode=True, capture_hidden_states=True)
            handles = [m.register_forward_hook(tracer.make_hook(n)) for n, m in routers(model)]
            for step in range(STEPS):
                with torch.no_grad():
                    model(batch(r, step))
                tracer.advance_step()
            for h in handles:
                h.remove()
            tracer.flush()
    finally:
        torch.cuda.is_current_stream_capturing = capturing


def writer_trace(d):
    """moed.traces.RouterTraceWriter with the same model and calls."""
    writers = [traces.RouterTraceWriter(d, rank=r, capture_hidden_states=True) for r in range(R)]
    run_model(Model(), lambda r, step, layer, x, rmap: writers[r].record(
        step=step, layer=layer, top_indices=rmap.nonzero()[:, 1].reshape(-1, K), hidden_states=x.reshape(-1, H)))
    for w in writers:
        w.close()


SOURCES = [pytest.param("megatron", marks=needs_megatron), "writer"]


@pytest.fixture(scope="module", params=SOURCES)
def trace_dir(request, tmp_path_factory):
    d = str(tmp_path_factory.mktemp(request.param))
    (megatron_trace if request.param == "megatron" else writer_trace)(d)
    return d


def cli(*args):
    r = subprocess.run([MOED_CLI, *map(str, args)], capture_output=True, text=True)
    return r.returncode, r.stdout, r.stderr


@needs_megatron
def test_writer_writes_what_megatron_writes(tmp_path):
    megatron_trace(str(tmp_path / "m"))
    writer_trace(str(tmp_path / "w"))
    names = sorted(os.listdir(tmp_path / "m"))
    assert names == sorted(os.listdir(tmp_path / "w")) and len(names) == 2 * R
    for f in names:
        assert (tmp_path / "m" / f).read_bytes() == (tmp_path / "w" / f).read_bytes(), f


def test_reader_gives_what_the_routers_saw(trace_dir):
    want = truth()
    for step in range(STEPS):
        t = traces.read_router_trace(trace_dir, step=step, num_experts=E)
        assert (t.num_ranks, t.step, t.steps) == (R, step, list(range(STEPS)))
        assert [c.label for c in t.calls] == [f"decoder layer {i}" for i in range(LAYERS)]
        for c in t.calls:
            idx, rows = want[(step, c.layer)]
            assert c.tokens_per_rank == SEQ * MBS
            assert torch.equal(c.topk_idx, idx)
            assert torch.equal(c.hidden_states, rows)
    one = traces.read_router_trace(trace_dir, step=1, layer=2, hidden_states=False)
    assert len(one.calls) == 1 and one.calls[0].hidden_states is None


def reference(idx, rows, kind_weighted=False):
    T = idx.shape[0] // R
    maps, probs, xs = [], [], []
    for s in range(R):
        i = idx[s * T:(s + 1) * T].long()
        maps.append(torch.zeros(T, E, dtype=torch.bool).scatter(1, i, True))
        probs.append(torch.zeros(T, E).scatter(1, i, 1.0))
        xs.append(rows[s * T:(s + 1) * T].contiguous())
    p = _C.ReferenceProblem(num_experts=E, ep_size=R, num_topk=K, weighted_combine=kind_weighted,
                            routing_maps=maps, probs=probs, hidden=xs)
    return p, _C.reference_dispatch(p)


def load_npy(path):
    # .npy v1 with a little-endian descr, as moed writes it; bf16 is stored as <u2.
    data = open(path, "rb").read()
    header_len = int.from_bytes(data[8:10], "little")
    header = eval(data[10:10 + header_len].decode())  # a dict literal by the .npy spec
    dtype = {"<u2": torch.int16, "<f4": torch.float32, "<i8": torch.int64}[header["descr"]]
    t = torch.frombuffer(bytearray(data[10 + header_len:]), dtype=dtype).reshape(header["shape"])
    return t.view(torch.bfloat16) if header["descr"] == "<u2" else t


@pytest.mark.parametrize("dispatcher,G", [("allgather", 4), ("alltoall", 4), ("alltoall", 2), ("flex", 4),
                                          ("flex", 2), ("flex", 1)])
def test_cli_dispatch_equals_reference(trace_dir, tmp_path, dispatcher, G):
    rc, out, err = cli("dispatch", "--trace", trace_dir, "--step", 1, "--layer", 2, "--experts", E,
                       "--dispatcher", dispatcher, "--ranks-per-node", G, "--out", tmp_path)
    assert rc == 0, err
    idx, rows = truth()[(1, 2)]
    p, disp = reference(idx, rows)
    for g in range(R):
        assert torch.equal(load_npy(tmp_path / f"expert_input_rank{g}.npy"), disp[g]["expert_input"]), g
        assert torch.equal(load_npy(tmp_path / f"permuted_probs_rank{g}.npy"), disp[g]["permuted_probs"])
    combined = _C.reference_combine(p, [disp[g]["expert_input"] for g in range(R)])
    assert torch.equal(load_npy(tmp_path / "combined.npy"), torch.cat(combined))


def python_dispatch(g, kind, idx, rows):
    """The trace's call through moed's Megatron-style dispatcher on rank g (prob 1 per slot)."""
    T = idx.shape[0] // R
    r = g.rank()
    i = idx[r * T:(r + 1) * T].long()
    rmap = torch.zeros(T, E, dtype=torch.bool).scatter(1, i, True)
    probs = torch.zeros(T, E).scatter(1, i, 1.0)
    d = make_dispatcher(kind, MoEConfig(num_moe_experts=E, moe_router_topk=K))
    h, p = d.dispatch_preprocess(rows[r * T:(r + 1) * T], rmap, probs)
    ei, tpe, pp = d.dispatch_postprocess(*d.token_dispatch(h, p))
    out = d.combine_postprocess(d.token_combine(d.combine_preprocess(ei)))
    return ei.clone(), out.clone()


def low_latency(g, idx, rows):
    """The same call through moed.deep_ep's low-latency kernels (bf16, weights 1)."""
    T = idx.shape[0] // R
    r = g.rank()
    buffer = deep_ep.Buffer(g, 0, deep_ep.Buffer.get_low_latency_rdma_size_hint(T, H, R, E),
                            low_latency_mode=True, num_qps_per_rank=E // R)
    x, i = rows[r * T:(r + 1) * T].contiguous(), idx[r * T:(r + 1) * T].long()
    recv, count, handle, _, _ = buffer.low_latency_dispatch(x, i, T, E, use_fp8=False)
    combined, _, _ = buffer.low_latency_combine(recv, i, torch.ones(T, K), handle)
    return [recv[j, :count[j]].clone() for j in range(E // R)], combined.clone()


def test_python_dispatchers_and_low_latency_equal_reference(trace_dir):
    t = traces.read_router_trace(trace_dir, step=0, layer=1, num_experts=E)
    idx, rows = t.calls[0].topk_idx, t.calls[0].hidden_states
    p, disp = reference(idx, rows)
    combined = _C.reference_combine(p, [disp[g]["expert_input"] for g in range(R)])
    for kind in ("allgather", "alltoall", "flex"):
        got = run(python_dispatch, (R, 2), kind, idx, rows)
        for g, (ei, out) in enumerate(got):
            assert torch.equal(ei, disp[g]["expert_input"]), (kind, g)
            assert torch.equal(out, combined[g]), (kind, g)
    # Low-latency: per local expert, the rows in the reference's order (source rank, then token);
    # its weighted combine with weights 1 is the same fp32 sum in ascending expert id.
    L = E // R
    for g, (per_expert, out) in enumerate(run(low_latency, (R, 2), idx, rows)):
        tpe = disp[g]["tokens_per_expert"].tolist()
        assert torch.equal(torch.cat(per_expert), disp[g]["expert_input"]), g
        assert [x.shape[0] for x in per_expert] == tpe and len(tpe) == L
        assert torch.equal(out, combined[g]), g


def test_cli_replay_and_plan_read_it(trace_dir, tmp_path):
    rc, out, err = cli("replay", "--trace", trace_dir, "--step", 1, "--experts", E, "--ranks-per-node", 2,
                       "--hidden", H, "--json", "--out", tmp_path)
    assert rc == 0, err
    j = json.loads(out)
    want = truth()
    assert j["num_ranks"] == R and j["megatron"]["step"] == 1
    for l, layer in enumerate(j["megatron"]["layers"]):
        idx = want[(1, l)][0]
        assert layer["label"] == f"decoder layer {l}"
        assert layer["tokens_per_expert"] == torch.bincount(idx.flatten().long(), minlength=E).tolist()
    for f in ("layer_load.svg", "layer_traffic.svg"):
        assert (tmp_path / f).exists()
    rc, out, err = cli("plan", "--trace", trace_dir, "--experts", E, "--ranks-per-node", 2, "--hidden", H, "--json")
    assert rc == 0, err
    assert [c["label"] for c in json.loads(out)["calls"]] == [f"decoder layer {i}" for i in range(LAYERS)]


def spoil(d, rank, line, fn):
    path = os.path.join(d, f"router_trace_rank{rank}.jsonl")
    lines = open(path).read().splitlines(True)
    lines[line - 1] = fn(lines[line - 1])
    open(path, "w").write("".join(lines))


def edit_record(fn):
    def apply(text):
        rec = json.loads(text)
        fn(rec)
        return json.dumps(rec) + "\n"
    return apply


BAD = {
    "missing rank": (lambda d: os.remove(os.path.join(d, "router_trace_rank2.jsonl")), {},
                     "{d}/router_trace_rank2.jsonl is missing (found ranks 0, 1, 3); a step's routing needs every rank"),
    "cut short": (lambda d: spoil(d, 1, 6, lambda t: t[:50]), {},
                  "{d}/router_trace_rank1.jsonl:6: not a complete JSON record ({{\"step\": 1, \"stage\": \"pre_dispatch\", \"bl...); "
                  "was the file cut short?"),
    "layer absent": (lambda d: spoil(d, 3, 2, lambda t: ""), {},
                     "{d}/router_trace_rank3.jsonl: no record for step 0, decoder layer 1 (rank 0 has one at line 2)"),
    "index out of range": (lambda d: spoil(d, 2, 2, edit_record(lambda r: r["top_indices"][4].__setitem__(1, E))),
                           {"num_experts": E},
                           "{d}/router_trace_rank2.jsonl:2: top_indices[4][1] = 16 is outside [-1, 16) (--experts)"),
    "rank field": (lambda d: spoil(d, 1, 1, edit_record(lambda r: r.__setitem__("rank", 3))), {},
                   "{d}/router_trace_rank1.jsonl:1: rank = 3, but the file is rank 1's"),
    "sidecar short": (lambda d: open(os.path.join(d, "hidden_states_rank2.bin"), "r+b").truncate(5000), {},
                      "{d}/hidden_states_rank2.bin: the record at {d}/router_trace_rank2.jsonl:2 needs bytes "
                      "[3072, 6144) but the file has 5000 bytes"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_files_same_error_in_python_and_cpp(tmp_path, case):
    d = str(tmp_path / "t")
    writer_trace(d)
    make_bad, kwargs, message = BAD[case]
    make_bad(d)
    message = message.format(d=d)
    with pytest.raises(ValueError) as e:
        traces.read_router_trace(d, **kwargs)
    assert str(e.value) == message
    args = ["dispatch", "--trace", d, "--layer", 1, "--dispatcher", "flex", "--out", tmp_path / "o"]
    rc, out, err = cli(*args, "--experts", E)
    assert rc == 1 and err.strip() == "moed dispatch: " + message, err
