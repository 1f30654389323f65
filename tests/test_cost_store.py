"""Pass costs kept on disk for later processes: what an entry holds, which prompt length finds it,
what a different stage set, machine or a damaged file finds, and a runtime (and the CLI) starting
its first request warm from what an earlier one kept (tiny models for the wiring)."""

from __future__ import annotations

import json
import logging

import pytest

from cascade.cost_store import KEPT_LENGTHS, costs_identity, costs_path, keep_stats, kept_stats
from cascade.pass_costs import CARRY_WITHIN
from cascade.schedule import PLAIN_STEPS_TIMED
from cascade.stats import StageStats
from configs import load_config
from tests.test_cli import generate as generate_cli
from tests.test_pipeline import PROMPT, generate, runtime_for
from tests.test_schedule import measured

NAMES = ["0:draft/streaming", "1:target/full"]


@pytest.fixture
def identity(tiny_dir, tiny_draft_dir) -> dict:
    _, config = load_config("speculative", None, [], {"target.path": str(tiny_dir), "draft.path": str(tiny_draft_dir)})
    return costs_identity(config, tuple(config.stages))


def two_stages(step_s: float) -> list[StageStats]:
    """A proposer's stats after 3 plain steps of ``step_s`` and two rounds, and the verifier's."""
    proposer = measured([(4, 4), (2, 1)], propose_s=0.01, verify_s={4: 0.12, 2: 0.11}, step_s=step_s)
    proposer.name = NAMES[0]
    return [proposer, StageStats(NAMES[1])]


def test_kept_costs_come_back_for_a_prompt_of_about_the_same_length(tmp_path, identity):
    keep_stats(tmp_path, identity, 1000, two_stages(0.1))
    back = kept_stats(tmp_path, identity, NAMES, 1100)
    assert back is not None and [one.name for one in back] == NAMES
    proposer = back[0]
    assert proposer.plain_samples == [0.1] * PLAIN_STEPS_TIMED and proposer.proposal_samples == [0.01, 0.01]
    assert proposer.verification_samples == {4: [0.12], 2: [0.11]}
    assert (proposer.accepted, proposer.rejections, proposer.rounds) == (0, 0, 0)  # acceptance is never kept
    assert kept_stats(tmp_path, identity, NAMES, int(1000 * CARRY_WITHIN) + 1) is None
    assert kept_stats(tmp_path, identity, ["0:draft/full", NAMES[1]], 1000) is None  # other stages


def test_the_nearest_kept_length_answers_and_a_new_entry_replaces_those_it_carries_to(tmp_path, identity):
    keep_stats(tmp_path, identity, 1000, two_stages(0.1))
    keep_stats(tmp_path, identity, 1240, two_stages(0.2))  # carries to 1000: replaces it
    keep_stats(tmp_path, identity, 8000, two_stages(0.8))
    lengths = [entry["prompt_tokens"] for entry in json.loads(costs_path(tmp_path, identity).read_text())["entries"]]
    assert lengths == [1240, 8000]
    assert kept_stats(tmp_path, identity, NAMES, 1000)[0].plain_samples == [0.2] * PLAIN_STEPS_TIMED
    assert kept_stats(tmp_path, identity, NAMES, 7000)[0].plain_samples == [0.8] * PLAIN_STEPS_TIMED
    for length in range(KEPT_LENGTHS + 2):  # far apart, so none replaces another
        keep_stats(tmp_path, identity, 2 ** (length + 14), two_stages(float(length)))
    entries = json.loads(costs_path(tmp_path, identity).read_text())["entries"]
    assert len(entries) == KEPT_LENGTHS and entries[-1]["prompt_tokens"] == 2 ** (KEPT_LENGTHS + 15)


