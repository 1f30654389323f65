"""``cascade.LLM``: generate, stream, chat and stop strings give the target's own tokens and text."""

from __future__ import annotations

import threading
import time

import pytest

from cascade import LLM
from cascade.llm import FifoLock

PROMPT = "The quick brown fox jumps over the lazy dog. It was a bright cold day in April, and"
NEW = 24
FIXED = {"stages.0.schedule": "fixed", "stages.0.gamma": 3}
"""A fixed gamma: sampled generations draw the same random numbers whatever the passes' times (the
cost model's gamma follows them, and with it the draws; the output's law is the target's either way)."""


@pytest.fixture(scope="module")
def llm(tiny_dir, tiny_draft_dir, tmp_path_factory) -> LLM:
    """A draft that rarely agrees with the target: speculation's rejections are exercised. Its
    prompts are stored and reused, as by default (in a directory of its own)."""
    store = tmp_path_factory.mktemp("prompt-cache")
    return LLM(
        "speculative", target=tiny_dir, draft=tiny_draft_dir, dtype="float32", prompt_cache__dir=str(store), **FIXED
    )


@pytest.fixture(scope="module")
def reference(tiny_dir):
    """The target decoding alone."""
    return LLM("autoregressive", target=tiny_dir, dtype="float32", reuse_prompts=False).generate(
        PROMPT, max_new_tokens=NEW
    )


def test_greedy_output_is_the_targets_and_text_is_its_decoding(llm, reference):
    completion = llm.generate(PROMPT, max_new_tokens=NEW)
    assert completion.token_ids == reference.token_ids and len(completion.token_ids) == NEW
    assert completion.text == llm.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
    assert completion.finish_reason == "length" and completion.stats["new_tokens"] == NEW
    assert completion.prompt_token_ids == llm.tokenizer.encode(PROMPT)
    again = llm.generate(completion.prompt_token_ids, max_new_tokens=NEW)
    assert again.token_ids == reference.token_ids and again.stats["prefill_loaded"]  # from the prompt cache


def test_a_list_of_prompts_gives_a_list_of_completions(llm, reference):
    other = "Call me Ishmael. Some years ago, never mind how long"
    both = llm.generate([PROMPT, other], max_new_tokens=NEW)
    assert [c.token_ids for c in both] == [reference.token_ids, llm.generate(other, max_new_tokens=NEW).token_ids]


def test_stream_deltas_add_up_to_the_completion(llm, reference):
    stream = llm.stream(PROMPT, max_new_tokens=NEW)
    deltas = list(stream)
    assert len(deltas) > 1 and all(deltas)
    assert "".join(deltas) == reference.text == stream.completion.text
    assert stream.completion.token_ids == reference.token_ids


def stop_string_of(text: str) -> str:
    """Three characters from the middle of ``text``: a stop string it completes partway through."""
    middle = len(text) // 2
    return text[middle : middle + 3]


def test_a_stop_string_ends_the_generation_and_the_text_before_it(llm, reference):
    stop = stop_string_of(reference.text)
    expected = reference.text[: reference.text.index(stop)]
    completion = llm.generate(PROMPT, max_new_tokens=NEW, stop=[stop, "never generated \x00"])
    assert completion.finish_reason == "stop" and completion.text == expected
    ids = completion.token_ids
    assert ids == reference.token_ids[: len(ids)] and len(ids) < NEW
    decode = lambda tokens: llm.tokenizer.decode(tokens, skip_special_tokens=True)  # noqa: E731
    assert stop in decode(ids) and stop not in decode(ids[:-1])  # the token that completes it is the last
    streamed = llm.stream(PROMPT, max_new_tokens=NEW, stop=stop)
    deltas = list(streamed)
    assert "".join(deltas) == expected and streamed.completion.token_ids == ids


def test_per_request_sampling_equals_the_same_settings_in_the_config(llm, tiny_dir, tiny_draft_dir):
    sampled = dict(temperature=0.9, top_p=0.95, seed=7)
    first = llm.generate(PROMPT, max_new_tokens=NEW, **sampled)
    assert llm.generate(PROMPT, max_new_tokens=NEW, **sampled).token_ids == first.token_ids
    assert llm.generate(PROMPT, max_new_tokens=NEW, **{**sampled, "seed": 8}).token_ids != first.token_ids
    configured = LLM(
        "speculative",
        reuse_prompts=False,
        target=tiny_dir,
        draft=tiny_draft_dir,
        dtype="float32",
        seed=7,
        sampling__temperature=0.9,
        **{"sampling.top_p": 0.95},
        **FIXED,
    )
    assert configured.generate(PROMPT, max_new_tokens=NEW).token_ids == first.token_ids


