"""Config validation: presets, overrides, and specific messages for bad settings."""

from __future__ import annotations

import argparse

import pytest

from cascade.errors import CascadeError
from configs import PipelineConfig, load_config, preset_names
from configs.loading import policy_at_budget, policy_option


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_validates(name):
    loaded_name, config = load_config(preset=name)
    assert loaded_name == name and isinstance(config, PipelineConfig)


def test_overrides_and_flags_apply_in_order():
    _, config = load_config(
        overrides=["sampling.temperature=0.7", "target.rope_scaling.factor=4", "stages.0.gamma=3"],
        settings={"sampling.temperature": 0.5, "target.path": "123"},
    )
    assert config.sampling.temperature == 0.5
    assert config.target.rope_scaling.kind == "yarn" and config.target.rope_scaling.factor == 4
    assert config.stages[0].gamma == 3
    assert config.target.path == "123"


def test_a_cache_switched_to_another_kind_keeps_only_that_kinds_settings():
    """The preset's streaming draft switched to a full cache, or to a policy sharing some of its settings;
    a setting given after the switch is checked against the new kind."""
    _, config = load_config("speculative", overrides=["stages.0.cache.kind=full"])
    assert config.stages[0].cache.kind == "full"
    _, config = load_config("speculative", overrides=["stages.0.cache.kind=streaming", "stages.0.cache.window=64"])
    assert (config.stages[0].cache.window, config.stages[0].cache.prefill_tail) == (64, 4096)  # same kind: kept
    _, config = load_config("self-spec", overrides=["stages.0.cache.budget=2048", "stages.0.cache.kind=h2o"])
    assert config.stages[0].cache.kind == "h2o" and config.stages[0].cache.budget == 2048
    with pytest.raises(CascadeError, match="stages.0.cache.window: unknown setting; allowed here: kind"):
        load_config("speculative", overrides=["stages.0.cache.kind=full", "stages.0.cache.window=64"])


@pytest.mark.parametrize(
    "override,message",
    [
        ("sampling.temprature=1", "sampling.temprature: unknown setting; allowed here: temperature, top_k, top_p"),
        ("stages.0.cache.budget=64", "stages.0.cache.budget: unknown setting; allowed here: kind"),
        ("colour=red", "colour: unknown setting; allowed here: stages, target, draft, sampling"),
        ("sampling.top_p=1.5", "sampling.top_p: Input should be less than or equal to 1"),
        ("sampling.temperature=-1", "sampling.temperature: Input should be greater than or equal to 0"),
        ("max_new_tokens=0", "max_new_tokens: Input should be greater than or equal to 1"),
        ("stages.0.cache.kind=magic", "does not match any of the expected tags: 'full'"),
        ("stages.0.model=draft", "the last stage must be the target with a full cache"),
        ("stages.2.gamma=1", "'2' is not an index of a 1-item list"),
        ("stages.0.schedule=greedy", "stages.0.schedule: Input should be 'fixed', 'heuristic' or 'cost_model'"),
        ("sampling", "--set expects dotted.key=value"),
        ("stages.0.model.name=x", "'model' is a single value ('target'), not a group of settings"),
        ("stages.0.stop_below=0.5", "stages.0.stop_below: only the first stage of two or more ends its proposals"),
        ("stages.0.stop_below=1", "stages.0.stop_below: Input should be less than 1"),
    ],
)
def test_bad_settings_get_specific_messages(override, message):
    with pytest.raises(CascadeError) as error:
        load_config("autoregressive", overrides=[override])
    assert message in str(error.value)


def test_a_single_value_addressed_as_a_group_says_how_to_replace_it():
    with pytest.raises(
        CascadeError,
        match=r"'refresh' is a single value \('never'\), not a group of settings; "
        r"to make it one, set it whole, e.g. --set stages.0.cache.refresh="
        r"'\{every: VALUE\}'",
    ):
        load_config("self-spec", overrides=["stages.0.cache.refresh=never", "stages.0.cache.refresh.every=16"])
    _, config = load_config(
        "self-spec", overrides=["stages.0.cache.refresh=never", "stages.0.cache.refresh={every: 16}"]
    )
    assert config.stages[0].cache.refresh.every == 16


def test_a_retrieval_stage_needs_a_full_cache_stage_of_its_model_above_it():
    with pytest.raises(
        CascadeError,
        match="a retrieval cache reads the prompt's KV from a full-cache stage "
        r"of the same model \(draft\), and there is none",
    ):
        load_config("self-spec", overrides=["stages.0.model=draft"])


def test_unknown_preset_lists_the_available_ones():
    with pytest.raises(
        CascadeError,
        match="unknown preset 'fastest'; available presets: autoregressive, lookup, lookup-speculative, self-spec, "
        "speculative, triforce",
    ):
        load_config(preset="fastest")


def test_config_file(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("stages:\n  - {model: target, cache: {kind: full}}\nmax_new_tokens: 9\n")
    name, config = load_config(file=path)
    assert (name, config.max_new_tokens) == ("mine", 9)
    path.write_text("- just\n- a list\n")
    with pytest.raises(CascadeError, match="must hold a mapping"):
        load_config(file=path)
    with pytest.raises(CascadeError, match="cannot read config file"):
        load_config(file=tmp_path / "absent.yaml")


def test_a_policy_named_with_settings_at_a_budget():
    settings = policy_at_budget("retrieval:scoring=attention,refresh.every=4", 64)
    assert {key: settings[key] for key in ("kind", "budget", "scoring", "refresh")} == {
        "kind": "retrieval",
        "budget": 64,
        "scoring": "attention",
        "refresh": {"every": 4},
    }
    assert policy_at_budget("topk_oracle", 32) == {"kind": "topk_oracle", "budget": 32}
    with pytest.raises(CascadeError, match="unknown cache policy 'nope'; registered: .*retrieval"):
        policy_at_budget("nope", 64)
    assert policy_option("retrieval:scoring=attention") == "retrieval:scoring=attention"
    with pytest.raises(argparse.ArgumentTypeError, match="unknown cache policy 'nope'"):
        policy_option("nope:budget=8")
