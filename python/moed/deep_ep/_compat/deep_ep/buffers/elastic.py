"""deep_ep.buffers.elastic, moed's: DeepEP V2's ElasticBuffer on CPU ranks."""
from moed.deep_ep.elastic import ElasticBuffer, EPHandle

__all__ = ["ElasticBuffer", "EPHandle"]
