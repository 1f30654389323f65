"""Every module of the project imports on its own: no import cycle between modules or packages.

A cycle shows only when a module is the first of the cycle to be imported (Python then hands the
other module a partly initialised one), so each module is imported in a fresh interpreter with none
of the project loaded. One interpreter serves all of them: it drops the project's modules from
``sys.modules`` before each import (torch and the other dependencies stay loaded, which keeps this
to seconds, and none of them imports the project).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("cascade", "cache", "configs")

IMPORT_EACH = """
import importlib, sys, traceback
failures = []
for name in sys.argv[1:]:
    for loaded in [m for m in sys.modules if m.split(".")[0] in {packages!r}]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except Exception:
        failures.append(name + ":\\n" + traceback.format_exc(limit=-3))
print("\\n".join(failures))
sys.exit(1 if failures else 0)
"""


def project_modules() -> list[str]:
    """Dotted names of every module of the project's packages (``__main__`` modules excluded: they run)."""
    names = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__main__":
                continue
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def test_the_package_list_finds_the_modules():
    modules = project_modules()
    assert {"cascade", "cascade.stage", "cache.retrieval", "configs.schema"} <= set(modules)
    assert not any(name.endswith("__main__") for name in modules)


def test_every_module_imports_alone():
    modules = project_modules()
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_EACH.format(packages=set(PACKAGES)), *modules],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, f"modules that fail to import alone:\n{result.stdout}{result.stderr[-2000:]}"
