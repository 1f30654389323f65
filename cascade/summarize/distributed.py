"""The Ray backend: documents spread over worker actors, with the local backend's guarantees.

Each worker loads the models once and summarizes ``batch_size`` documents per call (decoded as one
batch, as the local backend does). Before it returns a document's record it writes it to its own
shard file (``<output>.shards/<id hash>.json``, temporary name then rename). The driver appends each
returned record to the output and only then deletes the shard file, so a driver killed in between
finds the record on its next run and merges it first. A worker that dies is restarted by Ray and
its documents retried; a document whose retries all fail gets an error line.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable
from pathlib import Path

from cascade import atomic
from cascade.errors import CascadeError
from cascade.summarize.documents import Document
from cascade.summarize.job import Job, Outcome, Progress, error_record, pending_documents, records_for
from cascade.summarize.local import summarizer_for
from cascade.summarize.results import ResultLog
from cascade.summarize.summarizer import Summarizer

TASK_RETRIES = 3


class SummaryWorker:
    """A Ray actor: one runtime, a group of documents per call."""

    def __init__(self, job: Job, shard_dir: str, make_summarizer: Callable[[Job], Summarizer]) -> None:
        self.job = job
        self.shard_dir = Path(shard_dir)
        self.summarizer = functools.cache(lambda: make_summarizer(job))

    def summarize(self, documents: list[Document]) -> list[tuple[dict, str]]:
        """Each document's record (made together) and the shard file it was written to."""
        records = records_for(documents, self.summarizer, self.job.config_hash)
        return [(record, str(write_shard(self.shard_dir, record))) for record in records]


def write_shard(shard_dir: Path, record: dict) -> Path:
    shard_dir.mkdir(parents=True, exist_ok=True)
    path = shard_dir / f"{hashlib.sha1(record['id'].encode()).hexdigest()}.json"
    atomic.write_text(path, json.dumps(record, ensure_ascii=False))
    return path


def merge_shards(shard_dir: Path, log: ResultLog) -> int:
    """Append the records a killed driver left in ``shard_dir`` (unless the output has them); -> count."""
    if not shard_dir.is_dir():
        return 0
    present = {(record["id"], record.get("stats", {}).get("config_hash")) for record in log.records()}
    merged = 0
    for path in sorted(shard_dir.glob("*.json")):
        record = json.loads(path.read_text())
        if (record["id"], record.get("stats", {}).get("config_hash")) not in present:
            log.append(record)
            merged += 1
        path.unlink()
    return merged


def import_ray():
    try:
        import ray
    except ImportError:
        raise CascadeError("the ray backend needs Ray: pip install -e '.[ray]'") from None
    return ray


def run_ray(
    job: Job, workers: int, address: str | None = None, make_summarizer: Callable[[Job], Summarizer] = summarizer_for
) -> Outcome:
    ray = import_ray()
    log = ResultLog(job.output)  # a bad output is refused before Ray starts
    started_here = not ray.is_initialized()
    if started_here:
        ray.init(
            address=address, num_cpus=None if address else workers, include_dashboard=False, log_to_driver=not job.quiet
        )
    try:
        return drive(ray, job, log, workers, make_summarizer)
    finally:
        if started_here:
            ray.shutdown()


def drive(ray, job: Job, log: ResultLog, workers: int, make_summarizer: Callable[[Job], Summarizer]) -> Outcome:
    shard_dir = job.output.with_name(job.output.name + ".shards")
    merge_shards(shard_dir, log)
    pending, skipped = pending_documents(job, log)
    outcome, progress = Outcome(skipped=skipped), Progress(len(pending), skipped, job.quiet)
    actor_class = ray.remote(num_cpus=1, max_restarts=-1, max_task_retries=TASK_RETRIES)(SummaryWorker)
    actors = [actor_class.remote(job, str(shard_dir), make_summarizer) for _ in range(min(workers, len(pending)))]
    queue, in_flight = list(reversed(pending)), {}

    def submit(actor) -> None:
        if queue:
            documents = [queue.pop() for _ in range(min(job.batch_size, len(queue)))]
            in_flight[actor.summarize.remote(documents)] = (actor, documents)

    for actor in actors:
        submit(actor)
    try:
        while in_flight:
            [ready], _ = ray.wait(list(in_flight), num_returns=1)
            actor, documents = in_flight.pop(ready)
            try:
                done = ray.get(ready)
            except ray.exceptions.RayError as exc:
                error = f"worker failed {TASK_RETRIES + 1} times: {type(exc).__name__}"
                done = [(error_record(document.id, error, job.config_hash), None) for document in documents]
            for record, shard in done:
                log.append(record)
                if shard is not None:
                    Path(shard).unlink(missing_ok=True)
                outcome.count(record)
                progress(record)
            submit(actor)
    finally:
        progress.close()
    return outcome
