"""deep_ep.utils.semantic for moed's DeepEP: small helpers of DeepEP's Python layer."""
import functools
import weakref
from typing import Any, Optional


def value_or(value: Optional[Any], default: Any) -> Any:
    """value, or default when value is None."""
    return default if value is None else value


def weak_lru(maxsize: Optional[int] = 128, typed: bool = False):
    """functools.lru_cache for methods, holding `self` weakly (so the cache keeps no object
    alive)."""
    def decorate(method):
        @functools.lru_cache(maxsize, typed)
        def cached(self_ref, *args, **kwargs):
            return method(self_ref(), *args, **kwargs)

        @functools.wraps(method)
        def wrapper(self, *args, **kwargs):
            return cached(weakref.ref(self), *args, **kwargs)
        return wrapper
    return decorate
