"""Property test of call sequences (hypothesis): random sequences of DeepEP-style calls on 2-4
rank threads — normal and cached dispatch, combine, low-latency dispatch and combine (hook,
zero-copy, out=), holding and dropping results, destroying a Buffer and making a new one — each
step checked against the reference, and every result still held re-checked bit for bit at the
end. Examples are derandomized (the same in every run); MOED_HYPOTHESIS_EXAMPLES sets how many
(200 by default; more by hand)."""
import os

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import moed  # noqa: E402
import moed.deep_ep as deep_ep  # noqa: E402
from test_deep_ep import make_inputs, ref_recv  # noqa: E402
from test_ownership import (check_low_latency, combine_want, expert_rows,  # noqa: E402
                            ll_inputs, unchanged)

EXAMPLES = int(os.environ.get("MOED_HYPOTHESIS_EXAMPLES", "200"))
M, H = 8, 128  # low-latency max tokens per rank, hidden (a multiple of 128: FP8)

STEP = st.one_of(
    st.tuples(st.just("ll_dispatch"), st.booleans(), st.booleans(), st.integers(0, 999)),
    st.tuples(st.just("ll_combine"), st.sampled_from(["plain", "hook", "zero_copy", "out"])),
    st.tuples(st.just("dispatch"), st.integers(0, 999)),
    st.tuples(st.just("cached_dispatch")),
    st.tuples(st.just("combine")),
    st.tuples(st.just("drop"), st.integers(0, 63)),
    st.tuples(st.just("new_buffer"), st.booleans()),
)


class Rank:
    """One rank's side of a sequence: its Buffer, the last dispatches, what it holds."""

    def __init__(self, group, E, K):
        self.g, self.E, self.K = group, E, K
        self.held = []  # (tensors, their snapshot)
        self.buffer = None
        self.new_buffer(False)

    def new_buffer(self, destroy):
        if self.buffer is not None and destroy:
            self.buffer.destroy()
        R = self.g.size()
        self.buffer = deep_ep.Buffer(self.g, int(1e8), deep_ep.Buffer.get_low_latency_rdma_size_hint(
            M, H, R, self.E), low_latency_mode=True, num_qps_per_rank=self.E // R, explicitly_destroy=True)
        self.ll = None      # (inputs, handle) of the last low-latency dispatch on this Buffer
        self.normal = None  # (inputs, recv_x, handle) of the last normal dispatch on this Buffer

    def hold(self, tensors):
        self.held.append((tensors, [t.clone() for t in tensors]))

    def ll_dispatch(self, use_fp8, hook, seed):
        r = self.g.rank()
        tokens, xs, idxs, ws = ll_inputs(self.g, M, H, self.E, self.K, seed)
        recv, count, handle, _, rhook = self.buffer.low_latency_dispatch(
            xs[r], idxs[r], M, self.E, use_fp8=use_fp8, return_recv_hook=hook)
        if hook:
            rhook()
        check_low_latency(self.g, xs, idxs, tokens, self.E, recv, count, handle, use_fp8)
        self.ll = ((idxs[r], ws[r]), handle)
        self.hold((list(recv) if use_fp8 else [recv]) + [count, handle[0], handle[1]])

    def ll_combine(self, mode):
        if self.ll is None:
            return
        (idx, w), handle = self.ll
        y = expert_rows(self.g, self.E, M, H)
        out = None
        if mode == "zero_copy":
            buf = self.buffer.get_next_low_latency_combine_buffer(handle)
            buf.copy_(y)
            y = torch.zeros_like(y)
        elif mode == "out":
            out = torch.full((idx.size(0), H + 5), 7.0, dtype=torch.bfloat16)[:, :H]
        combined, _, hook = self.buffer.low_latency_combine(
            y, idx, w, handle, zero_copy=mode == "zero_copy", return_recv_hook=mode == "hook", out=out)
        if mode == "hook":
            hook()
        assert out is None or combined is out
        assert torch.equal(combined, combine_want(idx, w, H))
        self.hold([combined])

    def dispatch(self, seed):
        R, r = self.g.size(), self.g.rank()
        xs, idxs, ws = make_inputs(R, self.E, self.K, H, seed)
        ntpr, _, ntpe, itir, _ = self.buffer.get_dispatch_layout(idxs[r], self.E)
        recv_x, recv_idx, recv_w, _, handle, _ = self.buffer.dispatch(
            xs[r], num_tokens_per_rank=ntpr, is_token_in_rank=itir, num_tokens_per_expert=ntpe,
            topk_idx=idxs[r], topk_weights=ws[r])
        rows, tidx, tw, *_ = ref_recv(xs, idxs, ws, self.E, R, r)
        assert torch.equal(recv_x, rows) and torch.equal(recv_idx, tidx) and torch.equal(recv_w, tw)
        self.normal = ((xs[r], itir), recv_x, handle)
        self.hold([recv_x, recv_idx, recv_w])

    def cached_dispatch(self):
        if self.normal is None:
            return
        (x, _), recv_x, handle = self.normal
        again = self.buffer.dispatch(x, handle=handle)[0]
        assert torch.equal(again, recv_x)
        self.hold([again])

    def combine(self):
        if self.normal is None:
            return
        (x, itir), recv_x, handle = self.normal
        combined, _, _ = self.buffer.combine(recv_x, handle)
        # x comes back once from every rank that received it, summed in fp32, rounded once.
        want = (x.float() * itir.sum(1, keepdim=True).float()).to(torch.bfloat16)
        assert torch.equal(combined, want)
        self.hold([combined])

    def drop(self, i):
        if self.held:
            del self.held[i % len(self.held)]  # its memory goes back at once (refcounts)

    def run(self, steps):
        for step in steps:
            getattr(self, step[0])(*step[1:])
        self.buffer.destroy()
        self.buffer = None
        return [unchanged(t, s) for t, s in self.held]


def sequence(group, steps, E, K):
    return Rank(group, E, K).run(steps)


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(world=st.sampled_from([(2, 0), (3, 0), (4, 0), (4, 2)]), experts_per_rank=st.integers(1, 3),
       k=st.sampled_from([1, 2, "E"]), steps=st.lists(STEP, min_size=1, max_size=12))
def test_call_sequences(world, experts_per_rank, k, steps):
    R, G = world
    E = R * experts_per_rank
    K = E if k == "E" else min(k, E)
    results = moed.launch(sequence, R, steps, E, K, ranks_per_node=G, timeout=60.0, threads_per_rank=1)
    for held in results:
        assert all(held), held
