"""Greedy generation with a transformers MoE model whose experts are spread over gloo processes.

    python -m moed.examples.ep_generate --model qwen3_moe --ranks 4

Builds a small configuration of the model with random weights (``from_config`` under a fixed
seed: nothing is downloaded, token ids stand in for a tokenizer), starts ``--ranks`` processes
joined by a torch gloo group, and in each one generates ``--new-tokens`` tokens greedily for
its own ``--batch`` prompts:

1. once with all the experts in the process (the single-process model; every rank doing this
   on its own prompts is the all-experts-everywhere, data-parallel run);
2. once after ``moed.integrations.transformers.expert_parallel(model, group)``: each rank
   keeps E / R experts and moed's dispatch and combine move the tokens.

Rank 0 also runs the single-process model on every rank's prompts at once, and with
``--hf-ep`` (the default; ``--no-hf-ep`` skips it) transformers' own expert parallelism
(``DistributedConfig(ep_size=R)``, needs ``accelerate``; loaded from a checkpoint of the same
weights in a temporary directory) runs all the prompts on every rank. It prints the generated
ids, whether each run equals the single-process one, and the generate times (the slowest
rank's, the fastest of ``--repeat`` runs).
"""
import argparse
import os
import shutil
import socket
import tempfile
import time
from datetime import timedelta

import torch

def _config(name, hidden, layers, experts, topk, vocab):
    """A small configuration of architecture ``name``: ``experts`` experts, ``topk`` per token,
    no end token (so that every rank generates as many tokens)."""
    import transformers
    heads, head_dim = 4, hidden // 4
    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=2, max_position_embeddings=4096,
                  num_experts_per_tok=topk, initializer_range=0.1, tie_word_embeddings=False,
                  bos_token_id=None, eos_token_id=None, pad_token_id=0)
    if name == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, head_dim=head_dim, num_experts=experts,
                                           intermediate_size=2 * hidden,
                                           moe_intermediate_size=hidden, norm_topk_prob=True)
    if name == "mixtral":
        return transformers.MixtralConfig(**common, head_dim=head_dim, num_local_experts=experts,
                                          intermediate_size=hidden)
    if name == "olmoe":
        return transformers.OlmoeConfig(**common, num_experts=experts, intermediate_size=hidden)
    if name == "deepseek_v3":
        # Grouped routing (2 groups, the best 1 kept), one shared expert, the first layer dense.
        return transformers.DeepseekV3Config(
            **common, n_routed_experts=experts, n_group=2, topk_group=1, n_shared_experts=1,
            first_k_dense_replace=1, intermediate_size=2 * hidden, moe_intermediate_size=hidden,
            q_lora_rank=None, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=head_dim)
    if name == "gpt_oss":
        return transformers.GptOssConfig(**common, head_dim=head_dim, num_local_experts=experts,
                                         intermediate_size=hidden, sliding_window=8)
    raise ValueError(f"--model {name!r} is not one of {MODELS}")


MODELS = ("qwen3_moe", "mixtral", "olmoe", "deepseek_v3", "gpt_oss")


def make_model(name, *, hidden=64, layers=2, experts=8, topk=2, vocab=256, seed=0,
               dtype=torch.float32):
    """A small ``name`` causal LM with random weights drawn under ``seed`` (the same on every
    process), in eval mode, generating without an end token (so every rank takes the same
    number of steps)."""
    from transformers import AutoModelForCausalLM
    config = _config(name, hidden, layers, experts, topk, vocab)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def generate(model, ids, new_tokens):
    """Greedy: exactly ``new_tokens`` new ids per prompt; returns them [B, new_tokens] and the
    seconds it took."""
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    return out[:, ids.shape[1]:], time.perf_counter() - start


def prompts(args):
    """Every rank's prompts, [ranks * batch, prompt_len], from a seed of their own."""
    g = torch.Generator().manual_seed(args.seed + 1)
    return torch.randint(1, args.vocab, (args.ranks * args.batch, args.prompt_len), generator=g)


def _timed(model, ids, args):
    """generate ``args.repeat`` times (every rank together); the ids and the fastest time of
    the slowest rank (the machine's other jobs only ever add time)."""
    import torch.distributed as dist
    best = float("inf")
    for _ in range(args.repeat):
        dist.barrier()
        ids_out, t = generate(model, ids, args.new_tokens)
        best = min(best, _slowest(t))
    return ids_out, best


