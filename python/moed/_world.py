"""Ranks: moed.launch (the threads world), moed.init (the MPI world), moed.from_torch (the
gloo world over a torch.distributed group) and moed.Group."""
import atexit
import os
import socket
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
        # After shrink() / grow(): each rank's rank in the first world, and how many worlds
        # came before this one.
        self.members = list(range(handle.size()))
        self.generation = 0
        self._gloo = None  # the gloo world's store and settings (from_torch), for shrink/grow

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

    def fail(self, reason):
        """Marks this rank failed: every other rank's pending and later moed calls raise
        moed.AbortedError naming this rank and the reason. Returns (gloo, MPI: nothing ends)."""
        if self.handle.alive():
            self.handle.fail(str(reason))

    def shrink(self, timeout=None):
        """The group of the ranks that go on after a loss: collective over them (every rank
        that has not failed is waited for, up to the group's timeout). Ranks are renumbered in
        ascending order of their rank here; ``members`` keeps each one's rank in the first
        world. Make dispatchers and buffers anew on it (same bitwise promises). Threads world
        and gloo world (through the torch store); MPI while the lost process stays alive
        (OpenMPI has no ULFM). This group stays failed."""
        if self._gloo is not None:
            from . import _membership
            return _membership.shrink(self, timeout)
        handle, idx = self.handle.shrink()
        g = Group(handle)
        g.members = [self.members[i] for i in idx]
        g.generation = self.generation + 1
        return g

    def grow(self, joiners=1, timeout=None):
        """The gloo world back to a larger size: collective over this group's ranks and
        ``joiners`` replacement processes that call moed.join(); the replacements take the
        lowest ranks missing from the first world, the others keep theirs (``members``)."""
        if self._gloo is None:
            raise RuntimeError(f"moed: grow() needs a gloo world (moed.from_torch); this one is "
                               f"{self.backend}")
        from . import _membership
        return _membership.grow(self, int(joiners), timeout)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        # An exception leaving ``with group:`` fails this rank, so the others raise at once.
        if exc_type is not None and not issubclass(exc_type, AbortedError):
            try:
                self.fail(f"{exc_type.__name__}: {exc}")
            except Exception:
                pass
        return False

    def __repr__(self):
        if not self.handle.alive():
            return "moed.Group(ended)"
        return (f"moed.Group(rank={self.rank()}, size={self.size()}, "
                f"ranks_per_node={self.ranks_per_node()}, backend={self.backend!r})")


def current_group():
    """The calling rank's group: inside moed.launch its rank thread's, else moed.init()'s, else
    the gloo world over torch.distributed's default group (when it is initialised)."""
    g = getattr(_local, "group", None)
    if g is None:
        g = _mpi_group
    if g is None and _torch_dist_ready():
        g = from_torch()
    if g is None:
        raise RuntimeError("moed: no group here; call inside moed.launch(...), after moed.init(), "
                           "or after torch.distributed.init_process_group('gloo', ...)")
    return g


def as_group(group):
    """A moed.Group for group: a moed.Group as is, a torch.distributed ProcessGroup through
    from_torch, None as current_group()."""
    if group is None:
        return current_group()
    if isinstance(group, Group):
        return group
    import torch.distributed as tdist
    if isinstance(group, tdist.ProcessGroup):
        return from_torch(group)
    raise TypeError(f"group must be a moed.Group or a torch.distributed ProcessGroup, got "
                    f"{type(group).__name__}")


# ---- the gloo world over torch.distributed ----
_torch_groups = {}  # id(pg) -> (pg, Group): pg kept alive so its id is never reused
_torch_world_count = {}  # group name -> moed worlds made over it (unique store prefixes)
_hooks_installed = False


def _torch_dist_ready():
    try:
        import torch.distributed as tdist
        return tdist.is_available() and tdist.is_initialized()
    except Exception:
        return False


def _local_address():
    """The address this rank listens on: MOED_GLOO_ADDRESS, else the local address that routes
    to MASTER_ADDR (found with a UDP connect, which sends nothing), else 127.0.0.1."""
    if os.environ.get("MOED_GLOO_ADDRESS"):
        return os.environ["MOED_GLOO_ADDRESS"]
    master = os.environ.get("MASTER_ADDR", "")
    if master and master not in ("localhost", "127.0.0.1"):
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((master, int(os.environ.get("MASTER_PORT", "29500"))))
                return s.getsockname()[0]
        except OSError:
            pass
    return "127.0.0.1"


def _install_hooks():
    global _hooks_installed
    if _hooks_installed:
        return
    _hooks_installed = True
    atexit.register(_close_torch_groups)
    prev_hook = sys.excepthook

    def hook(t, v, tb):
        for _, g in list(_torch_groups.values()):
            try:
                g.fail(f"{t.__name__}: {v}")
            except Exception:
                pass
        prev_hook(t, v, tb)

    sys.excepthook = hook


