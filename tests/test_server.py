"""``python -m cascade.serve`` as clients meet it: the real server on a free port, the official client."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx2 as httpx  # the HTTP client the openai package uses
import openai
import pytest

from cascade import LLM

KEY = "test-key"
PROMPT = "It was the best of times, it was the worst of times, it was the age of"
CHAT = [{"role": "user", "content": "Tell me about the sea."}]
NEW = 16
FIXED = ["stages.0.schedule=fixed", "stages.0.gamma=3"]
"""A fixed gamma: a sampled generation draws the same random numbers in every process (the cost
model's gamma follows measured times, and with it the draws; the output's law stays the target's)."""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(target: Path, draft: Path, port: int, log: Path, *flags: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "cascade.serve", "--preset", "speculative", "--target", str(target), *flags]
    command += ["--draft", str(draft), "--dtype", "float32", "--port", str(port), "--model-name", "tiny"]
    command += [
        "--api-key",
        KEY,
        "--set",
        f"prompt_cache.dir={log.parent / 'prompt-cache'}",
        *[arg for setting in FIXED for arg in ("--set", setting)],
    ]
    process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert process.poll() is None, log.read_text()
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return process
        except httpx.TransportError:
            time.sleep(0.5)
    process.kill()
    raise AssertionError(f"the server did not come up: {log.read_text()}")


def stop(process: subprocess.Popen, how: signal.Signals) -> int:
    process.send_signal(how)
    return process.wait(timeout=60)


@pytest.fixture(scope="module")
def server(tiny_dir, tiny_draft_dir, tmp_path_factory):
    port, log = free_port(), tmp_path_factory.mktemp("server") / "server.log"
    process = start_server(tiny_dir, tiny_draft_dir, port, log)
    yield f"http://127.0.0.1:{port}", log
    stop(process, signal.SIGINT)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def llm(tiny_dir, tiny_draft_dir) -> LLM:
    """The same preset in this process: what the server must answer."""
    fixed = dict(setting.split("=") for setting in FIXED)
    return LLM("speculative", target=tiny_dir, draft=tiny_draft_dir, dtype="float32", reuse_prompts=False, **fixed)


def test_models_and_health(client, server):
    assert [model.id for model in client.models.list().data] == ["tiny"]
    assert httpx.get(f"{server[0]}/health").json() == {"status": "ok"}


def test_completions_streamed_or_not_equal_the_python_api(client, llm):
    expected = llm.generate(PROMPT, max_new_tokens=NEW)
    whole = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=NEW, temperature=0)
    assert whole.choices[0].text == expected.text and whole.choices[0].finish_reason == "length"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(expected.prompt_token_ids), NEW)
    stats = whole.model_extra["cascade"]
    assert stats["preset"] == "speculative" and set(stats["acceptance"]) == {"0:draft/streaming"}
    assert stats["tokens_per_s"] > 0 and stats["tokens_per_verify"] >= 1
    chunks = list(
        client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=NEW, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
    assert text == expected.text and len([c for c in chunks if c.choices and c.choices[0].text]) > 1
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].usage.completion_tokens == NEW


def test_sampling_parameters_and_stop_strings_reach_the_generation(client, llm):
    sampled = dict(temperature=0.8, top_p=0.9, seed=3)
    expected = llm.generate(PROMPT, max_new_tokens=NEW, **sampled)
    reply = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=NEW, **sampled)
    assert reply.choices[0].text == expected.text
    stop = expected.text[len(expected.text) // 2 :][:3]
    stopped = llm.generate(PROMPT, max_new_tokens=NEW, stop=[stop], **sampled)
    reply = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=NEW, stop=[stop], **sampled)
    assert reply.choices[0].text == stopped.text == expected.text[: expected.text.index(stop)]
    assert reply.choices[0].finish_reason == "stop"


def test_chat_streamed_or_not_equals_the_python_api(client, llm):
    expected = llm.chat(CHAT, max_new_tokens=NEW)
    whole = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=NEW)
    assert whole.choices[0].message.content == expected.text and whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens == len(expected.prompt_token_ids)
    chunks = list(client.chat.completions.create(model="tiny", messages=CHAT, max_completion_tokens=NEW, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == "length"


def error_of(response: httpx.Response) -> tuple[int, str]:
    body = response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return response.status_code, body["error"]["message"]


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ("{not json", 400, "the body is not valid JSON"),
        ({"model": "gpt-4", "prompt": "Hi"}, 404, "the model 'gpt-4' does not exist; this server runs 'tiny'"),
        ({"model": "tiny", "prompt": "Hi", "warmth": 1}, 400, "unknown parameter 'warmth'"),
        (
            {"model": "tiny", "prompt": "Hi", "temperature": 3},
            400,
            "temperature: Input should be less than or equal to 2",
        ),
        (
            {"model": "tiny", "prompt": "Hi", "max_tokens": 0},
            400,
            "max_tokens: Input should be greater than or equal to 1",
        ),
        ({"model": "tiny", "prompt": "Hi", "n": 2}, 400, "n=2 is not supported"),
        ({"model": "tiny", "prompt": "Hi", "presence_penalty": 0.5}, 400, "presence_penalty=0.5 is not supported"),
        ({"model": "tiny", "prompt": "  "}, 400, "the prompt is empty"),
        ({"model": "tiny", "prompt": "word " * 600}, 400, "exceeds the context limit of 512 tokens"),
        ({"model": "tiny", "prompt": "Hi", "max_tokens": 1000}, 400, "exceeds the context limit of 512 tokens"),
        ({"model": "tiny", "prompt": [1, 49152]}, 400, "token ids must be whole numbers from 0 to 49151"),
        ({"model": "tiny", "prompt": ["a", "b"], "stream": True}, 400, "give one prompt per streamed request"),
    ],
)
def test_bad_requests_get_an_openai_error_and_the_server_keeps_serving(server, client, body, status, message):
    content = body if isinstance(body, str) else json.dumps(body)
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    response = httpx.post(f"{server[0]}/v1/completions", content=content, headers=headers, timeout=60)
    got_status, got_message = error_of(response)
    assert got_status == status and message in got_message, got_message
    assert client.completions.create(model="tiny", prompt="Hi", max_tokens=2).choices[0].finish_reason == "length"


