"""Where cascade's CPU kernels are built from: one directory per source version, CPU and PyTorch
installation, reading copies of the sources that stay put, so that two checkouts or installed copies
of cascade on one machine share a build instead of rebuilding it in turn."""

from __future__ import annotations

import torch

from cascade import kernels


def test_the_build_reads_copies_of_the_sources_that_a_second_call_leaves_untouched(tmp_path):
    sources = kernels.staged_sources(tmp_path)
    staged = tmp_path / "src"
    assert sources == [str(staged / path.name) for path in kernels.SOURCES]
    for path in (*kernels.SOURCES, *kernels.HEADERS):
        assert (staged / path.name).read_bytes() == path.read_bytes()
    written = {path.name: path.stat().st_mtime_ns for path in staged.iterdir()}
    assert kernels.staged_sources(tmp_path) == sources
    assert {path.name: path.stat().st_mtime_ns for path in staged.iterdir()} == written  # ninja would rebuild


def test_another_pytorch_installation_builds_in_another_directory(home, monkeypatch):
    here = kernels.build_directory()
    assert kernels.build_directory() == here and here.parent == home / "build"
    monkeypatch.setattr(torch, "__file__", "/elsewhere/site-packages/torch/__init__.py")
    assert kernels.build_directory() != here


def test_a_home_whose_build_links_to_another_homes_builds_in_that_home(home, monkeypatch, tmp_path_factory):
    """tests/scripts.py's ``linked_home`` does this for every script it runs: the build's commands name
    the resolved directory, else each linked home would rebuild the shared one (~4 minutes here)."""
    shared = kernels.build_directory()
    linked = tmp_path_factory.mktemp("linked-home")
    (linked / "build").symlink_to(home / "build", target_is_directory=True)
    monkeypatch.setenv("CASCADE_HOME", str(linked))
    assert kernels.build_directory() == shared
    assert kernels.staged_sources(kernels.build_directory())[0].startswith(str(home / "build"))
