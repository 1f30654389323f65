"""KV cache policies behind one protocol (see ``cache.base``).

Every module in this package is imported here so that its ``@register_policy`` runs; adding a
policy is adding a module.
"""

import importlib
import pkgutil

from cache.base import AttentionView, CacheFullError, CacheLayout, CachePolicy
from cache.registry import POLICIES, build_policy, describe_policies, register_policy

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = [
    "AttentionView",
    "CacheFullError",
    "CacheLayout",
    "CachePolicy",
    "POLICIES",
    "build_policy",
    "describe_policies",
    "register_policy",
]