def _slowest(seconds):
    import torch.distributed as dist
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _worker(rank, args, port, workdir):
    import torch.distributed as dist
    import moed
    from moed.integrations.transformers import expert_parallel

    # transformers' own EP reads the launcher's variables, as torchrun sets them.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(args.ranks))
    torch.set_num_threads(args.threads)
    moed.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks,
                            timeout=timedelta(seconds=args.timeout))
    group = moed.from_torch(dist.group.WORLD, timeout=args.timeout)
    dtype = getattr(torch, args.dtype)
    everyone = prompts(args)
    mine = everyone[rank * args.batch:(rank + 1) * args.batch]
    rec = {}
    with group:
        model = make_model(args.model, hidden=args.hidden, layers=args.layers,
                           experts=args.experts, topk=args.topk, vocab=args.vocab,
                           seed=args.seed, dtype=dtype)
        if rank == 0:
            rec["single"], rec["t_single"] = min(
                (generate(model, everyone, args.new_tokens) for _ in range(args.repeat)),
                key=lambda r: r[1])
            if args.hf_ep:
                model.save_pretrained(workdir)
        rec["dp"], rec["t_dp"] = _timed(model, mine, args)

        rec["params"] = sum(p.numel() for p in model.parameters())
        expert_parallel(model, group, dispatcher=args.dispatcher)
        rec["ep_params"] = sum(p.numel() for p in model.parameters())
        generate(model, mine, 2)  # warm-up: moed's buffers and worker threads
        rec["moed"], rec["t_moed"] = _timed(model, mine, args)
        del model

        if args.hf_ep:
            from transformers import AutoModelForCausalLM
            from transformers.distributed import DistributedConfig
            for impl in ("all_to_all", "all_reduce"):
                # tp_plan={}: dense layers replicated; the EP group holds one batch (all prompts).
                config = DistributedConfig(tp_size=args.ranks, tp_plan={}, ep_size=args.ranks,
                                           ep_implementation=impl)
                hf = AutoModelForCausalLM.from_pretrained(workdir, dtype=dtype,
                                                          distributed_config=config).eval()
                hf.generation_config.eos_token_id = None
                generate(hf, everyone, 2)
                rec[impl], rec["t_" + impl] = _timed(hf, everyone, args)
                del hf
    torch.save(rec, os.path.join(workdir, f"rank{rank}.pt"))
    moed.dist.destroy_process_group(dist.group.WORLD)
    dist.destroy_process_group()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=MODELS, default="qwen3_moe")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--batch", type=int, default=2, help="prompts per rank")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--dispatcher", choices=("flex", "alltoall", "allgather"), default="flex")
    p.add_argument("--hf-ep", action=argparse.BooleanOptionalAction, default=True,
                   help="also run transformers' own expert parallelism")
    p.add_argument("--repeat", type=int, default=3, help="generate runs timed; the fastest counts")
    p.add_argument("--threads", type=int, default=1, help="torch and moed threads per rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300.0)
    args = p.parse_args(argv)

    import torch.multiprocessing as mp
    with socket.socket() as s:  # a free port for torch's rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workdir = tempfile.mkdtemp(prefix="moed-ep-generate-")
    try:
        mp.spawn(_worker, args=(args, port, workdir), nprocs=args.ranks)
        recs = [torch.load(os.path.join(workdir, f"rank{r}.pt")) for r in range(args.ranks)]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    R, B, n = args.ranks, args.batch, args.new_tokens
    single = recs[0]["single"]
    print(f"{args.model}: {args.layers} layers, hidden {args.hidden}, {args.experts} experts "
          f"top-{args.topk}, {args.dtype}, random weights (seed {args.seed}); {R} ranks x {B} "
          f"prompts of {args.prompt_len} tokens, {n} new tokens each, greedy")
    print(f"parameters per rank: {recs[0]['params']:,} with all experts, "
          f"{recs[0]['ep_params']:,} expert-parallel")
    for r, rec in enumerate(recs):
        for b, row in enumerate(rec["moed"].tolist()):
            print(f"rank {r} prompt {b}: {row}")
    moed_ids = torch.cat([rec["moed"] for rec in recs])
    dp_ids = torch.cat([rec["dp"] for rec in recs])
    rows = [("single process, all experts, all prompts", "t_single", single),
            ("all experts on every rank, each rank its prompts", "t_dp", dp_ids),
            (f"moed EP ({args.dispatcher}), each rank its prompts", "t_moed", moed_ids)]
    if args.hf_ep:
        for impl in ("all_to_all", "all_reduce"):
            rows.append((f"transformers EP ({impl}), all prompts on every rank", "t_" + impl,
                         recs[0][impl]))
    print(f"{'run':<56} {'generate s':>10} {'tokens/s':>9}  ids == single process")
    for label, key, ids in rows:
        t = recs[0][key]
        print(f"{label:<56} {t:>10.3f} {R * B * n / t:>9.1f}  {torch.equal(ids, single)}")
    return 0 if torch.equal(moed_ids, single) else 1


if __name__ == "__main__":
    raise SystemExit(main())
