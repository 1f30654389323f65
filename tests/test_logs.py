"""The library reports through ``logging``; ``show_logs`` puts it on stderr for the entry points."""

from __future__ import annotations

import logging

import pytest

from cascade.logs import LIBRARY_LOGGERS, show_logs


@pytest.fixture
def restored_loggers():
    """Each library logger's handlers and level as they were before the test."""
    saved = {name: (list(logging.getLogger(name).handlers), logging.getLogger(name).level) for name in LIBRARY_LOGGERS}
    yield
    for name, (handlers, level) in saved.items():
        logging.getLogger(name).handlers[:] = handlers
        logging.getLogger(name).setLevel(level)


def test_progress_and_warnings_reach_stderr_once_however_often_it_is_called(restored_loggers, capsys):
    show_logs()
    show_logs()
    logging.getLogger("cascade.runtime").info("loaded")
    logging.getLogger("cache.streaming").warning("slower")
    logging.getLogger("cascade.model").debug("detail")
    assert capsys.readouterr().err == "loaded\nslower\n"


def test_quiet_shows_only_warnings_and_verbose_debug_too(restored_loggers, capsys):
    show_logs(quiet=True)
    logging.getLogger("cascade.runtime").info("loaded")
    logging.getLogger("cascade.runtime").warning("slower")
    assert capsys.readouterr().err == "slower\n"
    show_logs(verbose=True)
    logging.getLogger("configs.loading").debug("detail")
    assert capsys.readouterr().err == "detail\n"
