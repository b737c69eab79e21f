"""moed.deep_ep.utils (deep_ep.utils after the opt-in): `from deep_ep.utils import EventHandle,
EventOverlap` (as Megatron-Core's fused_a2a.py imports them) and the submodules DeepEP's tests import."""
from .event import EventHandle, EventOverlap

__all__ = ["EventHandle", "EventOverlap"]
