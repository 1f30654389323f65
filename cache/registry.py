"""Maps a config ``kind`` to its policy class and pydantic config class."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, get_args, get_origin

from pydantic import BaseModel

from cache.base import CacheLayout, CachePolicy
from cache.config import CachePolicyConfig


@dataclass(frozen=True)
class PolicyEntry:
    kind: str
    policy: type[CachePolicy]
    config: type[CachePolicyConfig]


POLICIES: dict[str, PolicyEntry] = {}

PolicyT = TypeVar("PolicyT", bound=type[CachePolicy])


def register_policy(config: type[CachePolicyConfig]) -> Callable[[PolicyT], PolicyT]:
    """Class decorator: ``@register_policy(MyConfig)`` registers under ``MyConfig``'s ``kind``."""
    kind = config.model_fields["kind"].default

    def decorate(policy: PolicyT) -> PolicyT:
        if kind in POLICIES:
            raise ValueError(f"cache policy kind {kind!r} registered twice")
        POLICIES[kind] = PolicyEntry(kind, policy, config)
        return policy

    return decorate


def build_policy(config: CachePolicyConfig, layout: CacheLayout, source: CachePolicy | None = None) -> CachePolicy:
    """Instantiate the policy a validated cache config selects (``source``: see ``CachePolicy``)."""
    return POLICIES[config.kind].policy(layout, config, source)


def describe_policies() -> str:
    """Every registered kind with its summary and its fields' types, defaults and docs."""
    lines = []
    for kind, entry in sorted(POLICIES.items()):
        lines.append(f"{kind}: {(entry.config.__doc__ or '').strip()}")
        for name, field in entry.config.model_fields.items():
            if name == "kind":
                continue
            kind_text = type_text(field.annotation)
            description = " ".join((field.description or "").split())  # a docstring's lines, as one
            lines.append(f"    {name}: {kind_text} = {field.default!r}  {description}".rstrip())
    return "\n".join(lines)


def type_text(annotation: Any) -> str:
    """``int``, ``'never' | {every: int}``: a field's type as a user writes it in YAML."""
    if get_origin(annotation) is Literal:
        return " | ".join(repr(arg) for arg in get_args(annotation))
    if get_args(annotation):
        return " | ".join(type_text(arg) for arg in get_args(annotation))
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        fields = ", ".join(f"{n}: {type_text(f.annotation)}" for n, f in annotation.model_fields.items())
        return "{" + fields + "}"
    return getattr(annotation, "__name__", str(annotation))
