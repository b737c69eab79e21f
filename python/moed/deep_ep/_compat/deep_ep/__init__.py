"""moed as DeepEP on CPU ranks: this package is importable as `deep_ep` only after an opt-in
(moed.deep_ep.install(), or PYTHONPATH=$(python3 -m moed.deep_ep)), so a real DeepEP is never
shadowed. Everything here is moed.deep_ep's."""
import moed.deep_ep as _moed_deep_ep
from moed.deep_ep import (Buffer, Config, ElasticBuffer, EPHandle, EventHandle, EventOverlap, HybridEPBuffer,
                          topk_idx_t)

from .utils.envs import get_logical_domain_size, get_physical_domain_size

__moed__ = True  # what moed.deep_ep.install() checks an already-imported deep_ep for
__version__ = "2.1.0+moed"  # DeepEP's API level, served by moed

__all__ = ["Buffer", "Config", "ElasticBuffer", "EPHandle", "EventHandle", "EventOverlap", "HybridEPBuffer",
           "topk_idx_t",
           "get_physical_domain_size", "get_logical_domain_size"]
