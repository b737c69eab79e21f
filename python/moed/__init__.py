"""moed: MoE token dispatch / combine on CPUs, from PyTorch.

    import moed

    def body(group, x):
        d = moed.megatron.MoEAlltoAllTokenDispatcher(2, group=group, num_moe_experts=8,
                                                     moe_router_topk=2)
        ...
    results = moed.launch(body, 4, x)   # 4 rank threads; results in rank order

Under mpirun, ``group = moed.init()`` gives the MPI world (one process per rank); in processes
torch started, ``moed.from_torch(pg)`` (or passing the gloo ProcessGroup itself) gives the gloo
world over that group.
Tensors cross into moed without copies (CPU tensors, read in place) and come back over
moed's own memory (DLPack); every moed call releases the GIL.
"""
import os as _os
import sys as _sys

import torch as _torch  # noqa: F401  (moed._C looks up torch's dtypes and DLPack entry)

# OpenMPI loads its components with dlopen and needs libmpi's symbols global; Python loads
# extension modules with RTLD_LOCAL, so open moed._C (which links libmpi) with RTLD_GLOBAL.
_flags = _sys.getdlopenflags()
_sys.setdlopenflags(_flags | _os.RTLD_GLOBAL)
try:
    from . import _C
finally:
    _sys.setdlopenflags(_flags)

from ._C import AbortedError
from ._world import (Group, launch, init, from_torch, join, current_group, set_num_threads,
                     get_num_threads, set_tensor_cache_limit, tensor_cache_stats,
                     release_tensor_cache, shutdown)
from . import dist
from .replicas import ExpertReplicas

# The torch dtype of moed's FP8 payloads: float8_e4m3fn where torch has it, else uint8 holding
# E4M3FN bits (torch 1.13).
fp8_dtype = getattr(_torch, "float8_e4m3fn", _torch.uint8)

__all__ = ["AbortedError", "Group", "launch", "init", "from_torch", "join", "current_group", "set_num_threads",
           "get_num_threads", "set_tensor_cache_limit", "tensor_cache_stats",
           "release_tensor_cache", "shutdown", "dist", "fp8_dtype", "ExpertReplicas"]


def __getattr__(name):
    # Submodules that pull in more (and may come from other work) load on first use.
    if name in ("megatron", "deep_ep", "traces"):
        import importlib
        return importlib.import_module("." + name, __name__)
    raise AttributeError(f"module 'moed' has no attribute {name!r}")
