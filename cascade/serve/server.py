"""Running the app under uvicorn, with a shutdown that stops the running generation."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import uvicorn

from cascade.llm import LLM
from cascade.serve.app import create_app


class GracefulServer(uvicorn.Server):
    """At SIGINT or SIGTERM, also stops the running generation after its current round, so that
    shutting down waits for no decoding. (uvicorn re-raises the signal once it has shut down:
    SIGINT ends the process with status 130, SIGTERM as the signal's default does.)"""

    def __init__(self, config: uvicorn.Config, cancel_generations: Callable[[], None]) -> None:
        super().__init__(config)
        self.cancel_generations = cancel_generations

    def handle_exit(self, sig, frame) -> None:
        self.cancel_generations()
        super().handle_exit(sig, frame)


def serve(llm: LLM, args: argparse.Namespace, model_name: str) -> None:
    app = create_app(llm, model_name, args.api_key, args.batch_size)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning" if args.quiet else "info")
    GracefulServer(config, app.state.server.cancel_all).run()
