"""deep_ep.utils.testing for moed's DeepEP on CPU: DeepEP's benchmark helpers, timed on the host.
bench times a function; bench_kineto gives the time of named "kernels", which on CPU ranks are
moed.deep_ep's calls themselves (their names: 'get_dispatch_layout', 'dispatch', 'combine', and
for ElasticBuffer 'dispatch_impl' / 'combine_impl', 'send_impl' / 'recv_impl' (PP) and
'barrier'; a call with a receive hook is two: the send and the hook), recorded by moed.deep_ep while the benchmark runs. A name moed has no call for
(a GPU-only epilogue kernel) times 0, as DeepEP reports a kernel it did not find."""
import os
import sys
import time
from typing import Callable, Optional, Union

import numpy as np
import torch
import torch.distributed as dist

from moed.deep_ep import _profile

# A sweep larger than the last-level cache of these hosts, so each timed call starts cold, as
# DeepEP's L2 flush does on a GPU.
_FLUSH_BYTES = 64 << 20
_flush_buffer = None


def flush_l2_cache(enabled: bool = True) -> None:
    """Writes a buffer larger than the host's last-level cache (DeepEP flushes the GPU's L2)."""
    global _flush_buffer
    if not enabled:
        return
    if _flush_buffer is None:
        _flush_buffer = torch.empty(_FLUSH_BYTES // 4, dtype=torch.int32)
    _flush_buffer.zero_()


def bench(fn, num_warmups: int = 50, num_tests: int = 50, post_fn: Optional[Callable] = None,
          flush_l2: bool = True):
    """(average, min, max) seconds of fn over num_tests calls after num_warmups (the first
    timed call is dropped, as DeepEP does)."""
    for _ in range(num_warmups):
        fn()
    times = []
    for _ in range(num_tests):
        flush_l2_cache(flush_l2)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if post_fn is not None:
            post_fn()
    times = np.array(times[1:] if len(times) > 1 else times)
    return np.average(times), np.min(times), np.max(times)


class empty_suppress:
    def __enter__(self):
        return self

    def __exit__(self, *_):
        pass


class suppress_stdout_stderr:
    """Silences the process's stdout and stderr (file descriptors too) inside the block."""

    def __enter__(self):
        self._null = open(os.devnull, 'w')
        self._saved = [(s, os.dup(s.fileno())) for s in (sys.stdout, sys.stderr)]
        for s, _ in self._saved:
            s.flush()
            os.dup2(self._null.fileno(), s.fileno())
        return self

    def __exit__(self, *_):
        for s, fd in self._saved:
            s.flush()
            os.dup2(fd, s.fileno())
            os.close(fd)
        self._null.close()


def bench_kineto(fn, kernel_names: Union[str, tuple], num_tests: int = 30,
                 suppress_kineto_output: bool = False, trace_path: Optional[str] = None,
                 flush_l2: bool = True, barrier_comm_profiling: bool = False,
                 num_kernels_per_period: int = 1, barrier: Optional[Callable] = None):
    """Average seconds of each named kernel over num_tests calls of fn (see the module
    docstring for what a kernel is here). With num_kernels_per_period > 1, a list per name:
    the average of each of the period's calls of that name. trace_path: a Chrome trace of the
    records is written there."""
    assert isinstance(kernel_names, (str, tuple))
    names = (kernel_names,) if isinstance(kernel_names, str) else kernel_names
    fn()
    _profile.start()
    try:
        for _ in range(num_tests):
            flush_l2_cache(flush_l2)
            if barrier_comm_profiling:
                (barrier or dist.barrier)()
            fn()
    finally:
        records = _profile.stop()
    if trace_path is not None:
        _write_trace(trace_path, records)
    results = []
    for name in names:
        times = [t for n, t in records if n == name]
        if num_kernels_per_period > 1:
            assert len(times) % num_kernels_per_period == 0, (name, len(times))
            periods = max(len(times) // num_kernels_per_period, 1)
            results.append([sum(times[j::num_kernels_per_period]) / periods
                            for j in range(num_kernels_per_period)])
        else:
            results.append(sum(times) / len(times) if times else 0)
    return tuple(results) if isinstance(kernel_names, tuple) else results[0]


def _write_trace(path: str, records) -> None:
    import json
    t, events = 0.0, []
    for name, seconds in records:
        events.append({"name": name, "ph": "X", "ts": t * 1e6, "dur": seconds * 1e6, "pid": 0, "tid": 0})
        t += seconds
    with open(path, 'w') as f:
        json.dump({"traceEvents": events}, f)
