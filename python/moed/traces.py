"""Megatron-Core's routing traces: read them into tensors, or write them in the same format.

Megatron-Core's ``RouterTracer`` (``megatron/core/transformer/moe/router_trace.py``, enabled with
``--moe-routing-trace-path``) writes one JSONL file per rank, ``router_trace_rank{r}.jsonl``, one
record per router call::

    {"step": 0, "stage": "pre_dispatch", "block": "decoder", "layer": 3, "rank": 0,
     "num_tokens": 128, "topk": 8, "top_indices": [[12, 45, ...], ...]}

MTP layers carry ``"mtp_idx"`` too. With ``capture_hidden_states`` the router's input rows go to
``hidden_states_rank{r}.bin`` (bf16 ``[num_tokens, hidden]``, raw int16 bit patterns) and the record
gains ``hs_offset``, ``hs_bytes`` and ``hs_shape``.

A step's routing is every rank's record for the same (step, block, mtp_idx, layer) joined in rank
order. A rank that called one router several times in a step (micro-batches, a recomputed forward)
has several such records; the n-th of each rank form call n. This is what ``moed replay --trace
DIR``, ``moed plan --trace DIR`` and ``moed dispatch --trace DIR`` read (the C++ reader,
``moed/megatron_trace.h``, gives the same errors)::

    import moed.traces
    t = moed.traces.read_router_trace("traces/", step=0, num_experts=64)
    for call in t.calls:                      # one per layer (and micro-batch)
        print(call.label, call.topk_idx.shape, call.hidden_states.shape)

Bad files raise ``ValueError`` naming the file, the line and the value.
"""
import json
import os
import re
from dataclasses import dataclass, field
from typing import List, Optional

import torch

__all__ = ["LayerCall", "RouterTrace", "read_router_trace", "RouterTraceWriter"]


@dataclass
class LayerCall:
    """One router call of every rank, joined in rank order.

    topk_idx: int32 ``[num_ranks * tokens_per_rank, topk]`` (-1 = none).
    hidden_states: bf16 ``[num_ranks * tokens_per_rank, hidden]`` or None (no sidecar, or not read).
    """
    block: str
    mtp_idx: Optional[int]
    layer: int
    microbatch: int
    tokens_per_rank: int
    topk_idx: torch.Tensor
    hidden_states: Optional[torch.Tensor] = None

    @property
    def label(self) -> str:
        s = f"mtp {self.mtp_idx} layer {self.layer}" if self.block == "mtp" else f"{self.block} layer {self.layer}"
        return s + (f" microbatch {self.microbatch}" if self.microbatch > 0 else "")


@dataclass
class RouterTrace:
    dir: str
    num_ranks: int
    step: int
    steps: List[int]
    calls: List[LayerCall] = field(default_factory=list)


def _trace_file(d, r):
    return os.path.join(d, f"router_trace_rank{r}.jsonl")


def _sidecar_file(d, r):
    return os.path.join(d, f"hidden_states_rank{r}.bin")


def _key_label(key):
    block, mtp, layer = key
    return f"mtp {mtp} layer {layer}" if block == "mtp" else f"{block} layer {layer}"


def _count_ranks(d):
    if not os.path.isdir(d):
        raise ValueError(f"{d}: not a directory of router_trace_rank*.jsonl files")
    ranks = sorted(int(m.group(1)) for f in os.listdir(d)
                   if (m := re.fullmatch(r"router_trace_rank(\d+)\.jsonl", f)) and len(m.group(1)) < 7)
    if not ranks:
        raise ValueError(f"{d}: no router_trace_rank*.jsonl files (Megatron-Core's RouterTracer "
                         "writes one per rank)")
    for r in range(ranks[-1] + 1):
        if r not in ranks:
            raise ValueError(f"{_trace_file(d, r)} is missing (found ranks "
                             f"{', '.join(map(str, ranks))}); a step's routing needs every rank")
    return ranks[-1] + 1


def _int(rec, name, at):
    if name not in rec:
        raise ValueError(f'{at}: the record has no "{name}"')
    v = rec[name]
    if not isinstance(v, int) or isinstance(v, bool):
        raise ValueError(f'{at}: "{name}" = {json.dumps(v)} is not an integer')
    return v


