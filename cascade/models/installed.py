"""Installed models: listing them and resolving a role's default (provisioning it on first use)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from cascade.errors import CascadeError
from cascade.home import models_dir
from cascade.models.catalog import DEFAULTS, Role
from cascade.models.provision import MANIFEST, fetch, installed_path

LISTED_KEYS = ("name", "role", "parameters", "context_length")
"""What every manifest holds and ``python -m cascade.models list`` shows."""


def installed_models() -> list[dict]:
    """One record per finished install: name, path, role, parameters, context_length, ..."""
    records = []
    for manifest in sorted(models_dir().glob(f"*/{MANIFEST}")):
        record = read_manifest(manifest)
        records.append({"name": record["name"], "path": str(manifest.parent), **record})
    return records


def read_manifest(manifest: Path) -> dict:
    """An install's manifest; a CascadeError naming it, and how to reinstall, if it is unreadable."""
    try:
        record = json.loads(manifest.read_text())
    except OSError as exc:
        raise CascadeError(unreadable_manifest(manifest, exc.strerror)) from None
    except ValueError as exc:
        raise CascadeError(unreadable_manifest(manifest, f"not JSON: {exc}")) from None
    if not isinstance(record, dict):
        raise CascadeError(unreadable_manifest(manifest, "not a JSON object"))
    if missing := [key for key in LISTED_KEYS if key not in record]:
        raise CascadeError(unreadable_manifest(manifest, f"it lacks {', '.join(missing)}"))
    return record


def unreadable_manifest(manifest: Path, why: str) -> str:
    return (f"the model manifest {manifest} is unreadable ({why}); delete {manifest.parent} and fetch it again "
            f"with `python -m cascade.models fetch {manifest.parent.name}`")


def default_model(role: Role, log: Callable[[str], None]) -> Path:
    """Path of the default model for ``role``, fetched now if this is its first use."""
    entry = DEFAULTS[role]
    if (path := installed_path(entry)) is not None:
        return path
    log(f"cascade: the default {role} {entry.name} is not provisioned yet; fetching it (first use)")
    return fetch(entry, log=log)