def test_bad_chats_and_unknown_routes(server):
    headers = {"Authorization": f"Bearer {KEY}"}
    bad_role = {"model": "tiny", "messages": [{"role": "robot", "content": "Hi"}]}
    status, message = error_of(httpx.post(f"{server[0]}/v1/chat/completions", json=bad_role, headers=headers))
    assert status == 400 and "messages.0.role" in message
    status, message = error_of(
        httpx.post(f"{server[0]}/v1/chat/completions", json={"model": "tiny", "messages": []}, headers=headers)
    )
    assert status == 400 and "messages" in message
    assert error_of(httpx.get(f"{server[0]}/v1/engines", headers=headers))[0] == 404


def test_a_missing_or_wrong_key_gets_401(server):
    wrong = openai.OpenAI(base_url=f"{server[0]}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model="tiny", prompt="Hi", max_tokens=2)
    status, message = error_of(httpx.get(f"{server[0]}/v1/models"))
    assert status == 401 and "send 'Authorization: Bearer <key>'" in message


def test_a_client_leaving_mid_stream_frees_the_queue(server, client, llm):
    headers = {"Authorization": f"Bearer {KEY}"}
    long = {"model": "tiny", "prompt": PROMPT, "max_tokens": 440, "stream": True}
    with httpx.stream("POST", f"{server[0]}/v1/completions", json=long, headers=headers, timeout=60) as response:
        first = next(response.iter_lines())
        assert first.startswith("data: {")
    reply = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=NEW, temperature=0)
    assert reply.choices[0].text == llm.generate(PROMPT, max_new_tokens=NEW).text
    stopped = re.findall(r"a generation stopped after (\d+) tokens \(its client went away\)", server[1].read_text())
    assert len(stopped) == 1 and int(stopped[0]) < 440, server[1].read_text()


def test_eight_concurrent_clients_all_get_their_own_answers(client, llm):
    prompts = [f"{PROMPT} number {index}" for index in range(8)]
    expected = [completion.text for completion in llm.generate(prompts, max_new_tokens=8)]

    def ask(prompt: str) -> str:
        return client.completions.create(model="tiny", prompt=prompt, max_tokens=8).choices[0].text

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(ask, prompts)) == expected


def test_a_batching_server_decodes_concurrent_clients_together_each_with_its_own_answer(
    tiny_dir, tiny_draft_dir, tmp_path, llm
):
    """``--batch-size 3``: requests that arrive while others run join their batch; one that leaves
    mid-stream leaves it, and the others and later ones still get what the Python API gives."""
    port, log = free_port(), tmp_path / "server.log"
    process = start_server(tiny_dir, tiny_draft_dir, port, log, "--batch-size", "3")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=120)
    prompts = [f"{PROMPT} number {index}" for index in range(5)]
    expected = [completion.text for completion in llm.generate(prompts, max_new_tokens=8)]
    headers = {"Authorization": f"Bearer {KEY}"}
    long = {"model": "tiny", "prompt": PROMPT, "max_tokens": 440, "stream": True}

    def ask(prompt: str) -> str:
        return client.completions.create(model="tiny", prompt=prompt, max_tokens=8).choices[0].text

    try:
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=long, headers=headers) as response:
            assert next(response.iter_lines()).startswith("data: {")
            with ThreadPoolExecutor(len(prompts)) as pool:
                assert list(pool.map(ask, prompts)) == expected  # beside the long stream
        assert ask(prompts[0]) == expected[0]  # after the long stream's client left
        stopped = re.findall(r"a generation stopped after (\d+) tokens \(its client went away\)", log.read_text())
        assert len(stopped) == 1 and int(stopped[0]) < 440, log.read_text()
    finally:
        stop(process, signal.SIGTERM)


@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_shuts_the_server_down_cleanly_even_mid_generation(tiny_dir, tiny_draft_dir, tmp_path, how):
    port, log = free_port(), tmp_path / "server.log"
    process = start_server(tiny_dir, tiny_draft_dir, port, log)
    headers = {"Authorization": f"Bearer {KEY}"}
    long = {"model": "tiny", "prompt": PROMPT, "max_tokens": 440, "stream": True}
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=long, headers=headers) as response:
        next(response.iter_lines())
        status = stop(process, how)
    output = log.read_text()
    assert status in (0, 130, -how), output  # uvicorn re-raises the signal after shutting down
    assert "Traceback" not in output and "Finished server process" in output, output