def _scan(path, rank, step, block, mtp_idx, layer, num_experts):
    """(steps, selected {key: [record]}, layers_of_step {key: line}) of one rank's file."""
    steps, selected, layers = set(), {}, {}
    with open(path) as f:
        for line_no, text in enumerate(f, start=1):
            if not text.strip():
                continue  # Megatron's own reader skips blank lines
            at = f"{path}:{line_no}"
            try:
                rec = json.loads(text)
            except json.JSONDecodeError:
                t = text.rstrip("\n")
                raise ValueError(f"{at}: not a complete JSON record ({t[:40] + '...' if len(t) > 40 else t}); "
                                 "was the file cut short?") from None
            if not isinstance(rec, dict):
                raise ValueError(f"{at}: not a complete JSON record ({text[:40]}); was the file cut short?")
            st, lay, r = _int(rec, "step", at), _int(rec, "layer", at), _int(rec, "rank", at)
            if r != rank:
                raise ValueError(f"{at}: rank = {r}, but the file is rank {rank}'s")
            if not isinstance(rec.get("block"), str):
                raise ValueError(f'{at}: "block" is missing or not a string')
            mtp = _int(rec, "mtp_idx", at) if "mtp_idx" in rec else -1
            steps.add(st)
            if step is None or st != step or rec["block"] != block:
                continue
            key = (rec["block"], mtp, lay)
            layers.setdefault(key, line_no)
            if (mtp_idx is not None and mtp != mtp_idx) or (layer is not None and lay != layer):
                continue
            n, k = _int(rec, "num_tokens", at), _int(rec, "topk", at)
            if n < 0:
                raise ValueError(f"{at}: num_tokens = {n} < 0")
            if not 1 <= k <= 4096:
                raise ValueError(f"{at}: topk = {k} is outside [1, 4096]")
            top = rec.get("top_indices")
            if not isinstance(top, list) or len(top) != n:
                rows = f"{len(top)} rows" if isinstance(top, list) else "no rows"
                raise ValueError(f"{at}: top_indices has {rows} but num_tokens = {n}")
            for t, row in enumerate(top):
                if not isinstance(row, list) or len(row) != k:
                    raise ValueError(f"{at}: top_indices[{t}] = {json.dumps(row)[:60]} does not hold "
                                     f"topk = {k} indices")
                for j, e in enumerate(row):
                    if not isinstance(e, int) or isinstance(e, bool):
                        raise ValueError(f"{at}: top_indices[{t}][{j}] = {json.dumps(e)} is not an integer")
                    if e < -1 or (num_experts and e >= num_experts) or e > 2**31 - 1:
                        bound = f"{num_experts}) (--experts)" if num_experts else "2^31)"
                        raise ValueError(f"{at}: top_indices[{t}][{j}] = {e} is outside [-1, {bound}")
            hs = None
            if "hs_offset" in rec:
                off, nbytes = _int(rec, "hs_offset", at), _int(rec, "hs_bytes", at)
                shape = rec.get("hs_shape")
                if (not isinstance(shape, list) or len(shape) != 2 or shape[0] != n
                        or not isinstance(shape[1], int) or shape[1] < 1):
                    raise ValueError(f"{at}: hs_shape = {json.dumps(shape) if 'hs_shape' in rec else '(none)'}; "
                                     f"RouterTracer writes [num_tokens = {n}, hidden]")
                if off < 0 or nbytes != n * shape[1] * 2:
                    raise ValueError(f"{at}: hs_bytes = {nbytes} at hs_offset = {off}, but hs_shape "
                                     f"{json.dumps(shape)} of bf16 is {n * shape[1] * 2} bytes")
                hs = (off, nbytes, shape[1])
            selected.setdefault(key, []).append(
                {"line": line_no, "num_tokens": n, "topk": k, "top": top, "hs": hs})
    return steps, selected, layers


