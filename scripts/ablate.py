"""Cache-policy and setting ablations: a YAML grid of runs, one CSV row each, a JSON summary, plots.

A sweep writes to a new run directory under ``$CASCADE_HOME/runs/ablate/`` (or ``--out DIR``) with a
manifest (command, commit, machine); ``--resume DIR`` continues a killed sweep in DIR, skipping the
runs its CSV already holds (the CSV is the state). Each run loads its config, warms up with a 2-token generation on
its own prompt (a shorter one could fall within a sparse stage's budget), and reports the median
decode speed of ``--repeats`` generations; speed-ups are over the autoregressive run of
the same document, context, temperature and length, which the grid adds by itself.

    python scripts/ablate.py [--grid scripts/grids/triforce.yaml | --quick] [--out DIR | --resume DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tqdm import tqdm

from cascade.ablation.grid import expand, load_grid
from cascade.ablation.measure import measure
from cascade.ablation.plots import plot_sweep, sweep_summary
from cascade.ablation.store import RunTable
from cascade.checkpoint import checkpoint_option
from cascade.errors import CascadeError, entry_point
from cascade.home import prompt_cache_dir, prompt_cache_option
from cascade.models import default_model
from cascade.runs import RunFiles, run_files

GRIDS = Path(__file__).parent / "grids"


@entry_point
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--grid", type=Path, default=GRIDS / "triforce.yaml")
    parser.add_argument("--quick", action="store_true", help=f"the small grid {GRIDS / 'quick.yaml'} (minutes)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--out",
        type=Path,
        metavar="DIR",
        help="a new folder for runs.csv, summary.json, the PNGs "
        "and the manifest (default: a new run directory under $CASCADE_HOME/runs/ablate/)",
    )
    where.add_argument("--resume", type=Path, metavar="DIR", help="continue the sweep an earlier run wrote to DIR")
    parser.add_argument("--repeats", type=int, default=1, help="measured generations per run (median)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--target", type=checkpoint_option, help="name or directory (default: the provisioned SmolLM2)")
    parser.add_argument(
        "--prompt-cache",
        type=prompt_cache_option,
        default=str(prompt_cache_dir()),
        help="where prefilled prompts are stored and reused (default: %(default)s); 'none'",
    )
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1 (measured generations per run); got {args.repeats}")
    grid_path = GRIDS / "quick.yaml" if args.quick else args.grid
    grid = load_grid(grid_path)
    target = args.target or default_model("target")
    sweep(grid, grid_path, target, sweep_files(args), args)
    return 0


def sweep_files(args: argparse.Namespace) -> RunFiles:
    """The sweep's summary and manifest: in ``--resume``'s folder, which must hold a sweep; in
    ``--out``'s, which must not; or in a new run directory."""
    if args.resume and not (args.resume / "runs.csv").is_file():
        raise CascadeError(f"{args.resume} holds no runs.csv to resume; give the folder of an earlier sweep")
    if args.out and (args.out / "runs.csv").exists():
        raise CascadeError(
            f"{args.out} already holds a sweep; continue it with --resume {args.out}, or give another --out"
        )
    folder = args.resume or args.out
    return run_files("ablate", folder / "summary.json" if folder else None, "summary.json")


def sweep(grid, grid_path: Path, target: Path, files: RunFiles, args: argparse.Namespace) -> None:
    out = files.report.parent
    table = RunTable(out / "runs.csv")
    done = table.rows()
    runs = expand(grid)
    todo = [run for run in runs if run.id not in done]
    print(f"{len(runs)} runs in {grid_path.name}: {len(runs) - len(todo)} done, {len(todo)} to go", file=sys.stderr)
    with tqdm(todo, desc="ablation", unit="run", file=sys.stderr) as bar:
        for run in bar:
            bar.set_postfix_str(" ".join(f"{k}={v}" for k, v in run.settings if k not in ("document",)))
            table.append(measure(run, target, args.dtype, args.repeats, args.prompt_cache))
    rows = table.rows()
    plots = [plot_sweep(name, grid, spec, rows, out) for name, spec in grid.sweeps.items()]
    summary = {
        "grid": str(grid_path),
        "dtype": args.dtype,
        "repeats": args.repeats,
        "sweeps": {name: sweep_summary(grid, spec, rows) for name, spec in grid.sweeps.items()},
        "plots": [str(path) for path in plots if path is not None],
    }
    files.write(summary, vars(args) | {"grid": grid_path, "target": target})
    print(
        f"wrote {out / 'runs.csv'}, {files.report} and {len(summary['plots'])} plots (manifest: {files.manifest})",
        file=sys.stderr,
    )


if __name__ == "__main__":
    sys.exit(main())
