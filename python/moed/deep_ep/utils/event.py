"""deep_ep.utils.event: DeepEP's EventHandle and EventOverlap, moed's (complete on return)."""
from moed.deep_ep.event import EventHandle, EventOverlap

__all__ = ["EventHandle", "EventOverlap"]
