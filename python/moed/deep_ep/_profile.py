"""Wall time of each moed.deep_ep call, for DeepEP-style benchmarks: DeepEP's tests time their
CUDA kernels by name with the torch profiler (``bench_kineto``); on CPU the work is the call
itself, so the compat package's ``deep_ep.utils.testing.bench_kineto`` turns recording on and
reads these records instead. Off (one global test per call) unless recording."""
import time
from typing import Callable, List, Optional, Tuple

_records: Optional[List[Tuple[str, float]]] = None


class _Phase:
    __slots__ = ("name", "t0")

    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()

    def __exit__(self, *exc) -> None:
        if _records is not None:
            _records.append((self.name, time.perf_counter() - self.t0))


class _Off:
    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc) -> None:
        pass


_OFF = _Off()


def phase(name: str):
    """``with phase("dispatch"):`` records the block's wall time while recording."""
    return _OFF if _records is None else _Phase(name)


def hook(name: str, fn: Optional[Callable[[], None]]) -> Optional[Callable[[], None]]:
    """A receive hook whose run is recorded under `name` too (the second "kernel" of a call
    with return_recv_hook, as DeepEP's send and receive kernels are two)."""
    if fn is None or _records is None:
        return fn

    def timed() -> None:
        with phase(name):
            fn()
    return timed


def start() -> None:
    """Starts recording (dropping earlier records)."""
    global _records
    _records = []


def stop() -> List[Tuple[str, float]]:
    """Stops recording; returns the (name, seconds) records in call order."""
    global _records
    records, _records = _records or [], None
    return records
