"""``python3 -m moed.deep_ep`` prints the directory to put on PYTHONPATH so that ``import
deep_ep`` finds moed's DeepEP API (see moed.deep_ep.install)."""
from . import path

print(path())
