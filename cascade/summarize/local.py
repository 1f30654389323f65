"""The default backend: documents one after another in this process (``batch_size`` at a time)."""

from __future__ import annotations

import functools

from cascade.llm import LLM, with_kept_pass_costs
from cascade.summarize.job import Job, Outcome, Progress, pending_documents, records_for
from cascade.summarize.results import ResultLog
from cascade.summarize.summarizer import Summarizer


def summarizer_for(job: Job) -> Summarizer:
    llm = LLM.from_config(with_kept_pass_costs(job.config))
    return Summarizer(llm, job.template, job.config.max_new_tokens, job.batch_size)


def run_local(job: Job) -> Outcome:
    log = ResultLog(job.output)
    pending, skipped = pending_documents(job, log)
    outcome = Outcome(skipped=skipped)
    progress = Progress(len(pending), skipped, job.quiet)

    summarizer = functools.cache(lambda: summarizer_for(job))
    try:
        for first in range(0, len(pending), job.batch_size):
            for record in records_for(pending[first : first + job.batch_size], summarizer, job.config_hash):
                log.append(record)
                outcome.count(record)
                progress(record)
    finally:
        progress.close()
    return outcome
