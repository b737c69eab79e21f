"""deep_ep.buffers.legacy, moed's: DeepEP's legacy Buffer on CPU ranks."""
from moed.deep_ep.legacy import Buffer, Config

__all__ = ["Buffer", "Config"]