def _read_rows(d, rank, rec, path):
    at = f"{path}:{rec['line']}"
    if rec["hs"] is None:
        raise ValueError(f"{at}: the record has no hidden states (hs_offset); RouterTracer writes "
                         "them with capture_hidden_states=True")
    off, nbytes, hidden = rec["hs"]
    side = _sidecar_file(d, rank)
    if not os.path.exists(side):
        raise ValueError(f"{side}: cannot open (the sidecar of {at})")
    size = os.path.getsize(side)
    if off + nbytes > size:
        raise ValueError(f"{side}: the record at {at} needs bytes [{off}, {off + nbytes}) but the "
                         f"file has {size} bytes")
    with open(side, "rb") as f:
        f.seek(off)
        data = f.read(nbytes)
    # The bytes are torch's int16 view of the bf16 rows, as Megatron's
    # load_hidden_states_for_record reads them back.
    return torch.frombuffer(bytearray(data), dtype=torch.int16).view(torch.bfloat16).reshape(-1, hidden)


def read_router_trace(trace_dir: str, step: Optional[int] = None, block: str = "decoder",
                      mtp_idx: Optional[int] = None, layer: Optional[int] = None,
                      microbatch: Optional[int] = None, num_experts: Optional[int] = None,
                      hidden_states: bool = True) -> RouterTrace:
    """Reads one step of a Megatron-Core routing trace directory.

    Arguments:
        trace_dir: the directory of ``router_trace_rank{r}.jsonl`` (every rank's file present).
        step: the step (default: the lowest step in rank 0's file).
        block: ``"decoder"`` or ``"mtp"``; mtp_idx: the MTP head (default: every head).
        layer: one layer (default: every layer of the step).
        microbatch: the n-th call of a layer in the step (default: every one).
        num_experts: when given, every index must be below it.
        hidden_states: read the sidecar rows where the records have them (an error when a
            selected record has none only if some other selected record of that call has them).

    Returns:
        A ``RouterTrace`` whose ``calls`` are ordered by (block, mtp_idx, layer, microbatch).
    """
    R = _count_ranks(trace_dir)
    steps0, _, _ = _scan(_trace_file(trace_dir, 0), 0, None, block, mtp_idx, layer, num_experts)
    if not steps0:
        raise ValueError(f"{_trace_file(trace_dir, 0)}: no records")
    st = min(steps0) if step is None else step
    if st not in steps0:
        raise ValueError(f"{_trace_file(trace_dir, 0)}: no record for step {st} (steps present: "
                         f"{', '.join(map(str, sorted(steps0)))})")
    files = [_scan(_trace_file(trace_dir, r), r, st, block, mtp_idx, layer, num_experts) for r in range(R)]
    _, sel0, layers0 = files[0]
    p0 = _trace_file(trace_dir, 0)
    if not sel0:
        want = f"block '{block}'" + (f" mtp {mtp_idx}" if mtp_idx is not None else "") + \
            (f" layer {layer}" if layer is not None else "")
        have = ", ".join(_key_label(k) for k in sorted(layers0)) or "none"
        raise ValueError(f"{p0}: no record for step {st}, {want} (layers of that step: {have})")
    for r in range(1, R):
        for key, recs in sorted(files[r][1].items()):
            if key not in sel0:
                raise ValueError(f"{_trace_file(trace_dir, r)}:{recs[0]['line']}: step {st}, "
                                 f"{_key_label(key)} is absent from rank 0's file {p0}")
    out = RouterTrace(dir=trace_dir, num_ranks=R, step=st, steps=sorted(steps0))
    for key in sorted(sel0):
        recs0 = sel0[key]
        for r in range(1, R):
            pr = _trace_file(trace_dir, r)
            recs = files[r][1].get(key)
            if recs is None:
                raise ValueError(f"{pr}: no record for step {st}, {_key_label(key)} (rank 0 has one at "
                                 f"line {recs0[0]['line']})")
            if len(recs) != len(recs0):
                raise ValueError(f"{pr}: {len(recs)} records for step {st}, {_key_label(key)} but rank "
                                 f"0's file has {len(recs0)} (every rank calls the router once per "
                                 "micro-batch)")
        for mb in range(len(recs0)):
            if microbatch is not None and mb != microbatch:
                continue
            n, k = recs0[mb]["num_tokens"], recs0[mb]["topk"]
            tops, rows = [], []
            want_rows = hidden_states and any(files[r][1][key][mb]["hs"] is not None for r in range(R))
            for r in range(R):
                rec = files[r][1][key][mb]
                at = f"{_trace_file(trace_dir, r)}:{rec['line']}"
                if rec["num_tokens"] != n:
                    raise ValueError(f"{at}: num_tokens = {rec['num_tokens']}, but rank 0's record "
                                     f"({p0}:{recs0[mb]['line']}) has {n}; moed splits a step's tokens "
                                     "evenly over the ranks")
                if rec["topk"] != k:
                    raise ValueError(f"{at}: topk = {rec['topk']}, but rank 0's record has {k}")
                tops.append(torch.tensor(rec["top"], dtype=torch.int32).reshape(n, k))
                if want_rows:
                    rows.append(_read_rows(trace_dir, r, rec, _trace_file(trace_dir, r)))
            if want_rows and len({x.shape[1] for x in rows}) != 1:
                raise ValueError(f"{trace_dir}: step {st}, {_key_label(key)}: the ranks' hs_shape "
                                 f"disagree on hidden ({sorted({x.shape[1] for x in rows})})")
            out.calls.append(LayerCall(block=key[0], mtp_idx=None if key[1] < 0 else key[1],
                                       layer=key[2], microbatch=mb, tokens_per_rank=n,
                                       topk_idx=torch.cat(tops),
                                       hidden_states=torch.cat(rows) if want_rows else None))
    if not out.calls:
        raise ValueError(f"{p0}: step {st} has no micro-batch {microbatch} (its layers have "
                         f"{len(next(iter(sel0.values())))})")
    return out


