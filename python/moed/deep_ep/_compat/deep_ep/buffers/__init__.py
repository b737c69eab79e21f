"""deep_ep.buffers, moed's: the legacy Buffer (and V2's ElasticBuffer) modules."""
