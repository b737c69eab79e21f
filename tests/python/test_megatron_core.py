"""The real megatron-core package (PyPI, unchanged) on moed: Megatron-Core's own MoELayer with
its Flex dispatcher on both DeepEP-family backends ("deepep": deep_ep.Buffer, "hybridep":
deep_ep.HybridEPBuffer, both moed's after moed.deep_ep.install()), and its "alltoall" /
"allgather" dispatchers beside them, in 2 and 4 gloo processes, forward and backward, against
a float64 torch computation of the same layer in one process.

Megatron-Core insists on CUDA in places that have nothing to do with moed's dispatch; the
workers patch exactly these attributes at run time (in the test only, never in moed):

  1. torch.cuda.current_device -> torch.device("cpu"): the router moves its weight there
     (Router.gating) and Megatron's collectives allocate their outputs there
     (tensor_parallel.mappings).
  2. megatron.core.transformer.moe.moe_utils.te_general_gemm = None: without Transformer
     Engine the name is never defined, and RouterGatingLinearFunction reads it (NameError).
  3. MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = "cpu" (the "alltoall" comparison only):
     its constructor makes a torch.cuda.Stream for device-to-host copies unless one is set.
  4. MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize (the "alltoall" comparison only):
     the same copies to the CPU (splits as numpy), without the CUDA stream and event.

and, for speed only, torch._dynamo.config.disable = True: Megatron's jit_fuser is torch.compile,
which compiles the Flex dispatcher's dispatch_preprocess (routing-map reshapes, no moed call) for
about 35 s a process on CPU (the same check passed compiled when this test was written);
here it runs eagerly.
"""
import os
import shutil
import socket
import tempfile
import time

import pytest
import torch

import moed  # noqa: E402
import moed.deep_ep  # noqa: E402

# Before Megatron-Core is imported (importorskip imports it, here and in every worker, which
# loads this module first): fused_a2a looks for deep_ep once, at its import.
moed.deep_ep.install()
pytest.importorskip("megatron.core")

pytestmark = pytest.mark.skipif(not moed._C.has_gloo(), reason="moed built without gloo")

E, K, H, F, S, B = 8, 2, 32, 48, 6, 2  # experts, top-k, hidden, expert ffn, sequence, batch
# (Megatron's moe_token_dispatcher_type, its Flex backend); "moed_*": the same MoELayer with
# moed.megatron's dispatcher of that kind in place of Megatron's, made from the layer's own
# arguments (num_local_experts, local_expert_indices, config, pg_collection).
CASES = [("flex", "deepep"), ("flex", "hybridep"), ("alltoall", None), ("allgather", None),
         ("moed_flex", None), ("moed_alltoall", None)]
CASE_IDS = ["flex_deepep", "flex_hybridep", "alltoall", "allgather", "moed_flex", "moed_alltoall"]
BUDGET = 240.0  # seconds for one world's processes


def weights():
    """The layer's parameters, the same on every rank: router [E, H], fc1 [E, F, H], fc2
    [E, H, F], float64 (each rank loads its local experts' slices)."""
    g = torch.Generator().manual_seed(40)
    return (torch.randn(E, H, generator=g, dtype=torch.float64) * 0.3,
            torch.randn(E, F, H, generator=g, dtype=torch.float64) * 0.2,
            torch.randn(E, H, F, generator=g, dtype=torch.float64) * 0.2)


def rank_inputs(rank):
    """Rank `rank`'s hidden states [S, B, H] and the loss weights d loss / d out, float64."""
    g = torch.Generator().manual_seed(100 + rank)
    return (torch.randn(S, B, H, generator=g, dtype=torch.float64),
            torch.randn(S, B, H, generator=g, dtype=torch.float64))


