"""Machine tuning: each threshold is read from what ``python -m cascade.tune`` measured on this
machine, else its default; the calibration picks the compiled attention kernel's crossover and the
fastest key block from the timings, and keeps them where the next process finds them."""

from __future__ import annotations

import json
import logging
import math

import pytest

from cascade import kernels, tune
from cascade.tuning import Tuning, machine_key, machine_tuning, save_tuning, tuning_path


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("CASCADE_HOME", str(tmp_path))
    machine_tuning.cache_clear()
    yield tmp_path
    machine_tuning.cache_clear()


def timings(compiled_wins: set[int]):
    return lambda kernel, keys: 1.0 if (kernel == "compiled") == (keys in compiled_wins) else 2.0


@pytest.mark.parametrize(
    "wins, threshold",
    [({1024, 2048, 4096}, 5793), (set(), 0), (set(tune.KEY_COUNTS), 16384), ({1024, 4096}, 1448)],
    ids=["crossover", "never", "always", "first-loss-decides"],
)
def test_the_crossover_lies_between_the_compiled_kernels_last_win_and_its_first_loss(wins, threshold):
    found, measured = tune.compiled_attention_crossover(timings(wins))
    assert found == threshold
    assert measured[4096] == {"compiled": 1.0 if 4096 in wins else 2.0, "cpu": 2.0 if 4096 in wins else 1.0}


def test_the_fastest_split_has_the_least_time_over_every_key_count():
    costs = {256: 5, 512: 3, 1024: 4, 2048: 2.5, 4096: 9}
    found, measured = tune.fastest_split(
        lambda block, keys: costs[block] * (2 if keys > 20000 and block == 2048 else 1)
    )
    assert found == 512  # 2048 is faster at 16K keys but slower over both
    assert set(measured) == set(tune.BLOCK_SIZES)


def test_without_a_measurement_the_defaults_hold_and_a_saved_one_is_read_back(home):
    assert machine_tuning() == Tuning()
    measured = Tuning(compiled_attention_max_keys=4096, split_keys=512)
    path = save_tuning(measured, {"compiled_attention": {}})
    assert path == tuning_path(machine_key()) and path.is_relative_to(home)
    assert json.loads(path.read_text())["machine"]["cpu"] == machine_key()["cpu"]
    machine_tuning.cache_clear()
    assert machine_tuning() == measured


def test_an_unreadable_tuning_warns_and_falls_back_to_the_defaults(home, caplog):
    path = tuning_path(machine_key())
    path.parent.mkdir(parents=True)
    path.write_text('{"tuning": {"split_keys": 512, "unknown": 1}}')
    with caplog.at_level(logging.WARNING, logger="cascade"):
        assert machine_tuning() == Tuning()
    assert "unreadable" in caplog.text and "python -m cascade.tune" in caplog.text


def test_tune_measures_this_cpu_and_keeps_the_result(home, monkeypatch, capsys):
    monkeypatch.setattr(tune, "KEY_COUNTS", (64, 128))
    assert tune.main(["--repeats", "2"]) == 0
    machine_tuning.cache_clear()
    kept = machine_tuning()
    assert kept.compiled_attention_max_keys in (0, round(math.sqrt(64 * 128)), 128)
    report = json.loads(tuning_path(machine_key()).read_text())
    assert set(report["measurements"]["compiled_attention"]) == {"64", "128"}
    assert "kept in" in capsys.readouterr().out
    if report["machine"]["gpu"] is None:  # nothing to time it on
        assert kept.split_keys == Tuning().split_keys
    if kernels.step_orders_available():
        order = report["measurements"]["step_order"]
        assert kept.step_in_memory_order == (order["memory_order"] < order["across"])
