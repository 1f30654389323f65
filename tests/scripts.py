"""Running the project's scripts from tests: a failure shows the script's own error output."""

from __future__ import annotations

import subprocess
from pathlib import Path

from cascade.home import cascade_home


def run_script(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    """Run ``command`` (capturing its output as text) and fail with the end of its stderr unless it
    exits 0."""
    result = subprocess.run(command, capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, f"{command[1]} exited {result.returncode}:\n{result.stderr[-4000:]}"
    return result


def linked_home(directory: Path, shared: tuple[str, ...] = ("models", "data", "build")) -> Path:
    """A fresh ``$CASCADE_HOME`` at ``directory`` that reads this machine's provisioned models, documents
    and built kernels (``shared``: links to the current home's), so a script's runs land in
    ``directory/runs`` and its processes do not build the kernels again."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in shared:
        (cascade_home() / name).mkdir(parents=True, exist_ok=True)
        (directory / name).symlink_to(cascade_home() / name, target_is_directory=True)
    return directory
