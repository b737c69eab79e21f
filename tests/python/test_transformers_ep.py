"""moed.integrations.transformers: real transformers MoE models expert-parallel over 2 and 4
gloo processes, against the same model with all its experts in one process.

Each process builds the model from a small configuration (hidden 64, 2 layers, 8 experts,
top-2) with random weights under a fixed seed (nothing downloaded), runs it on its own prompts
(2 prompts of 5 + rank tokens, so ranks send different numbers of tokens) with all its experts,
then again after expert_parallel: the logits of one forward pass, and 32 greedily generated
tokens, which must be the same ids. Also: one experts module with no tokens on rank 0, and a
loss's gradients (experts' and embedding's) through the expert-parallel model.

The logits bound. float32: 1e-5 absolute (logits of magnitude < 5; observed at most 1.5e-6).
Every weighted expert output is computed as in one process (transformers' experts forward, or
moed's fp32 product where transformers makes it in fp32), and moed's combine adds a token's
K = 2 terms in fp32 and rounds once, as transformers' grouped_mm experts do (with two terms the
order cannot matter). What differs is the rows an expert's GEMM sees (every rank's tokens of
that expert instead of this rank's), and torch's CPU GEMM rounds a row differently with 1 to 3
rows than with more. bfloat16: the same, with bf16 GEMMs; observed bit for bit here, bound
2^-4 (a few bf16 ulps of such logits) where the GEMMs round differently."""
import os
import shutil
import socket
import tempfile

import pytest
import torch

pytest.importorskip("transformers")
import moed  # noqa: E402

pytestmark = pytest.mark.skipif(not moed._C.has_gloo(), reason="moed built without gloo")

NEW_TOKENS = 32
BOUNDS = {"float32": 1e-5, "bfloat16": 2.0 ** -4}
# Every architecture at 2 ranks; Qwen3-MoE and Mixtral at 4 (the acceptance pair) too.
CASES = {2: [("qwen3_moe", "float32"), ("mixtral", "float32"), ("olmoe", "float32"),
             ("deepseek_v3", "float32"), ("gpt_oss", "float32"), ("qwen3_moe", "bfloat16"),
             ("mixtral", "bfloat16")],
         4: [("qwen3_moe", "float32"), ("mixtral", "float32"), ("qwen3_moe", "bfloat16"),
             ("mixtral", "bfloat16")]}


def _prompts(rank):
    # Rank r: 2 prompts of 5 + r tokens, so ranks send different numbers of tokens.
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randint(1, 256, (2, 5 + rank), generator=g)


def _worker(rank, size, port, out, cases):
    import torch.distributed as dist
    from moed.examples.ep_generate import generate, make_model
    from moed.integrations.transformers import expert_parallel

    torch.set_num_threads(1)
    moed.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size)
    group = moed.from_torch(dist.group.WORLD, timeout=120.0)
    rec = {}
    with group:
        ids = _prompts(rank)
        for arch, dtype in cases:
            model = make_model(arch, seed=7, dtype=getattr(torch, dtype))
            with torch.no_grad():
                logits = model(ids).logits
            tokens, _ = generate(model, ids, NEW_TOKENS)
            expert_parallel(model, dist.group.WORLD)
            first = model.get_submodule(
                moed.integrations.transformers.expert_module_names(model)[0])
            with torch.no_grad():
                ep_logits = model(ids).logits
            ep_tokens, _ = generate(model, ids, NEW_TOKENS)
            rec[arch, dtype] = dict(logits=logits, tokens=tokens, ep_logits=ep_logits,
                                    ep_tokens=ep_tokens, num_local=first.num_experts,
                                    local_shape=tuple(first.down_proj.shape))
        rec["uneven"] = _uneven(rank, expert_parallel)
        rec["backward"] = _backward(rank, size, expert_parallel)
    torch.save(rec, os.path.join(out, f"{rank}.pt"))
    moed.dist.destroy_process_group(dist.group.WORLD)
    dist.destroy_process_group()


