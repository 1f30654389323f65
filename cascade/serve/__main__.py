"""``python -m cascade.serve``: serve a preset over an OpenAI-compatible HTTP API.

``POST /v1/completions`` and ``POST /v1/chat/completions`` (with ``stream: true`` as server-sent
events), ``GET /v1/models`` and ``GET /health``. Requests run in arrival order, one at a time or, with
``--batch-size N``, up to N at once as one batch that each new request joins."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from cascade.errors import CascadeError, entry_point
from cascade.generate import FLAG_SETTINGS
from cascade.llm import LLM, with_kept_pass_costs, with_prompt_cache
from cascade.logs import show_logs
from configs import load_config, preset_names

logger = logging.getLogger("cascade.serve")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m cascade.serve", description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--preset", help=f"one of: {', '.join(preset_names())}")
    source.add_argument("--config", type=Path, help="a pipeline config YAML file")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config setting")
    parser.add_argument("--target", help="a catalog model name or a checkpoint directory")
    parser.add_argument("--draft", help="a catalog model name or a checkpoint directory")
    parser.add_argument("--dtype", choices=["auto", "bfloat16", "float32"])
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("CASCADE_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1 (default: $CASCADE_API_KEY; none: open)",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=1,
        help="requests decoded together at most: a request that arrives while others run joins their batch "
        "(default 1: one at a time)",
    )
    parser.add_argument("--model-name", help="the model id clients send (default: the target's directory name)")
    parser.add_argument(
        "--no-prompt-cache",
        action="store_true",
        help="prefill every prompt whole (default: reuse stored prefixes from prompt_cache.dir, or "
        "$CASCADE_HOME/prompt-cache)",
    )
    parser.add_argument("--quiet", action="store_true", help="log warnings and errors only")
    return parser.parse_args(argv)


@entry_point
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    show_logs(quiet=args.quiet)
    flags = {key: getattr(args, flag) for flag, key in FLAG_SETTINGS.items() if getattr(args, flag, None) is not None}
    preset, config = load_config(args.preset, args.config, args.set, flags)
    if not 0 < args.port < 65536:
        raise CascadeError(f"--port must be from 1 to 65535; got {args.port}")
    if args.batch_size < 1:
        raise CascadeError(f"--batch-size must be at least 1; got {args.batch_size}")
    try:
        from cascade.serve.server import serve
    except ModuleNotFoundError as missing:
        raise CascadeError(
            f"the server needs FastAPI and uvicorn ({missing.name} is not installed): pip install 'cascade[serve]'"
        ) from None
    config = with_kept_pass_costs(config)
    llm = LLM.from_config(config if args.no_prompt_cache else with_prompt_cache(config), preset)
    model_name = args.model_name or Path(llm.runtime.target.path).name
    logger.info(f"serving {model_name} with the {preset} preset on http://{args.host}:{args.port}/v1")
    serve(llm, args, model_name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
