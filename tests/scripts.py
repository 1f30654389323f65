"""Running the project's scripts from tests: a failure shows the script's own error output."""

from __future__ import annotations

import subprocess


def run_script(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    """Run ``command`` (capturing its output as text) and fail with the end of its stderr unless it
    exits 0."""
    result = subprocess.run(command, capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, f"{command[1]} exited {result.returncode}:\n{result.stderr[-4000:]}"
    return result
