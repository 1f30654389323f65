"""Long documents for benchmarks: ``python -m cascade.data fetch`` / ``list``; ``document_text(name)``."""

from cascade.data.corpus import (
    CORPORA,
    DOCUMENT_NAMES,
    DOCUMENTS,
    Corpus,
    document_ids,
    document_path,
    document_text,
    fetch_corpus,
    is_fetched,
)

__all__ = [
    "CORPORA",
    "DOCUMENT_NAMES",
    "DOCUMENTS",
    "Corpus",
    "document_ids",
    "document_path",
    "document_text",
    "fetch_corpus",
    "is_fetched",
]