class RouterTraceWriter:
    """Writes one rank's trace exactly as Megatron-Core's RouterTracer does (same file names,
    record fields in the same order, ``json.dumps`` of each record, bf16 sidecar), so traces made
    outside Megatron read the same everywhere.

        w = RouterTraceWriter("traces/", rank=0, capture_hidden_states=True)
        w.record(step=0, layer=1, top_indices=idx, hidden_states=x)   # idx [T, K], x [T, H]
        w.close()
    """

    def __init__(self, output_dir: str, rank: int, capture_hidden_states: bool = False):
        os.makedirs(output_dir, exist_ok=True)
        self.rank = rank
        self.output_path = _trace_file(output_dir, rank)
        self.hs_path = _sidecar_file(output_dir, rank)
        open(self.output_path, "w").close()
        self._hs_offset = 0
        self.capture_hidden_states = capture_hidden_states
        if capture_hidden_states:
            open(self.hs_path, "wb").close()

    def record(self, step: int, layer: int, top_indices: torch.Tensor,
               hidden_states: Optional[torch.Tensor] = None, block: str = "decoder",
               mtp_idx: Optional[int] = None) -> None:
        """Appends one router call: ``top_indices`` ``[num_tokens, topk]`` (any integer dtype) and,
        with capture_hidden_states, its input rows ``[num_tokens, hidden]`` (stored as bf16)."""
        top = top_indices.detach().to("cpu", torch.int32)
        rec = {"step": int(step), "stage": "pre_dispatch", "block": block, "layer": int(layer),
               "rank": self.rank, "num_tokens": int(top.shape[0]), "topk": int(top.shape[1])}
        if mtp_idx is not None:
            rec["mtp_idx"] = int(mtp_idx)
        if self.capture_hidden_states and hidden_states is not None:
            hs = hidden_states.detach().to("cpu", dtype=torch.bfloat16).contiguous()
            data = hs.view(torch.int16).numpy().tobytes()
            with open(self.hs_path, "ab") as f:
                f.write(data)
            rec["hs_offset"] = self._hs_offset
            rec["hs_bytes"] = len(data)
            rec["hs_shape"] = list(hs.shape)
            self._hs_offset += len(data)
        rec["top_indices"] = top.tolist()
        with open(self.output_path, "a") as f:
            f.write(json.dumps(rec) + "\n")

    def close(self) -> None:
        """Nothing is buffered; kept for symmetry with RouterTracer.flush()."""
