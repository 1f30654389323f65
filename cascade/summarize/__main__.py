"""``python -m cascade.summarize INPUT... --output FILE.jsonl``: summarize long documents, resumably.

Inputs are text files, directories of them, or JSONL files of {"id", "text"}. Each finished document
is one JSON line (id, summary, stats with config_hash) appended to --output; rerunning the command
skips documents done with the same config. Exit code 0: all summarized; 1: some failed (their lines
say why); 2: the job could not run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cascade.errors import entry_point
from cascade.summarize.job import Job
from cascade.summarize.prompts import read_template
from configs import load_config, preset_names


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m cascade.summarize", description=__doc__.split("\n\n")[0])
    parser.add_argument("inputs", nargs="+", type=Path, metavar="INPUT", help="text file, directory or .jsonl")
    parser.add_argument("--output", type=Path, required=True, help="JSONL results, appended to")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--preset", help=f"one of: {', '.join(preset_names())}")
    source.add_argument("--config", type=Path, help="a pipeline config YAML file")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config setting, e.g. long_documents.strategy=map_reduce",
    )
    parser.add_argument("--max-new-tokens", type=int, help="summary length limit (default: the config's)")
    parser.add_argument("--template", type=Path, help="prompt template file with one {document} placeholder")
    parser.add_argument(
        "--batch-size",
        type=positive_int,
        default=1,
        help="documents summarized together (ray: per worker call), their generations decoded as one batch "
        "(default: 1)",
    )
    parser.add_argument("--backend", choices=["local", "ray"], default="local")
    parser.add_argument("--workers", type=positive_int, default=2, help="ray: summarizing workers")
    parser.add_argument("--ray-address", help="ray: an existing cluster (default: start one on this machine)")
    parser.add_argument("--quiet", action="store_true", help="log lines instead of a progress bar")
    args = parser.parse_args(argv)
    return args


def positive_int(text: str) -> int:
    """argparse type for a count of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def lines_in(path: Path) -> int:
    """Finished lines in ``path`` (0 if it cannot be read)."""
    try:
        return path.read_bytes().count(b"\n")
    except OSError:
        return 0


@entry_point
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        settings = {"max_new_tokens": args.max_new_tokens} if args.max_new_tokens is not None else {}
        _, config = load_config(args.preset, args.config, args.set, settings)
        job = Job(tuple(args.inputs), args.output, config, read_template(args.template), args.quiet, args.batch_size)
        if args.backend == "ray":
            from cascade.summarize.distributed import run_ray

            outcome = run_ray(job, args.workers, args.ray_address)
        else:
            from cascade.summarize.local import run_local

            outcome = run_local(job)
    except KeyboardInterrupt:
        print(
            f"\ncascade.summarize: interrupted; {lines_in(args.output)} documents are in {args.output}, "
            "rerun the same command to resume",
            file=sys.stderr,
        )
        return 130
    print(
        f"cascade.summarize: {outcome.summarized} summarized, {outcome.failed} failed, "
        f"{outcome.skipped} already done -> {args.output}",
        file=sys.stderr,
    )
    return 1 if outcome.failed else 0


if __name__ == "__main__":
    sys.exit(main())
