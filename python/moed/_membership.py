"""Who is in a gloo world after a loss, and who comes back: moed.Group.shrink and .grow for the
gloo world, and moed.join for a replacement process, agreed through the torch.distributed
store the world was made from (vLLM's elastic EP does the same through its store).

Keys under moed/<group name>/elastic/: `origin` (the first world's size), `latest` (the last
generation made), and per generation g: `<g>/alive/<rank>` (each rank that came, by its rank
in the first world), `<g>/arrivals` (a counter: the first to come leads), `<g>/members` (the
leader's list, ascending), `<g>/joiners` and `<g>/joiner/<j>` (replacements and the rank each
takes), and `<g>/world/`, the new gloo world's rendezvous. A rank keeps its first-world rank
as long as it lives; a replacement takes the lowest missing one."""
import datetime
import math
import time

from . import _C
from ._C import AbortedError


def _has(store, key, timeout):
    """Waits up to `timeout` seconds for `key`; True once it is there."""
    deadline = time.monotonic() + max(timeout, 0.0)
    while True:
        left = deadline - time.monotonic()
        try:
            store.wait([key], datetime.timedelta(seconds=max(min(left, 1.0), 0.001)))
            return True
        except RuntimeError:  # this slice timed out
            if left <= 0:
                return False


def _members(store, key, timeout, what):
    if not _has(store, key, timeout):
        raise TimeoutError(f"moed: {what}: no member list within {timeout:.0f} s (the leading "
                           f"rank was lost meanwhile? call it again)")
    return [int(v) for v in store.get(key).decode().split(",")]


def _ranks_per_node(info, members):
    """0 (one node per host) when the first world was so; else the gcd of the members per old
    node, as World::shrink does."""
    g = info["ranks_per_node"]
    if g == 0:
        return 0
    per = {}
    for m in members:
        per[m // g] = per.get(m // g, 0) + 1
    return max(1, math.gcd(*per.values()))


def _make(info, prefix, members, me, generation):
    from ._world import Group
    handle = _C.gloo_world(info["store"], prefix, members.index(me), len(members), info["address"],
                           info["host_id"], _ranks_per_node(info, members),
                           info["timeout"], info["threads"])
    g = Group(handle)
    g.members = list(members)
    g.generation = generation
    g._gloo = info
    _made.append(g)
    return g


_made = []  # the worlds made here, closed at exit (moed._world's hook)


def close_all():
    while _made:
        _made.pop().handle.close()


def _base(info, generation):
    return f"moed/{info['name']}/elastic/{generation}/"


def _arrive(group, timeout):
    """This rank comes to the next generation: (info, store, base, me, timeout, leads)."""
    info = group._gloo
    store = info["store"]
    base = _base(info, group.generation + 1)
    me = group.members[group.rank()]
    timeout = group.handle.timeout() if timeout is None else float(timeout)
    store.set(base + f"alive/{me}", b"1")
    return info, store, base, me, timeout, store.add(base + "arrivals", 1) == 1


def shrink(group, timeout=None):
    info, store, base, me, timeout, leads = _arrive(group, timeout)
    gen = group.generation + 1
    if leads:
        came = []
        deadline = time.monotonic() + timeout
        for r, orig in enumerate(group.members):
            # A rank this world saw fail is not waited for, but taken if it came anyway.
            wait = 0.0 if group.handle.rank_failed(r) else deadline - time.monotonic()
            if _has(store, base + f"alive/{orig}", wait):
                came.append(orig)
        store.set(base + "members", ",".join(map(str, came)).encode())
        store.set(f"moed/{info['name']}/elastic/latest", str(gen).encode())
    members = _members(store, base + "members", timeout + 10.0, "shrink")
    if me not in members:
        raise AbortedError(f"rank {group.rank()} (rank {me} of the first world) came to shrink() "
                           f"after the others had made the new world without it")
    return _make(info, base + "world/", members, me, gen)


def grow(group, joiners=1, timeout=None):
    info, store, base, me, timeout, leads = _arrive(group, timeout)
    gen = group.generation + 1
    if leads:
        deadline = time.monotonic() + timeout
        for orig in group.members:
            if not _has(store, base + f"alive/{orig}", deadline - time.monotonic()):
                raise TimeoutError(f"moed: grow: rank {orig} of the first world did not come")
        while store.add(base + "joiners", 0) < joiners:
            if time.monotonic() > deadline:
                raise TimeoutError(f"moed: grow: {store.add(base + 'joiners', 0)} of {joiners} "
                                   f"replacements came within {timeout:.0f} s")
            time.sleep(0.01)
        origin = int(store.get(f"moed/{info['name']}/elastic/origin"))
        free = sorted(set(range(origin + joiners)) - set(group.members))[:joiners]
        for j, r in enumerate(free, 1):
            store.set(base + f"joiner/{j}", str(r).encode())
        store.set(base + "members", ",".join(map(str, sorted(group.members + free))).encode())
        store.set(f"moed/{info['name']}/elastic/latest", str(gen).encode())
    members = _members(store, base + "members", timeout + 10.0, "grow")
    return _make(info, base + "world/", members, me, gen)


def join(info, timeout):
    """A replacement process: waits for a generation with a rank missing, then takes part in
    the next one (the survivors' grow())."""
    store = info["store"]
    root = f"moed/{info['name']}/elastic/"
    if not _has(store, root + "origin", timeout):
        raise TimeoutError(f"moed.join: no moed world named {info['name']!r} in this store")
    origin = int(store.get(root + "origin"))
    deadline = time.monotonic() + timeout
    while True:
        latest = int(store.get(root + "latest")) if _has(store, root + "latest", 0.0) else 0
        if latest > 0 and len(_members(store, root + f"{latest}/members", 1.0, "join")) < origin:
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"moed.join: no rank of {info['name']!r} was missing within "
                               f"{timeout:.0f} s")
        time.sleep(0.05)
    gen = latest + 1
    base = _base(info, gen)
    j = store.add(base + "joiners", 1)
    if not _has(store, base + f"joiner/{j}", deadline - time.monotonic()):
        raise TimeoutError("moed.join: the survivors did not grow the world (group.grow)")
    me = int(store.get(base + f"joiner/{j}"))
    members = _members(store, base + "members", 10.0, "join")
    return _make(info, base + "world/", members, me, gen)
