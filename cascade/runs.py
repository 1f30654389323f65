"""Where a measurement script writes: a fresh run directory under
``$CASCADE_HOME/runs/<script>/<UTC time>/`` unless the user names one, never the source tree, with a
``manifest.json`` saying what ran where (command line, commit, versions, machine, start and end)."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import subprocess
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from cascade import atomic
from cascade.home import cascade_home

CHECKOUT = Path(__file__).resolve().parent.parent
"""The directory the package was imported from: a git checkout when run from one."""


def utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def new_run_directory(script: str) -> Path:
    """A directory no earlier run of ``script`` used: ``$CASCADE_HOME/runs/<script>/<UTC time>``."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
    directory = cascade_home() / "runs" / script / stamp
    directory.mkdir(parents=True, exist_ok=False)
    return directory


@dataclass(frozen=True)
class RunFiles:
    """Where one run writes its report and its manifest; ``write`` may be called again as the run
    goes on (a report rewritten after each round keeps what a cut-off run measured)."""

    report: Path
    manifest: Path
    started: str

    def write(self, report: dict, settings: dict) -> None:
        atomic.write_text(self.report, json.dumps(report, indent=2, default=str) + "\n")
        write_manifest(self.manifest, self.started, settings)


def run_files(script: str, out: Path | None, report_name: str) -> RunFiles:
    """A run's files: ``out`` and ``<its stem>.manifest.json`` beside it, or ``report_name`` and
    ``manifest.json`` in a new run directory of ``script``."""
    started = utc_now()
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        return RunFiles(out, out.with_name(f"{out.stem}.manifest.json"), started)
    directory = new_run_directory(script)
    return RunFiles(directory / report_name, directory / "manifest.json", started)


def machine() -> dict:
    """The machine and software a figure was measured with."""
    import transformers

    from cascade import kernels
    from cascade.tuning import machine_tuning

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    features = sorted(kernels.compiled_features()) if kernels.weight_kernel_available() else []
    return {
        "cpu": kernels.cpu_model(),
        "gpu": gpu,
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "cpu_kernels": features,
        "tuning": dataclasses.asdict(machine_tuning()),  # which kernel ran each pass (cascade.tune)
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


def source_state() -> dict:
    """The git commit of the checkout the package runs from and whether it had uncommitted changes
    (both None outside a checkout)."""

    def git(*args: str) -> str | None:
        try:
            result = subprocess.run(["git", "-C", str(CHECKOUT), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return result.stdout.strip() if result.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {"commit": commit, "dirty": None if status is None else bool(status)}


def write_manifest(path: Path, started: str, settings: dict) -> None:
    """The manifest of a run that began at ``started`` and ends now, with the script's ``settings``."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        package = version("cascade")
    except PackageNotFoundError:
        package = None
    manifest = {
        "command": [sys.executable, *sys.argv],
        "package_version": package,
        **source_state(),
        "machine": machine(),
        "settings": settings,
        "started": started,
        "ended": utc_now(),
    }
    atomic.write_text(path, json.dumps(manifest, indent=2, default=str) + "\n")
