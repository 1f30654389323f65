"""An OpenAI-compatible HTTP API over one ``cascade.LLM``: requests run one at a time, in arrival order."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from cascade.completion import Completion
from cascade.errors import CascadeError
from cascade.llm import LLM, is_prompt_list
from cascade.llm import Request as Generation
from cascade.serve.protocol import ChatRequest, CompletionRequest, GenerationParameters

logger = logging.getLogger(__name__)


class ApiError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.code = status, kind, code


def error_body(message: str, kind: str, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error_body(str(error), error.kind, error.code), status_code=error.status)


def describe_validation(error: RequestValidationError) -> str:
    """One clause per problem, naming the parameter."""
    problems = []
    for problem in error.errors():
        where = ".".join(str(part) for part in problem["loc"] if part != "body")
        if problem["type"] == "extra_forbidden":
            problems.append(f"unknown parameter {where!r}")
        elif problem["type"] == "json_invalid":
            problems.append(f"the body is not valid JSON ({problem.get('ctx', {}).get('error', problem['msg'])})")
        else:
            problems.append(f"{where or 'body'}: {problem['msg']}")
    return "; ".join(problems)


class Server:
    """What the routes share: the LLM, the workers that run it, the running generations."""

    def __init__(self, llm: LLM, model_name: str, api_key: str | None, batch_size: int = 1) -> None:
        self.llm = llm
        self.model_name = model_name
        self.api_key = api_key
        self.created = int(time.time())
        self.worker = ThreadPoolExecutor(max_workers=batch_size, thread_name_prefix="cascade-generation")
        """``batch_size`` generations at a time, which decode as one batch (``LLM.join_concurrent``);
        its queue is first in, first out."""
        llm.join_concurrent(batch_size)
        self.running: set[threading.Event] = set()
        """The cancel events of queued and running generations (set at shutdown)."""

    def check_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), self.api_key.encode()):
            raise ApiError(
                401, "invalid or missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key"
            )

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise ApiError(
                404, f"the model {model!r} does not exist; this server runs {self.model_name!r}", code="model_not_found"
            )

    def prepare(self, prompt_ids: list[int], body: GenerationParameters, max_tokens: int | None) -> Generation:
        """A generation of ``body``'s parameters; without ``max_tokens``, the config's, or as many as fit."""
        if max_tokens is None:
            room = self.llm.runtime.context_limit() - len(prompt_ids)
            max_tokens = max(1, min(self.llm.config.max_new_tokens, room))
        params = dict(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, seed=body.seed)
        return self.llm.prepare(prompt_ids, max_new_tokens=max_tokens, stop=body.stop, **params)

    async def run(self, generation: Generation, on_text: Callable[[str], None] | None = None) -> Completion:
        """Queue ``generation`` behind the others; cancelled if the caller is (a client went away)."""
        cancelled = threading.Event()
        self.running.add(cancelled)
        job = self.worker.submit(self.llm.run, generation, on_text, cancelled)
        job.add_done_callback(log_cancellation)
        try:
            return await asyncio.wrap_future(job)
        finally:
            cancelled.set()
            self.running.discard(cancelled)

    def cancel_all(self) -> None:
        for cancelled in list(self.running):
            cancelled.set()

    def stats(self, completion: Completion) -> dict[str, Any]:
        """The ``cascade`` field of a response: the generation's speed and acceptance per stage."""
        stats = completion.stats
        keys = ("tokens_per_s", "prefill_s", "decode_s", "prefill_loaded", "tokens_per_verify", "predicted_speedup")
        return {"preset": self.llm.name, **{key: stats[key] for key in keys}} | {
            "acceptance": {stage["name"]: stage["acceptance_rate"] for stage in stats["stages"][:-1]},
            "proposed": {stage["name"]: stage["proposed"] for stage in stats["stages"][:-1]},
            "stop_reason": stats["stop_reason"],
        }


