"""scripts/bench_barge_in.py at its smallest: a real server, three barge-ins, both figures present and sane."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scripts.bench_barge_in import main


def test_bench_barge_in_prints_cancel_latency_in_ms_and_steps(tiny_models: Path, one_torch_thread: None,
                                                              tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                              ) -> None:
    out = tmp_path / "barge_in.json"
    assert main(["--barge-ins", "3", "--models", str(tiny_models), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "ms:    p50" in printed and "steps: p50" in printed and "target: p95 <= 1 engine step" in printed
    summary = json.loads(out.read_text())
    assert summary["barge_ins"] == 3 and summary["measured"] >= 1, summary
    assert 0 <= summary["latency_ms_p50"] <= summary["latency_ms_p95"] <= summary["latency_ms_max"]
    assert 0 <= summary["steps_p50"] <= summary["steps_p95"] <= summary["steps_max"]
    assert summary["step_ms_mean"] > 0
    for run in summary["runs"]:
        if run["measured"]:
            assert run["latency_ms"] >= 0 and run["steps"] >= 0 and run["frames"] > 0, run
