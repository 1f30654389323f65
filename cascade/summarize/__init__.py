"""Summarization jobs over many long documents: ``python -m cascade.summarize``.

Every finished document is one JSON line appended to the output and flushed to disk, so a job that is
killed loses at most the document it was working on, and a rerun skips what is done.
"""
