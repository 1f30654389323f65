"""Model provisioning: ``python -m cascade.models fetch`` and ``python -m cascade.models list``."""

from cascade.models.catalog import CATALOG, DEFAULTS, CatalogEntry
from cascade.models.installed import checkpoint_path, default_model, installed_models
from cascade.models.provision import fetch, installed_path

__all__ = [
    "CATALOG",
    "DEFAULTS",
    "CatalogEntry",
    "checkpoint_path",
    "default_model",
    "fetch",
    "installed_models",
    "installed_path",
]
