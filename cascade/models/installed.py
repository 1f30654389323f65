"""Installed models: listing them, resolving a role's default (provisioning it on first use), and
turning a catalog name or a directory into a checkpoint path."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from cascade.errors import CascadeError
from cascade.home import models_dir
from cascade.models.catalog import CATALOG, DEFAULTS, FAMILIES, CatalogEntry, Role
from cascade.models.provision import MANIFEST, fetch, installed_path

logger = logging.getLogger(__name__)

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
    return (
        f"the model manifest {manifest} is unreadable ({why}); delete {manifest.parent} and fetch it again "
        f"with `python -m cascade.models fetch {manifest.parent.name}`"
    )


def default_model(role: Role, *, target: Path | None = None) -> Path:
    """Path of the default model for ``role``, fetched now if this is its first use: for a draft
    proposing to ``target``, the draft of the target's catalog family if it has one (the Qwen2.5-Coder
    1.5B gets the 0.5B), else the default draft."""
    entry = family_draft(target) if role == "draft" and target is not None else None
    entry = entry or DEFAULTS[role]
    if (path := installed_path(entry)) is not None:
        return path
    logger.warning(f"cascade: the default {role} {entry.name} is not provisioned yet; fetching it (first use)")
    return fetch(entry)


def family_draft(target: Path) -> CatalogEntry | None:
    """The draft of the catalog family whose target is installed at ``target``, if any."""
    for members in FAMILIES.values():
        drafts = [entry for entry in members if entry.role == "draft"]
        if drafts and any(entry.role == "target" and installed_path(entry) == target for entry in members):
            return drafts[0]
    return None


def checkpoint_path(value: str) -> Path:
    """The checkpoint a ``--target`` / ``--draft`` value or ``target.path`` setting names: a catalog
    model's install (a provisioned one; catalog names come first), else a directory. A bare name
    that is neither is an error that lists the catalog; a directory's problems are ``read_config``'s."""
    if value in CATALOG:
        if (path := installed_path(CATALOG[value])) is None:
            raise CascadeError(
                f"the model {value} is not provisioned yet; fetch it with `python -m cascade.models fetch {value}`"
            )
        return path
    path = Path(value).expanduser()
    if not path.exists() and Path(value).name == value and not value.startswith("."):
        raise CascadeError(
            f"{value!r} is neither a model directory nor a model of the catalog ({', '.join(sorted(CATALOG))})"
        )
    return path
