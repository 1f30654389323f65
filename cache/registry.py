"""Maps a config ``kind`` to its policy class and pydantic config class."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, TypeVar

from pydantic import BaseModel

from cache.base import CacheLayout, CachePolicy


@dataclass(frozen=True)
class PolicyEntry:
    kind: str
    policy: type[CachePolicy]
    config: type[BaseModel]


POLICIES: dict[str, PolicyEntry] = {}

PolicyT = TypeVar("PolicyT", bound=type[CachePolicy])


def register_policy(config: type[BaseModel]) -> Callable[[PolicyT], PolicyT]:
    """Class decorator: ``@register_policy(MyConfig)`` registers under ``MyConfig``'s ``kind``."""
    kind = config.model_fields["kind"].default

    def decorate(policy: PolicyT) -> PolicyT:
        if kind in POLICIES:
            raise ValueError(f"cache policy kind {kind!r} registered twice")
        POLICIES[kind] = PolicyEntry(kind, policy, config)
        return policy

    return decorate


def build_policy(
    config: BaseModel, layout: CacheLayout, source: CachePolicy | None = None
) -> CachePolicy:
    """Instantiate the policy a validated cache config selects (``source``: see ``CachePolicy``)."""
    return POLICIES[config.kind].policy(layout, config, source)