def test_leaving_a_stream_early_cancels_it_and_the_next_request_is_whole(llm, reference):
    with llm.stream(PROMPT, max_new_tokens=NEW) as stream:
        for _ in zip(range(2), stream):
            pass
    assert stream.completion.finish_reason == "cancelled"
    assert 0 < len(stream.completion.token_ids) < NEW
    assert stream.completion.token_ids == reference.token_ids[: len(stream.completion.token_ids)]
    assert llm.generate(PROMPT, max_new_tokens=NEW).token_ids == reference.token_ids


def test_chat_uses_the_targets_template(llm):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    completion = llm.chat(messages, max_new_tokens=4)
    template = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert completion.prompt_token_ids == llm.tokenizer.encode(template, add_special_tokens=False)
    assert template.endswith("<|im_start|>assistant\n") and len(completion.token_ids) == 4
    streamed = llm.stream_chat(messages, max_new_tokens=4)
    assert "".join(streamed) == completion.text


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (dict(temperature=-1), "temperature: Input should be greater than or equal to 0"),
        (dict(temperature=1e-6), "temperature: Value error, must be 0 (greedy) or at least"),
        (dict(top_p=0), "top_p: Input should be greater than 0"),
        (dict(top_k=-2), "top_k: Input should be greater than or equal to 0"),
        (dict(max_new_tokens=0), "max_new_tokens: must be a whole number of at least 1; got 0"),
        (dict(max_new_tokens=600), "exceeds the context limit of 512 tokens"),
        (dict(seed=-1), "seed: must be a whole number from 0 to 2**64 - 1; got -1"),
        (dict(stop=["ok", ""]), "stop: every stop string must be non-empty text; got ''"),
        (dict(stop=["x"] * 17), "stop: 17 stop strings given; at most 16 are allowed"),
    ],
)
def test_bad_parameters_raise_value_errors_that_say_what_is_allowed(llm, params, message):
    with pytest.raises(ValueError) as raised:
        llm.generate(PROMPT, **params)
    assert message in str(raised.value)


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ("   ", "the prompt is empty"),
        ([], "the prompt is empty"),
        ([1, 2, 49152], "token ids must be whole numbers from 0 to 49151; got 49152"),
        ([1, "a"], "got 'a'"),
    ],
)
def test_bad_prompts_raise_value_errors(llm, prompt, message):
    with pytest.raises(ValueError) as raised:
        llm.generate(prompt)
    assert message in str(raised.value)


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ([], "a chat is a non-empty list"),
        ("Hi", "a chat is a non-empty list"),
        ([{"role": "robot", "content": "Hi"}], "messages[0]: needs a role, one of system, user, assistant, tool"),
        ([{"role": "user", "content": None}], "messages[0].content: must be text; got None"),
    ],
)
def test_bad_chats_raise_value_errors(llm, messages, message):
    with pytest.raises(ValueError) as raised:
        llm.chat(messages)
    assert message in str(raised.value)


def test_a_bad_setting_raises_the_clis_message(tiny_dir):
    with pytest.raises(ValueError) as raised:
        LLM("autoregressive", target=tiny_dir, reuse_prompts=False, **{"sampling.top_p": 2})
    assert str(raised.value) == "invalid config:\n  sampling.top_p: Input should be less than or equal to 1"
    with pytest.raises(ValueError) as raised:
        LLM("autoregressive", target=tiny_dir, reuse_prompts=False, sampling__warmth=1)
    assert "sampling.warmth: unknown setting; allowed here: temperature, top_k, top_p" in str(raised.value)


def test_the_lock_serves_threads_in_the_order_they_asked():
    lock, served = FifoLock(), []

    def worker(index: int) -> None:
        with lock:
            served.append(index)

    with lock:  # every worker queues behind this holder, in its start order
        threads = []
        for index in range(8):
            threads.append(threading.Thread(target=worker, args=(index,)))
            threads[-1].start()
            time.sleep(0.05)  # let it take its ticket
    for thread in threads:
        thread.join()
    assert served == list(range(8))
