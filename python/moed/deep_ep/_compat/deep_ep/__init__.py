"""moed as DeepEP on CPU ranks: this package is importable as `deep_ep` only after an opt-in
(moed.deep_ep.install(), or PYTHONPATH=$(python3 -m moed.deep_ep)), so a real DeepEP is never
shadowed. Everything here is moed.deep_ep's."""
import importlib
import sys

import moed.deep_ep as _moed_deep_ep
from moed.deep_ep import (Buffer, Config, ElasticBuffer, EPHandle, EventHandle, EventOverlap, HybridEPBuffer,
                          __version__,
                          get_logical_domain_size, get_physical_domain_size, topk_idx_t, utils)

# NOTE: deep_ep.utils and its submodules are moed.deep_ep.utils's own module objects (one state
# each, e.g. init_dist's local rank), entered under both names before anything imports them.
for _name in ("envs", "event", "gate", "math", "refs", "semantic", "testing"):
    sys.modules[f"{__name__}.utils.{_name}"] = importlib.import_module(f"moed.deep_ep.utils.{_name}")
sys.modules[f"{__name__}.utils"] = utils

__moed__ = True  # what moed.deep_ep.install() checks an already-imported deep_ep for

__all__ = ["Buffer", "Config", "ElasticBuffer", "EPHandle", "EventHandle", "EventOverlap", "HybridEPBuffer",
           "topk_idx_t", "get_physical_domain_size", "get_logical_domain_size", "utils"]