def log_cancellation(job: Future) -> None:
    if job.cancelled():
        logger.info("a request was dropped before it ran (its client went away)")
    elif job.exception() is None and (completion := job.result()).finish_reason == "cancelled":
        logger.info(f"a generation stopped after {len(completion.token_ids)} tokens (its client went away)")


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def sse(data: dict[str, Any] | str) -> str:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def create_app(llm: LLM, model_name: str, api_key: str | None = None, batch_size: int = 1) -> FastAPI:
    server = Server(llm, model_name, api_key, batch_size)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        server.cancel_all()
        server.worker.shutdown(wait=True, cancel_futures=True)

    app = FastAPI(title="cascade", lifespan=lifespan)
    app.state.server = server
    authorized = [Depends(server.check_key)]

    @app.exception_handler(ApiError)
    async def api_error(_: Request, error: ApiError) -> JSONResponse:
        return error_response(error)

    @app.exception_handler(CascadeError)
    async def bad_request(_: Request, error: CascadeError) -> JSONResponse:
        return error_response(ApiError(400, str(error)))

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, error: RequestValidationError) -> JSONResponse:
        return error_response(ApiError(400, describe_validation(error)))

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, error: HTTPException) -> JSONResponse:
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return error_response(ApiError(error.status_code, str(error.detail), kind))

    @app.exception_handler(Exception)
    async def internal(_: Request, error: Exception) -> JSONResponse:
        return error_response(ApiError(500, f"{type(error).__name__}: {error}", "server_error"))

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models", dependencies=authorized)
    async def models() -> dict[str, Any]:
        model = {"id": server.model_name, "object": "model", "created": server.created, "owned_by": "cascade"}
        return {"object": "list", "data": [model]}

    @app.post("/v1/completions", dependencies=authorized)
    async def completions(body: CompletionRequest):
        server.check_model(body.model)
        prompts = body.prompt if is_prompt_list(body.prompt) else [body.prompt]
        generations = [server.prepare(server.llm.encode(prompt), body, body.max_tokens) for prompt in prompts]
        reply = Reply(server, "cmpl", "text_completion", chat=False)
        if body.stream:
            if len(generations) > 1:
                raise ApiError(400, "stream: give one prompt per streamed request")
            return reply.stream(generations[0], body)
        return reply.whole([await server.run(generation) for generation in generations])

    @app.post("/v1/chat/completions", dependencies=authorized)
    async def chat_completions(body: ChatRequest):
        server.check_model(body.model)
        prompt_ids = server.llm.encode_chat([message.as_template_message() for message in body.messages])
        generation = server.prepare(prompt_ids, body, body.new_tokens)
        reply = Reply(server, "chatcmpl", "chat.completion", chat=True)
        if body.stream:
            return reply.stream(generation, body)
        return reply.whole([await server.run(generation)])

    return app


class Reply:
    """One response's shape: a completion's or a chat's, whole or as server-sent events."""

    def __init__(self, server: Server, prefix: str, kind: str, chat: bool) -> None:
        self.server, self.kind, self.chat = server, kind, chat
        self.id, self.created = f"{prefix}-{uuid.uuid4().hex}", int(time.time())

    def envelope(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.server.model_name}

    def choice(self, index: int, text: str | None, finish_reason: str | None, delta: bool = False) -> dict[str, Any]:
        if not self.chat:
            return {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        content = {} if text is None else {"content": text}
        key = "delta" if delta else "message"
        message = content if delta else {"role": "assistant", "content": text or "", "refusal": None}
        return {"index": index, key: message, "logprobs": None, "finish_reason": finish_reason}

    def whole(self, completions: list[Completion]) -> dict[str, Any]:
        choices = [self.choice(i, c.text, c.finish_reason) for i, c in enumerate(completions)]
        prompt_tokens = sum(len(c.prompt_token_ids) for c in completions)
        return self.envelope(self.kind) | {
            "choices": choices,
            "usage": usage(prompt_tokens, sum(len(c.token_ids) for c in completions)),
            "cascade": [self.server.stats(c) for c in completions]
            if len(completions) > 1
            else self.server.stats(completions[0]),
        }

    def stream(self, generation: Generation, body: GenerationParameters) -> StreamingResponse:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(self.events(generation, kind, include_usage), media_type="text/event-stream")

    async def events(self, generation: Generation, kind: str, include_usage: bool) -> AsyncIterator[str]:
        """The deltas as they are accepted, then the finish reason and stats, then ``[DONE]``."""
        loop, deltas = asyncio.get_running_loop(), asyncio.Queue()
        chunk = lambda choice: self.envelope(kind) | {"choices": [choice]}  # noqa: E731
        running = asyncio.ensure_future(
            self.server.run(generation, lambda t: loop.call_soon_threadsafe(deltas.put_nowait, t))
        )
        running.add_done_callback(lambda _: deltas.put_nowait(None))
        try:
            if self.chat:
                yield sse(
                    chunk(
                        {
                            "index": 0,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    )
                )
            while (delta := await deltas.get()) is not None:
                yield sse(chunk(self.choice(0, delta, None, delta=True)))
            try:
                completion = running.result()
            except CascadeError as error:
                yield sse(error_body(str(error), "invalid_request_error"))
                return
            last = chunk(self.choice(0, None, completion.finish_reason, delta=True))
            yield sse(last | {"cascade": self.server.stats(completion)})
            if include_usage:
                tokens = usage(len(completion.prompt_token_ids), len(completion.token_ids))
                yield sse(self.envelope(kind) | {"choices": [], "usage": tokens})
            yield sse("[DONE]")
        finally:
            running.cancel()
