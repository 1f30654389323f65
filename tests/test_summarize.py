"""Summarization jobs: inputs, the result log, long-document strategies, resume after SIGKILL, Ray."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from cascade.summarize.__main__ import main as summarize_main
from cascade.summarize.documents import read_inputs
from cascade.summarize.job import Job, pending_documents
from cascade.summarize.local import summarizer_for
from cascade.summarize.prompts import DEFAULT_TEMPLATE
from cascade.summarize.results import ResultLog
from configs import load_config

REPO = Path(__file__).resolve().parents[1]


def tiny_settings(tiny_dir: Path, max_context: int = 512, max_new: int = 8) -> list[str]:
    return [
        "--preset",
        "autoregressive",
        "--set",
        f"target.path={tiny_dir}",
        "--set",
        f"max_context={max_context}",
        "--max-new-tokens",
        str(max_new),
        "--quiet",
    ]


def ids_in(output: Path) -> Counter:
    return Counter(json.loads(line)["id"] for line in output.read_text().splitlines())


@pytest.fixture
def inputs(tmp_path) -> Path:
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "a.txt").write_text("The cat sat on the mat. It was a sunny day.\n")
    (folder / "b.txt").write_bytes(b"\xff\xfe not utf-8")
    (folder / "c.txt").write_text("  \n")
    lines = [
        json.dumps({"id": "long", "text": "word " * 2000}),
        "not json",
        json.dumps({"id": "short", "text": "A short text."}),
        json.dumps({"text": "no id"}),
        json.dumps({"id": "short", "text": "the same id again"}),
    ]
    (folder / "more.jsonl").write_text("\n".join(lines) + "\n")
    return folder


# ---- inputs and the result log ------------------------------------------------------------------


def test_inputs_become_documents_or_specific_errors(inputs):
    documents = {document.id: document for document in read_inputs([inputs])}
    assert documents[str(inputs / "a.txt")].text.startswith("The cat")
    assert documents[str(inputs / "b.txt")].error == "not UTF-8 text: undecodable byte at offset 0"
    assert documents[str(inputs / "c.txt")].error == "the document is empty"
    assert documents[f"{inputs / 'more.jsonl'}:2"].error.startswith("not a JSON line")
    assert documents[f"{inputs / 'more.jsonl'}:4"].error.startswith('a JSONL line must be an object with "id"')
    missing = next(read_inputs([inputs / "nope.txt"]))
    assert missing.error.startswith("cannot read") and "nope.txt" in missing.error


def test_a_repeated_id_is_an_error_not_a_second_summary(inputs, tiny_dir, tmp_path):
    _, config = load_config("autoregressive")
    job = Job((inputs,), tmp_path / "out.jsonl", config, DEFAULT_TEMPLATE)
    pending, skipped = pending_documents(job, ResultLog(job.output))
    repeated = [document for document in pending if document.id == "short"]
    assert skipped == 0 and [document.error for document in repeated] == [
        None,
        "duplicate id: an earlier input has the same id",
    ]


def test_a_torn_last_line_is_removed_and_done_ids_follow_the_config_hash(tmp_path):
    output = tmp_path / "out.jsonl"
    output.write_text(
        json.dumps({"id": "a", "summary": "s", "stats": {"config_hash": "h1"}})
        + "\n"
        + json.dumps({"id": "b", "error": "e", "stats": {"config_hash": "h1"}})
        + "\n"
        + '{"id": "c", "summ'
    )  # killed mid-write
    log = ResultLog(output)
    assert output.read_text().endswith("}\n") and len(log.records()) == 2
    assert log.done("h1") == {"a"} and log.done("h2") == set()  # errors are retried; other configs redone
    log.append({"id": "c", "summary": "t", "stats": {"config_hash": "h1"}})
    assert log.done("h1") == {"a", "c"}


NOT_A_LOG = ' is not a result log: line 1 is not a JSON object with an "id"; give another --output'
RECORD = json.dumps({"id": "a", "summary": "s", "stats": {"config_hash": "h1"}})


@pytest.mark.parametrize(
    "content, message",
    [
        (b"line one\nline two", NOT_A_LOG),  # a last line without newline: never cut unless the file is a log
        (b'{"settings": 1}', " is not a result log: line 1 has no newline at its end and is not a record cut short"),
        (
            f"{RECORD}\n{RECORD[:20]}\n{RECORD}\n".encode(),
            ':2 is not a JSON object with an "id", so the result log is damaged; fix or delete that line, or give',
        ),
        (f"{RECORD}\n\0\0\0\n{RECORD}\n{RECORD[:20]}".encode(), ':2 is not a JSON object with an "id"'),
    ],
)
def test_a_file_that_is_not_an_intact_result_log_is_refused_as_it_is(tmp_path, capsys, content, message):
    output = tmp_path / "notes.txt"
    output.write_bytes(content)
    assert summarize_main([str(tmp_path / "nope.txt"), "--output", str(output), "--preset", "autoregressive"]) == 2
    assert f"error: {output}{message}" in capsys.readouterr().err
    assert output.read_bytes() == content


def test_a_record_with_unicode_line_separators_reads_back_whole(tmp_path):
    log = ResultLog(tmp_path / "out.jsonl")
    record = {"id": "a", "summary": "one\u2028two\x85three", "stats": {"config_hash": "h1"}}
    log.append(record)
    assert ResultLog(log.path).records() == [record]


def test_an_output_that_cannot_be_appended_to_is_refused_before_any_model_loads(tmp_path, capsys, monkeypatch):
    document = tmp_path / "a.txt"
    document.write_text("The cat sat on the mat.")
    monkeypatch.setattr("cascade.summarize.local.summarizer_for", lambda job: pytest.fail("a model was loaded"))
    outputs = {
        tmp_path: "is a directory; give a file path",
        document / "out.jsonl": f"cannot create the folder {document} for {document / 'out.jsonl'}",
    }
    if Path("/proc/self").is_dir():
        outputs[Path("/proc/out.jsonl")] = "cannot append to /proc/out.jsonl: No such file or directory"
    for output, message in outputs.items():
        assert summarize_main([str(document), "--output", str(output), "--preset", "autoregressive"]) == 2
        assert message in capsys.readouterr().err


# ---- jobs ---------------------------------------------------------------------------------------


def test_a_job_summarizes_good_documents_reports_bad_ones_and_skips_them_next_time(inputs, tiny_dir, tmp_path, capsys):
    output = tmp_path / "out.jsonl"
    assert summarize_main([str(inputs), "--output", str(output), *tiny_settings(tiny_dir)]) == 1  # some failed
    lines = [json.loads(line) for line in output.read_text().splitlines()]
    assert len(lines) == 8 and sum("summary" in record for record in lines) == 3
    long = next(record for record in lines if record["id"] == "long")
    assert long["note"].startswith("truncated: kept the first") and long["stats"]["dropped_tokens"] > 1000
    assert long["stats"]["prompt_tokens"] + 8 <= 512 and long["stats"]["new_tokens"] == 8
    assert set(long["stats"]) >= {"prompt_tokens", "new_tokens", "tokens_per_s", "acceptance", "config_hash"}

    assert summarize_main([str(inputs), "--output", str(output), *tiny_settings(tiny_dir)]) == 1
    assert "0 summarized, 5 failed, 3 already done" in capsys.readouterr().err
    assert summarize_main([str(inputs / "a.txt"), "--output", str(output), *tiny_settings(tiny_dir, max_new=6)]) == 0
    assert ids_in(output)[str(inputs / "a.txt")] == 2  # another config: summarized again


def test_map_reduce_summarizes_parts_then_their_summaries(tiny_dir, tmp_path):
    document = tmp_path / "long.txt"
    document.write_text("word " * 1499 + "word")  # 1500 tokens
    output = tmp_path / "out.jsonl"
    settings = [
        *tiny_settings(tiny_dir, max_context=400),
        "--set",
        "long_documents.strategy=map_reduce",
        "--set",
        "long_documents.chunk_tokens=300",
    ]
    assert summarize_main([str(document), "--output", str(output), *settings]) == 0
    record = json.loads(output.read_text())
    assert record["note"] == "map-reduce: 5 parts of up to 300 tokens"
    assert record["stats"]["generations"] == 6 and record["stats"]["new_tokens"] == 6 * 8


def without_timings(output: Path) -> list[dict]:
    """The records of ``output`` without what differs from run to run (times)."""
    kept = []
    for line in output.read_text().splitlines():
        record = json.loads(line)
        record["stats"] = {k: v for k, v in record["stats"].items() if not k.endswith("_s") and k != "tokens_per_s"}
        kept.append(record)
    return kept


@pytest.mark.parametrize("strategy", ["truncate", "map_reduce"])
def test_a_batched_job_writes_what_one_document_at_a_time_writes(inputs, tiny_dir, tmp_path, strategy):
    """Documents (good, unreadable, too long) three at a time, their generations decoded together:
    the same lines, in the same order, as one document at a time."""
    settings = [*tiny_settings(tiny_dir), "--set", f"long_documents.strategy={strategy}"]
    alone, together = tmp_path / "alone.jsonl", tmp_path / "together.jsonl"
    assert summarize_main([str(inputs), "--output", str(alone), *settings]) == 1
    assert summarize_main([str(inputs), "--output", str(together), *settings, "--batch-size", "3"]) == 1
    assert without_timings(together) == without_timings(alone)
    assert sum("summary" in record for record in without_timings(together)) == 3


def test_a_template_without_the_placeholder_is_refused(tiny_dir, tmp_path, capsys):
    template = tmp_path / "t.txt"
    template.write_text("Summarize:")
    assert (
        summarize_main(
            [
                str(tmp_path),
                "--output",
                str(tmp_path / "o.jsonl"),
                "--template",
                str(template),
                *tiny_settings(tiny_dir),
            ]
        )
        == 2
    )
    assert "must contain {document} exactly once (found 0)" in capsys.readouterr().err


def test_zero_new_tokens_reaches_the_config_check(tiny_dir, tmp_path, capsys):
    settings = [*tiny_settings(tiny_dir), "--max-new-tokens", "0"]  # the last --max-new-tokens counts
    assert summarize_main([str(tmp_path), "--output", str(tmp_path / "o.jsonl"), *settings]) == 2
    assert "max_new_tokens: Input should be greater than or equal to 1" in capsys.readouterr().err


@pytest.mark.parametrize(
    "workers, message",
    [
        ("0", "must be at least 1, not 0"),
        ("-1", "must be at least 1, not -1"),
        ("two", "'two' is not a whole number"),
    ],
)
def test_fewer_than_one_ray_worker_is_refused(tmp_path, capsys, workers, message):
    with pytest.raises(SystemExit) as exit_info:
        summarize_main([str(tmp_path), "--output", str(tmp_path / "o.jsonl"), "--backend", "ray", "--workers", workers])
    assert exit_info.value.code == 2 and f"argument --workers: {message}" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--batch-size", "0"], "argument --batch-size: must be at least 1, not 0"),
    ],
)
def test_a_batch_size_the_job_cannot_run_is_refused(tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as exit_info:
        summarize_main([str(tmp_path), "--output", str(tmp_path / "o.jsonl"), *flags])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def start_six_documents(tiny_dir: Path, tmp_path: Path, **popen) -> tuple[list[str], Path, Path, subprocess.Popen]:
    """Six documents being summarized in a subprocess that has just finished its first one."""
    folder = tmp_path / "docs"
    folder.mkdir()
    for index in range(6):
        (folder / f"doc{index}.txt").write_text(f"Document number {index}. " * 40)
    output = tmp_path / "out.jsonl"
    command = [
        sys.executable,
        "-m",
        "cascade.summarize",
        str(folder),
        "--output",
        str(output),
        *tiny_settings(tiny_dir, max_new=48),
    ]
    job = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, **popen)
    deadline = time.monotonic() + 600  # a process start, a compile and a document: minutes on a loaded machine
    while not (output.exists() and output.read_text().count("\n")) and job.poll() is None:
        assert time.monotonic() < deadline, "the job finished no document in 10 minutes"
        time.sleep(0.05)
    return command, folder, output, job


def test_a_job_interrupted_by_ctrl_c_says_how_to_resume_and_keeps_every_line(tiny_dir, tmp_path):
    def sigint_as_from_a_terminal():  # even if pytest's is ignored
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    command, folder, output, job = start_six_documents(
        tiny_dir, tmp_path, stderr=subprocess.PIPE, text=True, preexec_fn=sigint_as_from_a_terminal
    )
    job.send_signal(signal.SIGINT)
    stderr = job.communicate(timeout=60)[1]
    finished = output.read_text().count("\n")
    assert job.returncode == 130 and "Traceback" not in stderr
    assert stderr.rstrip().endswith(
        f"cascade.summarize: interrupted; {finished} documents are in {output}, rerun the same command to resume"
    )
    assert 1 <= finished < 6 and output.read_text().endswith("\n")

    assert subprocess.run(command, cwd=REPO, capture_output=True).returncode == 0
    assert ids_in(output) == Counter({str(folder / f"doc{index}.txt"): 1 for index in range(6)})


def test_a_job_killed_mid_document_resumes_with_every_document_exactly_once(tiny_dir, tmp_path):
    command, folder, output, job = start_six_documents(tiny_dir, tmp_path, stderr=subprocess.DEVNULL)
    os.kill(job.pid, signal.SIGKILL)
    job.wait()
    finished_before = output.read_text().count("\n")
    assert 1 <= finished_before < 6, "the kill should land while documents remain"
    assert output.read_text().endswith("\n")

    assert subprocess.run(command, cwd=REPO, capture_output=True).returncode == 0
    assert ids_in(output) == Counter({str(folder / f"doc{index}.txt"): 1 for index in range(6)})


# ---- the Ray backend ----------------------------------------------------------------------------


CRASH_MARKER_ENV = "CASCADE_TEST_CRASH_MARKER"


def crashing_once_summarizer(job: Job):
    """A worker that dies (as if killed) the first time it meets the document named crash.txt."""
    summarizer = summarizer_for(job)
    summarize_many = summarizer.summarize_many

    def maybe_crash(texts: list[str]):
        marker = Path(os.environ[CRASH_MARKER_ENV])
        if any("CRASH HERE" in text for text in texts) and not marker.exists():
            marker.touch()
            os._exit(1)
        return summarize_many(texts)

    summarizer.summarize_many = maybe_crash
    return summarizer


@pytest.mark.slow
@pytest.mark.parametrize("batch_size", [1, 3])
def test_ray_backend_on_two_workers_retries_a_killed_workers_document(tiny_dir, tmp_path, monkeypatch, batch_size):
    """One document per call, or three (a group is retried whole: the killed worker's others too)."""
    ray = pytest.importorskip("ray")
    from cascade.summarize.distributed import run_ray

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import this test module

    folder = tmp_path / "docs"
    folder.mkdir()
    for index in range(5):
        (folder / f"doc{index}.txt").write_text(f"Document {index}. " * 20)
    (folder / "crash.txt").write_text("CRASH HERE. " * 20)
    (folder / "empty.txt").write_text("")
    monkeypatch.setenv(CRASH_MARKER_ENV, str(tmp_path / "crashed"))
    _, config = load_config(
        "autoregressive", settings={"target.path": str(tiny_dir), "max_context": 512, "max_new_tokens": 8}
    )
    job = Job((folder,), tmp_path / "out.jsonl", config, DEFAULT_TEMPLATE, quiet=True, batch_size=batch_size)
    outcome = run_ray(job, workers=2, make_summarizer=crashing_once_summarizer)

    assert (tmp_path / "crashed").exists()  # a worker really died
    assert (outcome.summarized, outcome.failed) == (6, 1)
    records = [json.loads(line) for line in job.output.read_text().splitlines()]
    assert Counter(record["id"] for record in records) == Counter({str(path): 1 for path in folder.iterdir()})
    assert not list((tmp_path / "out.jsonl.shards").glob("*.json"))  # merged and cleaned up
