"""The roofline script on random-weight shapes (the GPU session's cost-only figures), run small on CPU."""

from __future__ import annotations

import json
import subprocess
import sys


def test_roofline_times_every_pass_of_a_random_shape(tmp_path):
    out = tmp_path / "roofline.json"
    command = [sys.executable, "scripts/roofline.py", "--shape", "llama-68m", "--draft-shape", "llama-68m",
               "--contexts", "300", "--budget", "64", "--gamma", "3", "--draft-window", "28", "--repeats", "1",
               "--device", "cpu", "--kernels", "eager", "--out", str(out)]
    printed = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    report = json.loads(out.read_text())
    assert report["model"] == "llama-68m" and not report["graphs"]
    passes = report["contexts"][0]["passes"]
    assert list(passes) == ["full, 1 token (autoregressive step)", "retrieval 64, 1 token (proposal)",
                            "retrieval 64, 4 tokens (verifying the draft)", "full, 4 tokens (verification)",
                            "draft llama-68m, streaming 32, 1 token"]
    full_step, proposal = passes["full, 1 token (autoregressive step)"], passes["retrieval 64, 1 token (proposal)"]
    assert proposal["bytes_read"] < full_step["bytes_read"]  # 64 prompt tokens of KV instead of 300
    assert all(row["ms"] > 0 and row["roofline_ms"] > 0 for row in passes.values())
    assert "| 300 | draft llama-68m, streaming 32, 1 token |" in printed