def reference(R):
    """The same layer in float64, one process, every rank's tokens: per rank (out, x.grad,
    router.weight.grad), and the experts' weight gradients over all tokens."""
    wr, w1, w2 = (w.clone().requires_grad_() for w in weights())
    per_rank = []
    for r in range(R):
        x, gy = rank_inputs(r)
        x = x.clone().requires_grad_()
        t = x.view(-1, H)
        logits = t @ wr.t()
        top_logits, idx = logits.topk(K, dim=-1)
        probs = torch.softmax(top_logits, dim=-1)  # Megatron's default: softmax over the top k
        out = torch.zeros_like(t)
        for k in range(K):
            e = idx[:, k]
            a = torch.nn.functional.gelu(torch.einsum("th,tfh->tf", t, w1[e]))
            out = out + torch.einsum("tf,thf->th", a * probs[:, k:k + 1], w2[e])
        out = out.view(S, B, H)
        per_rank.append((out, x, gy))
    loss = sum((out * gy).sum() for out, _, gy in per_rank)
    loss.backward()
    # The router's gradient is each rank's own (Megatron sums it across data parallel ranks
    # later, outside the layer): recompute per rank.
    router_grads = []
    for r in range(R):
        wr_r = weights()[0].clone().requires_grad_()
        x, gy = rank_inputs(r)
        t = x.view(-1, H)
        top_logits, idx = (t @ wr_r.t()).topk(K, dim=-1)
        probs = torch.softmax(top_logits, dim=-1)
        out = torch.zeros_like(t)
        for k in range(K):
            e = idx[:, k]
            a = torch.nn.functional.gelu(torch.einsum("th,tfh->tf", t, w1.detach()[e]))
            out = out + torch.einsum("tf,thf->th", a * probs[:, k:k + 1], w2.detach()[e])
        (out.view(S, B, H) * gy).sum().backward()
        router_grads.append(wr_r.grad)
    return ([(o.detach(), x.grad, rg) for (o, x, _), rg in zip(per_rank, router_grads)],
            w1.grad, w2.grad)


# ---- what each process runs ----

def _patch_for_cpu(kind):
    """The run-time patches listed in the module docstring (this process only)."""
    import numpy as np
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher as A

    torch._dynamo.config.disable = True  # speed only (module docstring)
    torch.cuda.current_device = lambda: torch.device("cpu")  # 1
    moe_utils.te_general_gemm = None  # 2
    if kind != "alltoall":
        return

    def dtoh_on_cpu(self, point, tokens_per_expert=None):
        # Megatron's copies at its dtoh point, minus the stream: the splits reach the CPU as
        # numpy (what all_to_all_single takes), the counts as they are.
        if not self.drop_and_pad and point == self.cuda_dtoh_point:
            for name in ("input_splits", "output_splits", "output_splits_tp"):
                v = getattr(self, name)
                if torch.is_tensor(v):
                    setattr(self, name, v.numpy().astype(np.int64))
        return tokens_per_expert

    A.cuda_dtoh_stream = "cpu"  # 3
    A._maybe_dtoh_and_synchronize = dtoh_on_cpu  # 4


def _layer(kind, backend, R):
    if kind.startswith("moed_"):
        import moed.megatron
        from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
        layer = _layer("allgather", None, R)  # Megatron's AllGather makes nothing on CUDA
        layer.token_dispatcher = moed.megatron.make_dispatcher(
            kind[len("moed_"):], layer.config, num_local_experts=layer.num_local_experts,
            local_expert_indices=layer.local_expert_indices,
            pg_collection=get_default_pg_collection())
        return layer
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_config import TransformerConfig
    config = TransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=1, ffn_hidden_size=F,
        moe_ffn_hidden_size=F, num_moe_experts=E, moe_router_topk=K,
        moe_router_load_balancing_type="none", moe_token_dispatcher_type=kind,
        moe_flex_dispatcher_backend=backend or "deepep", expert_model_parallel_size=R,
        add_bias_linear=False, use_cpu_initialization=True, params_dtype=torch.float32)
    layer = MoELayer(config, get_moe_module_spec(use_te=False, num_experts=E).submodules)
    wr, w1, w2 = weights()
    L = E // R
    with torch.no_grad():
        layer.router.weight.copy_(wr)
        for j, expert in enumerate(layer.experts.local_experts):
            e = layer.local_expert_indices[j]
            expert.linear_fc1.weight.copy_(w1[e])
            expert.linear_fc2.weight.copy_(w2[e])
    assert len(layer.experts.local_experts) == L
    return layer


def _run_case(kind, backend, rank, R, ref):
    layer = _layer(kind, backend, R)
    x64, gy = rank_inputs(rank)
    x = x64.float().requires_grad_()
    d = layer.token_dispatcher
    t = type(getattr(d, "_comm_manager", d))
    dispatcher = f"{t.__module__}.{t.__name__}"
    worst = 0.0
    for _ in range(2):  # a second step through the same (cached) buffers
        layer.zero_grad()
        x.grad = None
        out, bias = layer(x)
        assert bias is None
        (out * gy.float()).sum().backward()
        (ref_out, ref_gx, ref_gr), ref_g1, ref_g2 = ref[0][rank], ref[1], ref[2]
        pairs = [(out, ref_out), (x.grad, ref_gx), (layer.router.weight.grad, ref_gr)]
        for j, expert in enumerate(layer.experts.local_experts):
            e = layer.local_expert_indices[j]
            pairs += [(expert.linear_fc1.weight.grad, ref_g1[e]),
                      (expert.linear_fc2.weight.grad, ref_g2[e])]
        for got, want in pairs:
            err = (got.double() - want).abs().max().item() / want.abs().max().item()
            worst = max(worst, err)
    return dict(worst=worst, manager=dispatcher)


