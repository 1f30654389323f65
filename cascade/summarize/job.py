"""A summarization job: which documents are left, summarizing them in order, and one line each."""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from cascade.errors import CascadeError
from cascade.summarize.documents import Document, read_inputs
from cascade.summarize.results import ResultLog
from cascade.summarize.summarizer import Summarizer, Summary
from configs import PipelineConfig


@dataclass(frozen=True)
class Job:
    inputs: tuple[Path, ...]
    output: Path
    config: PipelineConfig
    template: str
    quiet: bool = False
    batch_size: int = 1
    """Documents summarized together (their generations decoded as one batch where the preset allows)."""

    @property
    def config_hash(self) -> str:
        """Identifies what a summary was made with: every config setting and the template."""
        payload = json.dumps({"config": self.config.model_dump(mode="json"), "template": self.template}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


@dataclass
class Outcome:
    summarized: int = 0
    failed: int = 0
    skipped: int = 0
    """Already done under the same config hash."""

    def count(self, record: dict) -> None:
        self.failed += "error" in record
        self.summarized += "summary" in record


def pending_documents(job: Job, log: ResultLog) -> tuple[list[Document], int]:
    """Documents still to do (a repeated id becomes an error), and how many were already done."""
    done = log.done(job.config_hash)
    pending, seen, skipped = [], set(), 0
    for document in read_inputs(list(job.inputs)):
        if document.id in seen:
            pending.append(Document(document.id, error="duplicate id: an earlier input has the same id"))
            continue
        seen.add(document.id)
        if document.id in done:
            skipped += 1
        else:
            pending.append(document)
    return pending, skipped


def summary_record(document: Document, summary: Summary, wall_s: float, config_hash: str) -> dict:
    stats = {**summary.stats.to_dict(), "wall_s": round(wall_s, 3), "config_hash": config_hash}
    return {
        "id": document.id,
        "summary": summary.text,
        **({"note": summary.note} if summary.note else {}),
        "stats": stats,
    }


def error_record(document_id: str, error: str, config_hash: str) -> dict:
    return {"id": document_id, "error": error, "stats": {"config_hash": config_hash}}


def records_for(documents: list[Document], summarizer: Callable[[], Summarizer], config_hash: str) -> list[dict]:
    """The output lines of ``documents``, in order, their summaries made together (``wall_s``: the
    time of the whole group): each its summary, or why it has none. ``summarizer()`` is called only
    if a document is readable (loading the models is left until one needs them)."""
    readable = [document for document in documents if document.error is None]
    started = time.perf_counter()
    try:
        summaries = summarizer().summarize_many([document.text for document in readable]) if readable else []
    except CascadeError as exc:  # the whole group (its caches would not fit, say)
        summaries = [exc] * len(readable)
    wall_s = time.perf_counter() - started
    made = dict(zip((document.id for document in readable), summaries, strict=True))
    records = []
    for document in documents:
        outcome = made.get(document.id) if document.error is None else CascadeError(document.error)
        if isinstance(outcome, CascadeError):
            records.append(error_record(document.id, str(outcome), config_hash))
        else:
            records.append(summary_record(document, outcome, wall_s, config_hash))
    return records


class Progress:
    """A bar of documents with the decode speed, or (quiet) one log line per document."""

    def __init__(self, total: int, skipped: int, quiet: bool) -> None:
        self.quiet, self.new_tokens, self.decode_s = quiet, 0, 0.0
        self.bar = None if quiet else tqdm(total=total, unit="doc", desc="summarizing", file=sys.stderr)
        self.log(f"cascade.summarize: {total} documents to do, {skipped} already done")

    def log(self, message: str) -> None:
        if self.quiet:
            print(message, file=sys.stderr, flush=True)

    def __call__(self, record: dict) -> None:
        stats = record["stats"]
        self.new_tokens += stats.get("new_tokens", 0)
        self.decode_s += stats.get("decode_s", 0.0)
        rate = self.new_tokens / self.decode_s if self.decode_s else 0.0
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(f"{rate:.1f} tok/s")
        elif "error" in record:
            self.log(f"failed {record['id']}: {record['error']}")
        else:
            self.log(
                f"done {record['id']}: {stats['prompt_tokens']} prompt tokens, {stats['new_tokens']} new, "
                f"{stats['tokens_per_s']} tok/s"
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
