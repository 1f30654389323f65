"""Installed models: listing them and resolving a role's default (provisioning it on first use)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from cascade.home import models_dir
from cascade.models.catalog import DEFAULTS, Role
from cascade.models.provision import MANIFEST, fetch, installed_path


def installed_models() -> list[dict]:
    """One record per finished install: name, path, role, parameters, context_length, ..."""
    records = []
    for manifest in sorted(models_dir().glob(f"*/{MANIFEST}")):
        record = json.loads(manifest.read_text())
        records.append({"name": record["name"], "path": str(manifest.parent), **record})
    return records


def default_model(role: Role, log: Callable[[str], None]) -> Path:
    """Path of the default model for ``role``, fetched now if this is its first use."""
    entry = DEFAULTS[role]
    if (path := installed_path(entry)) is not None:
        return path
    log(f"cascade: the default {role} {entry.name} is not provisioned yet; fetching it (first use)")
    return fetch(entry, log=log)