def worker(rank, R, port, out):
    torch.set_num_threads(1)
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=R)
    from megatron.core import parallel_state
    from megatron.core.transformer.moe import fused_a2a
    rec = dict(have_deep_ep=fused_a2a.HAVE_DEEP_EP, have_hybridep=fused_a2a.HAVE_HYBRIDEP)
    try:
        parallel_state.initialize_model_parallel(expert_model_parallel_size=R)
        ref = reference(R)
        for (kind, backend), name in zip(CASES, CASE_IDS):
            _patch_for_cpu(kind)
            t0 = time.monotonic()
            try:
                rec[name] = _run_case(kind, backend, rank, R, ref)
            except Exception as e:  # noqa: B902 (the test reports every case's outcome)
                rec[name] = dict(error=f"{type(e).__name__}: {e}")
            rec[name]["seconds"] = time.monotonic() - t0
            dist.barrier()
    finally:
        torch.save(rec, os.path.join(out, f"{rank}.pt"))
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


# ---- the tests ----

def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_RUNS = {}


def run_world(R):
    """Every case in R gloo processes, once per test session: the records by rank."""
    if R not in _RUNS:
        out = tempfile.mkdtemp(prefix="moed-mcore-test-")
        ctx = torch.multiprocessing.spawn(worker, nprocs=R, join=False, args=(R, _free_port(), out))
        deadline = time.monotonic() + BUDGET
        for p in ctx.processes:
            p.join(max(0.0, deadline - time.monotonic()))
        left = [r for r, p in enumerate(ctx.processes) if p.is_alive()]
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join()
        recs = [torch.load(os.path.join(out, f"{r}.pt")) if os.path.exists(os.path.join(out, f"{r}.pt"))
                else None for r in range(R)]
        shutil.rmtree(out)
        assert not left, f"ranks {left} still running after {BUDGET} s"
        _RUNS[R] = recs
    return _RUNS[R]


@pytest.mark.parametrize("case", CASE_IDS)
@pytest.mark.parametrize("R", [2, 4], ids=["P2", "P4"])
def test_moe_layer_matches_float64(R, case):
    recs = run_world(R)
    for r, rec in enumerate(recs):
        assert rec is not None, f"rank {r} saved nothing"
        assert rec["have_deep_ep"] and rec["have_hybridep"], rec
        got = rec[case]
        assert "error" not in got, f"rank {r}: {got['error']}"
        # fp32 against float64: a few ulps of fp32 through two GEMMs and the router.
        assert got["worst"] < 1e-5, (r, got)
    mc = "megatron.core.transformer.moe.token_dispatcher."
    want = {"flex_deepep": mc + "_DeepepManager", "flex_hybridep": mc + "_HybridEPManager",
            "alltoall": mc + "MoEAlltoAllTokenDispatcher", "allgather": mc + "MoEAllGatherTokenDispatcher",
            "moed_flex": "moed.megatron.MoEFlexTokenDispatcher",
            "moed_alltoall": "moed.megatron.MoEAlltoAllTokenDispatcher"}[case]
    assert all(rec[case]["manager"] == want for rec in recs)


def test_moe_config_reads_a_real_transformer_config():
    """A TransformerConfig with the knobs that do not apply on CPU set: MoEConfig takes it."""
    from megatron.core.transformer.transformer_config import TransformerConfig
    from moed.megatron import MoEConfig
    tc = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=1, num_moe_experts=E,
                           moe_router_topk=K, moe_token_dispatcher_type="flex",
                           moe_flex_dispatcher_backend="hybridep", moe_permute_fusion=False,
                           moe_router_dtype="fp32", moe_expert_capacity_factor=1.25,
                           moe_token_drop_policy="position", expert_model_parallel_size=4,
                           moe_hybridep_num_sms=8, add_bias_linear=False)
    c = MoEConfig.from_config(tc)
    assert (c.num_moe_experts, c.moe_router_topk, c.expert_model_parallel_size) == (E, K, 4)
    assert c.expert_tensor_parallel_size == 1
    assert (c.moe_expert_capacity_factor, c.moe_token_drop_policy) == (1.25, "position")
    assert (c.moe_flex_dispatcher_backend, c.moe_router_dtype, c.moe_hybridep_num_sms) == ("hybridep", "fp32", 8)
    assert c.moe_weighted_combine is False and c.router_padding_multiple() == 0
