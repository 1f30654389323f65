"""Where cascade keeps provisioned models and data: ``$CASCADE_HOME`` (default ~/.cache/cascade)."""

from __future__ import annotations

import os
from pathlib import Path


def cascade_home() -> Path:
    return Path(os.environ.get("CASCADE_HOME", Path.home() / ".cache" / "cascade")).expanduser()


def models_dir() -> Path:
    return cascade_home() / "models"


def downloads_dir() -> Path:
    return cascade_home() / "downloads"
