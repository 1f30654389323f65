"""The tokens a draft keeps in its output projection (``draft.frequent_tokens``, after FR-Spec):
token ids ranked by how often they occur in a reference corpus, the Python standard library's own
source, which every machine running cascade has, whose tokens mix code and English, and which no
benchmark document comes from. A ranking is counted once per tokenizer and Python version and kept
in ``$CASCADE_HOME/vocabulary/``."""

from __future__ import annotations

import hashlib
import logging
import platform
import sysconfig
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import PreTrainedTokenizerBase

from cascade.atomic import replacing
from cascade.home import cascade_home

logger = logging.getLogger(__name__)

SKIPPED_DIRECTORIES = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib"})
"""Parts of the standard library left out: installed packages, and test suites full of odd strings."""


def frequent_tokens(tokenizer: PreTrainedTokenizerBase, vocab_size: int, count: int) -> torch.Tensor:
    """The ``count`` most frequent token ids of the corpus [count] int64, special tokens first (so a
    draft can still propose the end of a sequence)."""
    ranking = token_ranking(tokenizer, vocab_size)
    special = torch.tensor(sorted(set(tokenizer.all_special_ids)), dtype=torch.int64)
    ranked = torch.cat([special, ranking[~torch.isin(ranking, special)]])
    return ranked[:count]


def token_ranking(tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> torch.Tensor:
    """Every id below ``vocab_size`` [vocab_size] int64, most frequent first, ties by id."""
    path = ranking_path(tokenizer, vocab_size)
    if path.exists():
        return load_file(path)["ranking"]
    sources = standard_library_sources()
    logger.info(f"ranking {vocab_size} tokens by their count in {len(sources)} files of the Python standard library")
    counts = count_tokens(tokenizer, [read_source(source) for source in sources], vocab_size)
    ranking = rank(counts)
    path.parent.mkdir(parents=True, exist_ok=True)
    with replacing(path) as partial:
        save_file({"ranking": ranking, "counts": counts}, partial, metadata={"source": corpus_name()})
    return ranking


def rank(counts: torch.Tensor) -> torch.Tensor:
    """Token counts [V] -> ids [V], the most counted first, equal counts by id."""
    return torch.argsort(-counts, stable=True)  # stable: equal counts stay in id order


def count_tokens(tokenizer: PreTrainedTokenizerBase, texts: list[str], vocab_size: int) -> torch.Tensor:
    """How often each id below ``vocab_size`` occurs in ``texts`` -> [vocab_size] int64."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        counts += torch.bincount(torch.tensor(ids, dtype=torch.int64), minlength=vocab_size)[:vocab_size]
    return counts


def standard_library_sources() -> list[Path]:
    """The standard library's ``.py`` files, by path, without tests and installed packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = (path for path in root.rglob("*.py") if SKIPPED_DIRECTORIES.isdisjoint(path.relative_to(root).parts))
    return sorted(found)


def read_source(path: Path) -> str:
    return path.read_bytes().decode("utf-8", errors="replace")


def corpus_name() -> str:
    return f"the Python {platform.python_version()} standard library"


def ranking_path(tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> Path:
    """Where the ranking of this tokenizer's ids over this Python's standard library is kept."""
    vocabulary = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    key = hashlib.sha256(repr((vocabulary, vocab_size, corpus_name())).encode()).hexdigest()[:16]
    return cascade_home() / "vocabulary" / f"{key}.safetensors"
