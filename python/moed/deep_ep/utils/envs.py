"""deep_ep.utils.envs for moed's DeepEP on CPU: process-group set-up and seeds as DeepEP's tests
use them, over torch.distributed's gloo backend, and the domain sizes as moed's world sees them
(a rank is a process; a node is `num_local_ranks` of them, emulated on one host when
WORLD_SIZE > 1 launches share it)."""
import os
import random
import warnings
from typing import Tuple

import torch
import torch.distributed as dist

import moed
from moed._world import as_group

_local_rank = None
_local_seed = 0
_global_seed = 0


def init_seed(global_seed: int) -> None:
    """Seeds torch and random with global_seed + rank (DeepEP's local seed)."""
    global _local_seed, _global_seed
    _global_seed = global_seed
    _local_seed = global_seed + dist.get_rank()
    torch.manual_seed(_local_seed)
    random.seed(_local_seed)


def get_local_seed() -> int:
    return _local_seed


def get_global_seed() -> int:
    return _global_seed


def dist_print(s: str = '', once_in_node: bool = False) -> None:
    """Prints on every rank (or on local rank 0 of each node), then a barrier."""
    assert _local_rank is not None, "init_dist first"
    if not once_in_node or _local_rank == 0:
        print(s, flush=True)
    dist.barrier()


def init_dist(local_rank: int, num_local_ranks: int, seed: int = 0) -> Tuple[int, int, dist.ProcessGroup]:
    """DeepEP's set-up on CPU: torch.distributed over gloo (MASTER_ADDR, MASTER_PORT; WORLD_SIZE
    nodes of num_local_ranks processes, this one node RANK), bfloat16 as the default dtype, the
    seeds, and moed's world over the returned group with one node per num_local_ranks ranks.

    Returns (rank, world size, group)."""
    global _local_rank
    _local_rank = local_rank
    ip = os.getenv('MASTER_ADDR', '127.0.0.1')
    port = int(os.getenv('MASTER_PORT', '8361'))
    num_nodes = int(os.getenv('WORLD_SIZE', 1))
    node_rank = int(os.getenv('RANK', 0))
    dist.init_process_group(backend='gloo', init_method=f'tcp://{ip}:{port}',
                            world_size=num_nodes * num_local_ranks,
                            rank=node_rank * num_local_ranks + local_rank)
    torch.set_default_dtype(torch.bfloat16)
    _fill_in_gloo_collectives()
    init_seed(seed)
    group = dist.new_group(list(range(num_local_ranks * num_nodes)))
    # Each rank of the group gets a share of the host's cores for moed's worker threads.
    threads = max(1, (os.cpu_count() or 1) // num_local_ranks)
    moed.from_torch(group, ranks_per_node=num_local_ranks if num_nodes > 1 else 0,
                    threads_per_rank=threads)
    return dist.get_rank(), dist.get_world_size(), group


def _fill_in_gloo_collectives() -> None:
    """DeepEP's tests call torch.distributed.all_gather_into_tensor, also with a stacked output
    ([R, *input.shape], as NCCL takes it), which the gloo backend lacks: older torch's has no
    such call (Debian's 1.13: "no support for _allgather_base in Gloo process group"), and
    2.x's takes only the concatenated form ("invalid tensor size"). Where the stacked form
    fails, it runs over moed's world of the same group (moed.dist's, the same result)."""
    if getattr(dist.all_gather_into_tensor, "__moed__", False):
        return
    try:
        probe = torch.empty(dist.get_world_size(), 1, dtype=torch.int32)
        # torch 2.x warns that the stacked form is deprecated: the caller's own call will say
        # so, not this probe (nor raise under PYTHONWARNINGS=error).
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            dist.all_gather_into_tensor(probe, torch.zeros(1, dtype=torch.int32))
        return
    except RuntimeError:
        pass
    torch_all_gather_into_tensor = dist.all_gather_into_tensor

    def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
        if dist.get_backend(group) != "gloo":
            return torch_all_gather_into_tensor(output_tensor, input_tensor, group, async_op)
        return moed.dist.all_gather_into_tensor(output_tensor, input_tensor, group=group,
                                                async_op=async_op)
    all_gather_into_tensor.__moed__ = True
    dist.all_gather_into_tensor = all_gather_into_tensor


def get_physical_domain_size(group) -> Tuple[int, int]:
    """(nodes, ranks per node) of moed's world over the group."""
    g = as_group(group)
    return g.num_nodes(), g.ranks_per_node()


def get_logical_domain_size(group, allow_hybrid_mode: bool = True) -> Tuple[int, int]:
    """(scale-out ranks, scale-up ranks): the nodes with hybrid mode across several nodes, else
    one domain of all ranks."""
    nodes, per_node = get_physical_domain_size(group)
    return (nodes, per_node) if allow_hybrid_mode and nodes > 1 else (1, nodes * per_node)


def check_nvlink_connections(group) -> None:
    """Every rank of a node shares its memory: nothing to check on CPU."""


def check_torch_deterministic() -> None:
    """DeepEP's guard against torch's deterministic mode filling uninitialised memory (a kernel
    that would race with its communication stream); kept, as the same setting is an error
    there."""
    fill = getattr(getattr(torch.utils, "deterministic", None), "fill_uninitialized_memory", False)
    assert not (torch.are_deterministic_algorithms_enabled() and fill)


def get_nvlink_gbs(factor: float = 0.9) -> float:
    """No NVLink on CPU ranks: 0 (DeepEP's value when it cannot detect one)."""
    return 0


def get_rdma_gbs(nic_name: str = '') -> float:
    """No RDMA NIC on CPU ranks: 0 (DeepEP's value when it cannot detect one)."""
    return 0


def check_fast_rdma_atomic_support(nic_name: str = '') -> bool:
    return False
