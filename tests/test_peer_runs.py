"""llama.cpp's tools as the benchmark runs them: the command lines built for given settings, their
outputs parsed (recorded from real runs of llama.cpp 0c1e57098 on SmolLM2-135M in
``tests/testdata``), a bench.py case's choice of flash-attention setting, and errors for bad input.
The ``llamacpp`` tests run the built tools, and skip cleanly where they are not built."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cascade.errors import CascadeError
from cascade.peers import bench_case, speculative
from cascade.peers.bench_case import context_case, flash_attn_summary
from cascade.peers.convert import gguf_path
from cascade.peers.llama_bench import BenchSettings, bench_command, parse_bench_json
from cascade.peers.llamacpp import installed_build
from cascade.peers.speculative import SpeculativeSettings, parse_speculative_output

TESTDATA = Path(__file__).parent / "testdata"
BENCH_JSON = (TESTDATA / "llama_bench_smollm2.json").read_text()
SPECULATIVE_LOG = (TESTDATA / "llama_speculative_smollm2.txt").read_text()
LLAMA_CPP = installed_build()
needs_llamacpp = pytest.mark.skipif(LLAMA_CPP is None, reason="llama.cpp is not built (python -m cascade.peers build)")


def test_bench_command_runs_every_test_at_every_depth_with_flash_attention_off_and_on():
    settings = BenchSettings(prompt_tokens=(512,), gen_tokens=(64,), depths=(0, 1024), threads=2, repetitions=3)
    assert bench_command(Path("bin/llama-bench"), Path("m.gguf"), settings) == [
        "bin/llama-bench",
        "-m",
        "m.gguf",
        "-o",
        "json",
        "-t",
        "2",
        "-r",
        "3",
        "-p",
        "512",
        "-n",
        "64",
        "-d",
        "0,1024",
        "-fa",
        "off,on",
    ]


def test_bench_command_asks_for_no_test_of_a_kind_left_out():
    settings = BenchSettings(gen_tokens=(16, 128), depths=(8192,), flash_attn=("on",), repetitions=1)
    command = bench_command(Path("llama-bench"), Path("m.gguf"), settings)
    assert command[command.index("-p") + 1] == "0"  # llama-bench skips prompt processing of 0 tokens
    assert command[command.index("-n") + 1] == "16,128"
    assert command[command.index("-fa") + 1] == "on"


@pytest.mark.parametrize(
    "settings, message",
    [
        ({}, "needs a prompt-processing or a token-generation test"),
        ({"gen_tokens": (16,), "depths": ()}, "needs a KV depth"),
        ({"prompt_tokens": (0,)}, r"prompt lengths must be >= 1; got \[0\]"),
        ({"gen_tokens": (16,), "depths": (-1,)}, r"depths must be >= 0; got \[-1\]"),
        ({"gen_tokens": (16,), "threads": 0}, r"threads must be >= 1; got \[0\]"),
        ({"gen_tokens": (16,), "repetitions": 0}, r"repetitions must be >= 1; got \[0\]"),
        ({"gen_tokens": (16,), "flash_attn": ("yes",)}, "expected some of off, on, auto"),
    ],
)
def test_bench_settings_refuse_bad_input(settings, message):
    with pytest.raises(CascadeError, match=message):
        BenchSettings(**settings)


def test_recorded_llama_bench_json_parses_into_one_dict_per_test():
    tests = parse_bench_json(BENCH_JSON)
    assert [(test["test"], test["flash_attn"]) for test in tests] == [
        ("pp", "off"),
        ("tg", "off"),
        ("pp", "on"),
        ("tg", "on"),
    ]
    prefill = tests[0]
    assert (prefill["n_prompt"], prefill["n_gen"], prefill["n_depth"], prefill["threads"]) == (64, 0, 0, 2)
    assert prefill["tokens_per_s"] == pytest.approx(64.730969) and prefill["tokens_per_s_stddev"] == 0.0
    assert prefill["samples_tokens_per_s"] == [pytest.approx(64.731)]
    assert prefill["type"] == "llama 256M BF16" and prefill["file"].endswith("smollm2-135m-instruct-bf16.gguf")
    assert {(test["build_commit"], test["build_number"]) for test in tests} == {("0c1e57098", 0)}
    assert tests[1]["n_gen"] == 16 and tests[1]["tokens_per_s"] == pytest.approx(5.540943)


@pytest.mark.parametrize(
    "text, message",
    [
        ("build: 0c1e57098 (0)", "llama-bench's output is not JSON"),
        ('{"avg_ts": 1.0}', "not a list of test records"),
        ('[{"n_prompt": 64}]', "a llama-bench test record lacks 'n_gen'"),
    ],
)
def test_unexpected_llama_bench_output_is_an_error_naming_the_problem(text, message):
    with pytest.raises(CascadeError, match=message):
        parse_bench_json(text)


def recorded_tests_at(
    context: int,
    new_tokens: int,
    prefill: dict[str, float],
    decode: dict[str, float],
    flash_attn=("off", "on"),
    repetitions: int = 1,
):
    """A fake run_llama_bench: the recorded tests with this case's sizes, settings and the given rates
    (each the median of ``repetitions`` samples, one of them half and one four times the median)."""

    def samples(rate: float) -> list[float]:
        return [rate] if repetitions == 1 else [rate / 2, rate, *[rate * 4] * (repetitions - 2)]

    def run(tool, model, settings):
        kind, rates = ("pp", prefill) if settings.prompt_tokens else ("tg", decode)
        assert settings.repetitions == repetitions and settings.flash_attn == flash_attn
        expected = ((context,), ()) if kind == "pp" else ((), (new_tokens,))
        assert (settings.prompt_tokens, settings.gen_tokens) == expected
        assert settings.depths == ((0,) if kind == "pp" else (context,))
        return [
            {**test, "samples_tokens_per_s": samples(rates[test["flash_attn"]])}
            for test in parse_bench_json(BENCH_JSON)
            if test["test"] == kind and test["flash_attn"] in flash_attn
        ]

    return run


def test_context_case_reports_the_faster_flash_attention_setting_for_each_rate(monkeypatch):
    fake = recorded_tests_at(1024, 16, prefill={"off": 900.0, "on": 1000.0}, decode={"off": 50.0, "on": 40.0})
    monkeypatch.setattr(bench_case, "run_llama_bench", fake)
    run = context_case(Path("llama-bench"), Path("m.gguf"), 1024, 16, threads=2)
    assert (run["prefill_tokens_per_s"], run["decode_tokens_per_s"]) == (1000.0, 50.0)
    assert run["best_flash_attn"] == {"prefill_tokens_per_s": "on", "decode_tokens_per_s": "off"}
    assert run["flash_attn"]["off"] == {"prefill_tokens_per_s": 900.0, "decode_tokens_per_s": 50.0}
    assert run["build_commit"] == "0c1e57098" and len(run["tests"]) == 4
    json.dumps(run)  # bench.py prints it as JSON


def test_a_context_case_asked_for_one_flash_attention_setting_runs_and_reports_only_that_one(monkeypatch):
    fake = recorded_tests_at(1024, 16, prefill={"on": 1000.0}, decode={"on": 40.0}, flash_attn=("on",))
    monkeypatch.setattr(bench_case, "run_llama_bench", fake)
    run = context_case(Path("llama-bench"), Path("m.gguf"), 1024, 16, threads=2, flash_attn=("on",))
    assert (run["prefill_tokens_per_s"], run["decode_tokens_per_s"]) == (1000.0, 40.0)
    assert list(run["flash_attn"]) == ["on"] and len(run["tests"]) == 2
    assert flash_attn_summary([run, run])["best_flash_attn"] == {
        "prefill_tokens_per_s": "on",
        "decode_tokens_per_s": "on",
    }


def test_a_context_case_of_several_repetitions_reports_their_median(monkeypatch):
    fake = recorded_tests_at(1024, 16, prefill={"on": 1000.0}, decode={"on": 40.0}, flash_attn=("on",), repetitions=3)
    monkeypatch.setattr(bench_case, "run_llama_bench", fake)
    run = context_case(Path("llama-bench"), Path("m.gguf"), 1024, 16, threads=2, flash_attn=("on",), repetitions=3)
    assert [test["samples_tokens_per_s"] for test in run["tests"]] == [[500.0, 1000.0, 4000.0], [20.0, 40.0, 160.0]]
    assert (run["prefill_tokens_per_s"], run["decode_tokens_per_s"]) == (1000.0, 40.0)


def test_a_decode_only_context_case_runs_no_prefill_test_and_reports_no_prefill_rate(monkeypatch):
    fake = recorded_tests_at(1024, 16, prefill={}, decode={"off": 50.0, "on": 40.0})
    asked = []
    monkeypatch.setattr(bench_case, "run_llama_bench", lambda *call: asked.append(call[2]) or fake(*call))
    run = context_case(Path("llama-bench"), Path("m.gguf"), 1024, 16, threads=2, prefill=False)
    assert [settings.prompt_tokens for settings in asked] == [()]  # one llama-bench run: decode at depth
    assert (run["prefill_tokens_per_s"], run["decode_tokens_per_s"]) == (None, 50.0)
    assert run["flash_attn"] == {"off": {"decode_tokens_per_s": 50.0}, "on": {"decode_tokens_per_s": 40.0}}
    assert flash_attn_summary([run, run])["best_flash_attn"] == {"decode_tokens_per_s": "off"}
    json.dumps(run)


def test_a_prefill_only_context_case_runs_no_decode_test_and_reports_no_decode_rate(monkeypatch):
    fake = recorded_tests_at(1024, 16, prefill={"off": 900.0, "on": 1000.0}, decode={})
    asked = []
    monkeypatch.setattr(bench_case, "run_llama_bench", lambda *call: asked.append(call[2]) or fake(*call))
    run = context_case(Path("llama-bench"), Path("m.gguf"), 1024, 16, threads=2, decode=False)
    assert [(settings.prompt_tokens, settings.gen_tokens) for settings in asked] == [((1024,), ())]  # no depth
    assert (run["prefill_tokens_per_s"], run["decode_tokens_per_s"]) == (1000.0, None)
    assert run["best_flash_attn"] == {"prefill_tokens_per_s": "on"}
    json.dumps(run)


def test_a_context_case_without_either_test_is_refused_before_running_llama_bench(monkeypatch):
    monkeypatch.setattr(bench_case, "run_llama_bench", lambda *call: pytest.fail("llama-bench ran"))
    with pytest.raises(CascadeError, match="prefill test, its decode test or both"):
        context_case(Path("llama-bench"), Path("m.gguf"), 1024, 16, threads=2, prefill=False, decode=False)


def test_flash_attn_summary_takes_medians_over_rounds_then_the_best_setting():
    def round_(off: float, on: float) -> dict:
        return {
            "flash_attn": {
                "off": {"prefill_tokens_per_s": off, "decode_tokens_per_s": off},
                "on": {"prefill_tokens_per_s": on, "decode_tokens_per_s": on / 2},
            }
        }

    summary = flash_attn_summary([round_(10, 30), round_(20, 5), round_(30, 25)])
    assert summary["flash_attn"]["on"] == {"prefill_tokens_per_s": 25, "decode_tokens_per_s": 12.5}
    assert summary["best_flash_attn"] == {"prefill_tokens_per_s": "on", "decode_tokens_per_s": "off"}


# ---- llama-speculative -------------------------------------------------------------------------


def test_speculative_command_is_greedy_with_the_draft_settings_given():
    settings = SpeculativeSettings(new_tokens=128, draft_max=8, draft_min=2, context=40960, flash_attn="on")
    paths = (Path("llama-speculative"), Path("t.gguf"), Path("d.gguf"), Path("p.txt"))
    command = speculative.speculative_command(*paths, settings)
    assert command == [
        "llama-speculative",
        "-m",
        "t.gguf",
        "-md",
        "d.gguf",
        "-f",
        "p.txt",
        "-n",
        "128",
        "--temp",
        "0.0",
        "--top-p",
        "1.0",
        "--top-k",
        "0",
        "--min-p",
        "0",
        "--seed",
        "0",
        "-t",
        "2",
        "-td",
        "2",
        "-c",
        "40960",
        "-b",
        "2048",
        "-fa",
        "on",
        "--spec-draft-n-max",
        "8",
        "--spec-draft-n-min",
        "2",
    ]
    assert not any("rope" in arg or "yarn" in arg for arg in command)  # the GGUFs carry their stretch


def test_sampled_speculative_command_samples_at_the_temperature_and_top_p_alone():
    settings = SpeculativeSettings(temperature=0.7, top_p=0.9, seed=3)
    command = speculative.speculative_command(Path("s"), Path("t"), Path("d"), Path("p"), settings)
    flags = dict(zip(command[1::2], command[2::2], strict=False))
    assert (flags["--temp"], flags["--top-p"], flags["--seed"]) == ("0.7", "0.9", "3")
    assert (flags["--top-k"], flags["--min-p"]) == ("0", "0")  # llama.cpp's own defaults (40, 0.05) off


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"new_tokens": 0}, "new_tokens >= 1"),
        ({"draft_max": 0}, "draft_max >= 1"),
        ({"draft_min": 5, "draft_max": 4}, "draft_min <= draft_max"),
        ({"context": -1}, "context >= 0"),
        ({"threads": 0}, "threads >= 1"),
        ({"batch": 0}, "batch >= 1"),
        ({"flash_attn": "fast"}, "expected off, on or auto"),
        ({"temperature": -0.5}, "temperature >= 0"),
        ({"top_p": 0.0}, "0 < top_p <= 1"),
        ({"top_p": 1.5}, "0 < top_p <= 1"),
    ],
)
def test_speculative_settings_refuse_bad_input(settings, message):
    with pytest.raises(CascadeError, match=message):
        SpeculativeSettings(**settings)


def test_recorded_llama_speculative_log_parses_into_speeds_and_acceptance():
    figures = parse_speculative_output(SPECULATIVE_LOG)  # SmolLM2 q8_0 proposing to itself in bf16, 16 asked
    assert figures == {
        "prompt_tokens": 414,
        "prefill_s": 9.142,
        "prefill_tokens_per_s": 45.285,
        "new_tokens": 21,
        "decode_s": 18.975,
        "decode_tokens_per_s": 1.107,
        "n_draft": 4,
        "n_drafted": 16,
        "n_accept": 16,
        "acceptance": 1.0,
    }


def test_a_llama_speculative_log_without_its_figures_is_an_error():
    with pytest.raises(CascadeError, match="lacks encoded, decoded, n_draft, n_predict, n_drafted, n_accept"):
        parse_speculative_output("main: error: failed to load model\n")


# ---- the built tools ---------------------------------------------------------------------------


@pytest.mark.llamacpp
@pytest.mark.slow
@needs_llamacpp
def test_built_llama_bench_measures_smollm2_with_flash_attention_off_and_on(smollm2_dir):
    model = gguf_path(smollm2_dir, "bf16")
    if not model.is_file():
        pytest.skip(f"{model} is not converted (python -m cascade.peers build)")
    settings = BenchSettings(prompt_tokens=(16,), gen_tokens=(4,), depths=(32,), repetitions=1)
    tests = bench_case.run_llama_bench(LLAMA_CPP.tool("llama-bench"), model, settings)
    assert sorted((test["test"], test["flash_attn"], test["n_depth"]) for test in tests) == [
        ("pp", "off", 32),
        ("pp", "on", 32),
        ("tg", "off", 32),
        ("tg", "on", 32),
    ]
    assert all(test["tokens_per_s"] > 0 and test["build_commit"] == LLAMA_CPP.commit for test in tests)
