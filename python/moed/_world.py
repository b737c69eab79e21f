"""Ranks: moed.launch (the threads world), moed.init (the MPI world) and moed.Group."""
import atexit
import sys
import threading

import torch

from . import _C
from ._C import AbortedError

_local = threading.local()
_mpi_group = None
_num_threads = None  # None: torch.get_num_threads()


def set_num_threads(n):
    """Worker threads moed uses per process (split over the rank threads of moed.launch).

    Default: torch.get_num_threads(). Applies to worlds made afterwards."""
    global _num_threads
    if n is not None and int(n) < 1:
        raise ValueError(f"num_threads = {n} must be >= 1 (or None for torch's)")
    _num_threads = None if n is None else int(n)


def get_num_threads():
    return _num_threads if _num_threads is not None else torch.get_num_threads()


def set_tensor_cache_limit(num_bytes):
    """Bytes of freed large moed Tensor blocks kept for reuse (default 1 GiB; 0 = off)."""
    if int(num_bytes) < 0:
        raise ValueError(f"num_bytes = {num_bytes} must be >= 0")
    _C.set_tensor_cache_limit(int(num_bytes))


tensor_cache_stats = _C.tensor_cache_stats
release_tensor_cache = _C.release_tensor_cache


class Group:
    """A group of ranks: a thin layer over a C++ moed::World handle.

    Everything collective goes through ``self.handle`` (moed._C.WorldHandle), so another
    backend (a torch.distributed process group, say) can stand behind the same class."""

    def __init__(self, handle):
        self.handle = handle

    def rank(self):
        return self.handle.rank()

    def size(self):
        return self.handle.size()

    def ranks_per_node(self):
        return self.handle.ranks_per_node()

    def num_nodes(self):
        return self.handle.num_nodes()

    @property
    def backend(self):
        return self.handle.backend()

    def barrier(self):
        self.handle.barrier()

    def agree(self, error=""):
        """Collective check: every rank passes "" or its error; all raise the lowest rank's."""
        self.handle.agree(error or "")

    def __repr__(self):
        if not self.handle.alive():
            return "moed.Group(ended)"
        return (f"moed.Group(rank={self.rank()}, size={self.size()}, "
                f"ranks_per_node={self.ranks_per_node()}, backend={self.backend!r})")


def current_group():
    """The calling rank's group: inside moed.launch its rank thread's, else moed.init()'s."""
    g = getattr(_local, "group", None)
    if g is None:
        g = _mpi_group
    if g is None:
        raise RuntimeError("moed: no group here; call inside moed.launch(...) or after moed.init()")
    return g


def _with_rank(rank, e):
    msg = str(e) if str(e).startswith(f"rank {rank}: ") else f"rank {rank}: {e}"
    try:
        new = type(e)(msg)
    except Exception:
        new = RuntimeError(msg)
    new.rank = rank
    return new


def launch(fn, num_ranks, *args, ranks_per_node=0, timeout=300.0, threads_per_rank=None):
    """Runs fn(group, *args) on num_ranks rank threads; returns the results in rank order.

    ranks_per_node splits the ranks into emulated nodes (0 = one node). An exception on one
    rank aborts the world: every rank blocked in a moed call raises moed.AbortedError, and
    launch raises the first failing rank's exception again, same type, message "rank r: ...",
    chained to the original (``__cause__``). timeout bounds every wait for a peer (seconds).
    threads_per_rank: moed worker threads per rank (default get_num_threads() // num_ranks)."""
    if threads_per_rank is None:
        threads_per_rank = max(1, get_num_threads() // max(int(num_ranks), 1))

    def body(handle):
        group = Group(handle)
        prev = getattr(_local, "group", None)
        _local.group = group
        try:
            return (True, fn(group, *args))
        except BaseException as e:  # noqa: B902 (every failure is reported by rank)
            return (False, e)
        finally:
            _local.group = prev

    results, errors, _ = _C.run_threads(int(num_ranks), int(ranks_per_node), float(timeout),
                                        int(threads_per_rank), body)
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        # The root cause: the lowest rank whose error is not the echo of another's failure.
        rank, err = next(((r, e) for r, e in failed if not isinstance(e, AbortedError)), failed[0])
        raise _with_rank(rank, err) from err
    return list(results)


def init(ranks_per_node=0, timeout=300.0, threads_per_rank=None):
    """The group of the MPI world (one process per rank; run under mpirun). Idempotent.

    MPI is initialised here unless mpi4py (or anyone) did it first, and finalised at exit. An
    exception that escapes a rank marks it failed, so the other ranks raise instead of
    waiting."""
    global _mpi_group
    if _mpi_group is not None:
        return _mpi_group
    if threads_per_rank is None:
        threads_per_rank = get_num_threads()
    handle = _C.mpi_world(int(ranks_per_node), float(timeout), int(threads_per_rank))
    _mpi_group = Group(handle)
    atexit.register(shutdown)
    prev_hook = sys.excepthook

    def hook(t, v, tb):
        try:
            if handle.alive():
                handle.fail(f"{t.__name__}: {v}")
        except Exception:
            pass
        prev_hook(t, v, tb)

    sys.excepthook = hook
    return _mpi_group


def shutdown():
    """Ends the MPI world made by init() (dispatchers first) and finalises MPI."""
    global _mpi_group
    if _mpi_group is not None:
        _mpi_group.handle.close()
        _mpi_group = None
        _C.mpi_finalize()
