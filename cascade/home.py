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


def peers_dir() -> Path:
    """Where the benchmarks' peers live: llama.cpp's build and the GGUF files it runs."""
    return cascade_home() / "peers"


def prompt_cache_dir() -> Path:
    """Where ``cascade.LLM``, the server and the measurement scripts store prefilled prompts by
    default (see ``prompt_cache`` in the config)."""
    return cascade_home() / "prompt-cache"


def pass_costs_dir() -> Path:
    """Where the entry points keep pass costs for later processes by default (``pass_costs_dir`` in
    the config): ``$CASCADE_PASS_COSTS``, else ``$CASCADE_HOME/pass-costs``."""
    return Path(os.environ.get("CASCADE_PASS_COSTS", cascade_home() / "pass-costs")).expanduser()


def prompt_cache_option(value: str) -> str | None:
    """The scripts' ``--prompt-cache``: a directory (the ``prompt_cache.dir`` setting), or 'none'."""
    return None if value == "none" else str(Path(value).expanduser())