def _uneven(rank, expert_parallel):
    """One experts module called directly, rank r with 3 * r tokens (none on rank 0): its
    output and the whole module's (all experts, kept aside) on the same tokens."""
    import copy
    from moed.examples.ep_generate import make_model
    model = make_model("qwen3_moe", seed=8)
    name = moed.integrations.transformers.expert_module_names(model)[0]
    whole = copy.deepcopy(model.get_submodule(name))
    expert_parallel(model, None)
    g = torch.Generator().manual_seed(200 + rank)
    x = torch.randn(3 * rank, 64, generator=g)
    idx = torch.randn(3 * rank, 8, generator=g).topk(2).indices
    w = torch.rand(3 * rank, 2, generator=g)
    with torch.no_grad():
        return model.get_submodule(name)(x, idx, w), whole(x, idx, w)


def _backward(rank, size, expert_parallel):
    """A loss's gradients, Mixtral in float32: those of this rank's experts against the sum
    over ranks of the whole model's (each rank's tokens reach them), and the embedding's
    against the whole model's; the largest differences relative to the largest gradient."""
    import torch.distributed as dist
    from moed.examples.ep_generate import make_model
    model = make_model("mixtral", seed=9)
    ids = _prompts(rank)
    model(ids).logits.square().mean().backward()
    name = moed.integrations.transformers.expert_module_names(model)[0]
    whole = {n: p.grad.clone() for n, p in model.get_submodule(name).named_parameters()}
    for grad in whole.values():
        dist.all_reduce(grad)
    embedding = model.get_input_embeddings().weight.grad.clone()
    model.zero_grad(set_to_none=True)
    expert_parallel(model, None)
    model(ids).logits.square().mean().backward()
    mine = slice(rank * 8 // size, (rank + 1) * 8 // size)
    experts = max((p.grad - whole[n][mine]).abs().max() / whole[n].abs().max()
                  for n, p in model.get_submodule(name).named_parameters())
    got = model.get_input_embeddings().weight.grad
    return experts.item(), ((got - embedding).abs().max() / embedding.abs().max()).item()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module", params=[2, 4], ids=["P2", "P4"])
def runs(request):
    size = request.param
    out = tempfile.mkdtemp(prefix="moed-hf-test-")
    try:
        torch.multiprocessing.spawn(_worker, args=(size, _free_port(), out, CASES[size]),
                                    nprocs=size)
        yield size, [torch.load(os.path.join(out, f"{r}.pt")) for r in range(size)]
    finally:
        shutil.rmtree(out)


def _cases():
    return sorted({c for cs in CASES.values() for c in cs})


@pytest.mark.parametrize("arch,dtype", _cases())
def test_logits_and_generation(runs, arch, dtype):
    size, recs = runs
    if (arch, dtype) not in CASES[size]:
        pytest.skip(f"not run at {size} ranks")
    for r, rec in enumerate(recs):
        got = rec[arch, dtype]
        # Each rank holds E / R experts of 8.
        assert got["num_local"] == 8 // size and got["local_shape"][0] == 8 // size
        diff = (got["ep_logits"].float() - got["logits"].float()).abs().max().item()
        assert diff <= BOUNDS[dtype], (r, diff)
        assert torch.equal(got["ep_tokens"], got["tokens"]), (r, got["ep_tokens"], got["tokens"])


def test_uneven_tokens(runs):
    # Rank 0 sends nothing and still takes part; the others get what all experts give.
    for r, rec in enumerate(runs[1]):
        got, want = rec["uneven"]
        assert got.shape == want.shape == (3 * r, 64)
        if r:
            assert (got - want).abs().max().item() <= BOUNDS["float32"], r


def test_backward(runs):
    # Training works through the same path (moed's dispatch and combine are autograd
    # Functions); same bound as the logits', relative.
    for r, rec in enumerate(runs[1]):
        experts, embedding = rec["backward"]
        assert experts <= BOUNDS["float32"] and embedding <= BOUNDS["float32"], (r, experts, embedding)


def test_errors():
    from moed.examples.ep_generate import make_model
    from moed.integrations.transformers import expert_parallel

    model = make_model("qwen3_moe", experts=6)
    with pytest.raises(ValueError, match=r"num_experts = 6 is not a multiple of the group's 4"):
        moed.launch(lambda g: expert_parallel(model, g), 4)
    with pytest.raises(ValueError, match=r"dispatcher = 'nccl' is not one of"):
        expert_parallel(model, None, dispatcher="nccl")
    with pytest.raises(ValueError, match=r"names no \"ep_dispatch_experts\" module"):
        moed.launch(lambda g: expert_parallel(torch.nn.Linear(2, 2), g), 1)