def _close_torch_groups():
    from . import _membership
    _membership.close_all()
    for key, (_, g) in list(_torch_groups.items()):
        g.handle.close()
        del _torch_groups[key]


def from_torch(pg=None, ranks_per_node=0, timeout=300.0, threads_per_rank=None, address=None,
               host_id=""):
    """The moed.Group whose ranks are the processes of a torch.distributed group (default: the
    default group), over gloo's TCP transport, bootstrapped from the group's store.

    Collective over pg; made once per group and cached (later calls return it, so
    Buffer(pg, ...) and the dispatchers reuse it). ranks_per_node splits each host into
    emulated nodes (0 = one node per host). timeout bounds every wait for a peer (seconds).
    threads_per_rank: moed worker threads (default get_num_threads()). address: where this
    rank listens (default: see _local_address). An exception that leaves ``with group:`` (or
    reaches sys.excepthook) fails this rank, so the others raise instead of waiting; a rank
    whose process ends is noticed by its peers."""
    import torch.distributed as tdist
    if not _torch_dist_ready():
        raise RuntimeError("moed.from_torch: torch.distributed is not initialised "
                           "(call torch.distributed.init_process_group('gloo', ...) first)")
    c10d = tdist.distributed_c10d
    if pg is None:
        pg = c10d._get_default_group()
    hit = _torch_groups.get(id(pg))
    if hit is not None and hit[1].handle.alive():
        g = hit[1]
        if ranks_per_node and int(ranks_per_node) != g.ranks_per_node():
            raise ValueError(f"ranks_per_node = {ranks_per_node}, but moed's world over this group "
                             f"was made with {g.ranks_per_node()} (close it first: "
                             f"moed.dist.destroy_process_group(pg))")
        return g
    if not _C.has_gloo():
        raise RuntimeError("moed was built without gloo (libgloo-dev; MOED_WITH_GLOO=OFF)")
    if threads_per_rank is None:
        threads_per_rank = get_num_threads()
    # The default group is "default" (moed.join's default); torch's own name for it varies.
    if pg is c10d._get_default_group():
        name = "default"
    else:
        name = c10d._pg_names.get(pg, "group") if hasattr(c10d, "_pg_names") else "group"
    n = _torch_world_count.get(name, 0)
    _torch_world_count[name] = n + 1
    handle = _C.gloo_world(c10d._get_default_store(), f"moed/{name}/{n}/", tdist.get_rank(pg),
                           tdist.get_world_size(pg), address or _local_address(), str(host_id),
                           int(ranks_per_node), float(timeout), int(threads_per_rank))
    g = Group(handle)
    store = c10d._get_default_store()
    g._gloo = dict(store=store, name=name, address=address or _local_address(),
                   host_id=str(host_id), ranks_per_node=int(ranks_per_node),
                   timeout=float(timeout), threads=int(threads_per_rank))
    store.set(f"moed/{name}/elastic/origin", str(tdist.get_world_size(pg)).encode())
    _torch_groups[id(pg)] = (pg, g)
    _install_hooks()
    return g


def join(store=None, name="default", timeout=300.0, ranks_per_node=0, threads_per_rank=None,
         address=None, host_id=""):
    """A replacement process joins a gloo world that lost ranks (moed.from_torch's world, after
    the survivors' group.shrink()); the survivors' group.grow() takes it in. Returns the moed
    Group of the grown world. store: the torch.distributed store of that world (default:
    the default group's, PrefixStore("default_pg", TCPStore(MASTER_ADDR, MASTER_PORT)), inside
    PrefixStore("0/", ...) on torch 2.x); name:
    the torch group's name ("default" for the default group)."""
    import torch.distributed as tdist
    from . import _membership
    if store is None:
        tcp = tdist.TCPStore(os.environ.get("MASTER_ADDR", "127.0.0.1"),
                             int(os.environ.get("MASTER_PORT", "29500")), is_master=False,
                             timeout=__import__("datetime").timedelta(seconds=timeout))
        store = tdist.PrefixStore("default_pg", tcp)
        if int(torch.__version__.split(".")[0]) >= 2:
            # NOTE: torch 2.x's default group keeps its keys under its group name, "0".
            store = tdist.PrefixStore("0/", store)
    if threads_per_rank is None:
        threads_per_rank = get_num_threads()
    info = dict(store=store, name=name, address=address or _local_address(), host_id=str(host_id),
                ranks_per_node=int(ranks_per_node), timeout=float(timeout),
                threads=int(threads_per_rank))
    _install_hooks()
    return _membership.join(info, float(timeout))


def close_torch_group(pg=None):
    """Ends moed's world over pg (dispatchers and buffers first); torch's group stays."""
    import torch.distributed as tdist
    if pg is None and _torch_dist_ready():
        pg = tdist.distributed_c10d._get_default_group()
    hit = _torch_groups.pop(id(pg), None)
    if hit is not None:
        hit[1].handle.close()


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
