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