def test_costs_are_kept_per_machine_models_and_stages(tmp_path, identity):
    keep_stats(tmp_path, identity, 1000, two_stages(0.1))
    other_machine = {**identity, "machine": {**identity["machine"], "threads": identity["machine"]["threads"] + 1}}
    other_stages = {**identity, "stages": identity["stages"][1:]}
    assert costs_path(tmp_path, other_machine) != costs_path(tmp_path, identity) != costs_path(tmp_path, other_stages)
    assert kept_stats(tmp_path, other_machine, NAMES, 1000) is None
    costs_path(tmp_path, identity).rename(costs_path(tmp_path, other_machine))  # a file whose identity differs
    assert kept_stats(tmp_path, other_machine, NAMES, 1000) is None


def test_a_damaged_file_costs_a_warning_and_is_replaced(tmp_path, identity, caplog):
    path = costs_path(tmp_path, identity)
    path.write_text('{"identity": {}, "entries": [{"prompt_tokens": "many"}]}')
    with caplog.at_level(logging.WARNING, logger="cascade.cost_store"):
        assert kept_stats(tmp_path, identity, NAMES, 1000) is None
    assert any("unreadable" in record.getMessage() for record in caplog.records)
    keep_stats(tmp_path, identity, 1000, two_stages(0.1))
    assert kept_stats(tmp_path, identity, NAMES, 1000)[0].plain_samples == [0.1] * PLAIN_STEPS_TIMED


def test_a_directory_that_cannot_be_written_costs_a_warning(tmp_path, identity, caplog):
    blocked = tmp_path / "file"
    blocked.write_text("")
    with caplog.at_level(logging.WARNING, logger="cascade.cost_store"):
        keep_stats(blocked / "pass-costs", identity, 1000, two_stages(0.1))
    assert any("could not keep pass costs" in record.getMessage() for record in caplog.records)


def test_a_later_runtime_starts_from_the_costs_an_earlier_one_kept(tiny_dir, tiny_draft_dir, tmp_path):
    """Two runtimes stand for two processes: the second's first request starts warm, with the same
    greedy output; without ``pass_costs_dir``, or with ``carry_pass_costs: false``, it starts cold."""
    kept = [f"pass_costs_dir={tmp_path}"]
    first = runtime_for("speculative", tiny_dir, tiny_draft_dir, kept)
    cold = first.generate(PROMPT, 30, stop_at_eos=False)
    assert not cold.stats.stages[0].costs_carried
    later = runtime_for("speculative", tiny_dir, tiny_draft_dir, kept)
    warm = later.generate(PROMPT, 30, stop_at_eos=False)
    assert warm.stats.stages[0].costs_carried and warm.token_ids == cold.token_ids
    assert not later.generate(PROMPT[:100], 30).stats.stages[0].costs_carried  # a length nothing was kept for
    unkept = runtime_for("speculative", tiny_dir, tiny_draft_dir)
    assert not generate(unkept, PROMPT, 30).stats.stages[0].costs_carried
    off = runtime_for("speculative", tiny_dir, tiny_draft_dir, [*kept, "carry_pass_costs=false"])
    assert not off.generate(PROMPT, 30).stats.stages[0].costs_carried


def test_autoregressive_decoding_keeps_nothing(tiny_dir, tiny_draft_dir, tmp_path):
    runtime_for("autoregressive", tiny_dir, tiny_draft_dir, [f"pass_costs_dir={tmp_path}"]).generate(PROMPT, 10)
    assert not list(tmp_path.iterdir())


def test_the_cli_keeps_costs_for_its_next_run(tiny_dir, tmp_path, kept_pass_costs):
    flags = ["--target", str(tiny_dir), "--draft", str(tiny_dir), "--preset", "speculative", "--dtype", "float32"]
    flags += ["--prompt", "The sea is " * 20, "--max-new-tokens", "12"]
    runs = []
    for name in ("first", "second"):
        result = generate_cli(*flags, "--json", str(tmp_path / f"{name}.json"))
        assert result.returncode == 0, result.stderr
        runs.append(json.loads((tmp_path / f"{name}.json").read_text()))
    assert [run["stats"]["stages"][0]["costs_carried"] for run in runs] == [False, True]
    assert runs[0]["token_ids"] == runs[1]["token_ids"] and len(list(kept_pass_costs.iterdir())) == 1
