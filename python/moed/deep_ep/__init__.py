"""DeepEP's Python API on CPU ranks, over moed's C++ runtime.

    import moed.deep_ep as deep_ep       # moed's name for it: nothing named deep_ep appears

    buffer = deep_ep.Buffer(group, int(1e9))          # DeepEP's legacy Buffer (legacy.py)
    buffer = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=4096, hidden=7168,
                                   num_topk=8)         # DeepEP V2's (elastic.py)
    buffer = deep_ep.HybridEPBuffer(group, hidden_dim=7168, max_num_of_tokens_per_rank=4096,
                                    num_local_experts=8)  # its hybrid-ep branch's (hybrid_ep.py)
    ...

Client code written for DeepEP (``import deep_ep``, ``from deep_ep.utils import EventOverlap``)
runs unchanged once the caller opts in to moed as its DeepEP, which a GPU machine must never do
by accident (a real DeepEP is never shadowed):

    moed.deep_ep.install()               # in-process: `import deep_ep` now finds moed's
    # or, for a script you cannot edit (child processes inherit it):
    #   PYTHONPATH=$(python3 -m moed.deep_ep) python3 script.py

Both put one directory (``path()``) on the module path; it holds a package named ``deep_ep``
that re-exports this one. The module-level names are DeepEP's: ``__version__``,
``get_physical_domain_size``, ``get_logical_domain_size`` and ``utils``, with the submodules
DeepEP's own tests import (``utils.{math,envs,refs,gate,testing,event,semantic}``), written for
CPU ranks.
"""
import os
import sys

from .elastic import ElasticBuffer, EPHandle
from .event import EventHandle, EventOverlap
from .hybrid_ep import HybridEPBuffer
from .legacy import Buffer, Config, fp8_dtype, topk_idx_t
from . import utils
from .utils.envs import get_logical_domain_size, get_physical_domain_size

__version__ = "2.1.0+moed"  # DeepEP's API level, served by moed

__all__ = ["Buffer", "Config", "ElasticBuffer", "EPHandle", "EventHandle", "EventOverlap",
           "HybridEPBuffer", "topk_idx_t", "fp8_dtype", "get_physical_domain_size",
           "get_logical_domain_size", "utils", "install", "path"]


def path() -> str:
    """The directory that holds moed's ``deep_ep`` package (not on sys.path unless opted in)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "_compat")


def install() -> None:
    """Opt in: ``import deep_ep`` (in this process) gets moed's DeepEP API. Raises if another
    ``deep_ep`` was imported already, since both cannot be one module."""
    loaded = sys.modules.get("deep_ep")
    if loaded is not None and not getattr(loaded, "__moed__", False):
        raise RuntimeError(f"moed.deep_ep.install(): another deep_ep is already imported "
                           f"({getattr(loaded, '__file__', loaded)})")
    p = path()
    if p not in sys.path:
        sys.path.insert(0, p)
