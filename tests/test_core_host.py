"""The engine core's host-time record (`core_host` in GET /v1/stats, core/host_time.py): a real server on the tiny
models, in one process and with the engine core in its own, and the benchmark runner's copy of it per level.
Also: an armed step profiler that fails does not stop the loop."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from orpheus_serve.benchmarking.runner import LoadSpec, Target, measure
from orpheus_serve.core.build import cpu_threads
from orpheus_serve.core.host_time import PHASES, prefill_ms_per_token
from tests.gateway_support import start_server, stats, tiny_config

STEP_FIELDS = {*PHASES, "total"}
RECORD_FIELDS = {"window_steps", "step_ms", "step_cpu_ms", "threads", "process_cpu_share", "intra_op_threads",
                 "interop_threads", "idle_cpu_share", "codec_pass", "prefill_ms_per_token"}


def _speak(server: Any, text: str = "Hello there, how are you today?") -> None:
    response = httpx.post(f"{server.base_url}/v1/audio/speech",
                          json={"input": text, "response_format": "pcm"}, timeout=60)
    assert response.status_code == 200 and response.content


def check_core_host(host: dict[str, Any], *, intra_op_threads: int) -> None:
    """Every field of the record, and what must hold of it after a few requests."""
    assert set(host) == RECORD_FIELDS, set(host) ^ RECORD_FIELDS
    assert host["window_steps"] > 0
    assert set(host["step_ms"]) == STEP_FIELDS
    for name, spread in host["step_ms"].items():
        assert set(spread) == {"p50", "p90", "mean"}, name
        assert 0 <= spread["p50"] <= spread["p90"] or spread["p90"] == pytest.approx(spread["p50"]), name
    # The phases cover the iteration: their means add up to the mean total (a ratio, not a time).
    phases_ms = sum(host["step_ms"][name]["mean"] for name in PHASES)
    assert phases_ms == pytest.approx(host["step_ms"]["total"]["mean"], rel=0.10)
    assert host["step_ms"]["total"]["mean"] > 0 and host["step_ms"]["launch"]["mean"] > 0
    assert host["step_ms"]["plan"]["mean"] > 0 and host["step_ms"]["output"]["mean"] > 0
    assert host["step_ms"]["codec_handoff"]["mean"] > 0
    assert set(host["step_cpu_ms"]) == {"p50", "mean"} and host["step_cpu_ms"]["mean"] > 0
    names = {t["name"]: t for t in host["threads"]}
    for thread in ("engine-core", "codec-worker"):
        assert names[thread]["cpu_s"] > 0, (thread, names)
        assert names[thread]["cpu_share"] >= 0 and names[thread]["tid"] > 0
    assert all(set(t) == {"name", "tid", "cpu_s", "cpu_share"} for t in host["threads"])
    assert host["process_cpu_share"] > 0
    assert host["intra_op_threads"] == intra_op_threads
    assert host["interop_threads"] >= 1
    assert host["idle_cpu_share"] is None or host["idle_cpu_share"] >= 0
    codec = host["codec_pass"]
    assert set(codec) == {"wall_ms_p50", "wall_ms_p90", "host_ms_p50", "frames_p50"}
    assert codec["frames_p50"] > 0 and codec["wall_ms_p50"] > 0 and codec["host_ms_p50"] > 0
    prefill = host["prefill_ms_per_token"]
    assert prefill is None or (isinstance(prefill, float) and prefill > 0), prefill


@pytest.mark.parametrize("engine_process", [False, True], ids=["in-process", "engine-process"])
def test_stats_and_each_benchmark_level_carry_the_core_host_record(tiny_orpheus: Path, tiny_snac: Path,
                                                                    engine_process: bool) -> None:
    config = tiny_config(tiny_orpheus, tiny_snac, **{"server.engine_process": engine_process})
    server = start_server(config)
    try:
        for _ in range(2):
            _speak(server)
        snapshot = stats(server)
        target = Target(server.base_url, server.grpc_address)
        row = measure(target, LoadSpec(requests=4, concurrency=2, protocol="rest", max_tokens=56))
        after = stats(server)
    finally:
        server.stop()
    # The core's torch threads: set by engine.cpu_threads where it runs; in this process, torch's own otherwise.
    threads = cpu_threads(config) or torch.get_num_threads()
    check_core_host(snapshot["core_host"], intra_op_threads=threads)
    check_core_host(after["core_host"], intra_op_threads=threads)
    # The loop waited with no session before the first request: what the process burned meanwhile is known.
    assert snapshot["core_host"]["idle_cpu_share"] is not None
    assert row["succeeded"] == 4
    check_core_host(row["core_host"], intra_op_threads=threads)
    assert row["core_host"]["window_steps"] > snapshot["core_host"]["window_steps"]


def test_prefill_cost_per_token_against_decode_steps_at_a_similar_batch() -> None:
    # period s, decode rows, prefill rows, prefill tokens: decode steps at 2 rows take 10 ms, at 8 rows 30 ms;
    # a step with 1 decode row and a 20-token prefill takes 14 ms (4 ms over its 2-row neighbours: 0.2 ms a
    # token), one with 7 decode rows and a 40-token prefill 42 ms (12 ms over the 8-row steps: 0.3 ms a token).
    plans = np.array([(0.010, 2, 0, 0), (0.010, 2, 0, 0), (0.030, 8, 0, 0), (0.030, 8, 0, 0),
                      (0.014, 1, 1, 20), (0.042, 7, 1, 40), (0.042, 7, 1, 40)])
    assert prefill_ms_per_token(plans) == pytest.approx(0.3)
    assert prefill_ms_per_token(plans[:5]) == pytest.approx(0.2)
    assert prefill_ms_per_token(plans[:4]) is None  # no prefill step yet
    assert prefill_ms_per_token(plans[4:]) is None  # no decode-only step to compare with
    assert prefill_ms_per_token(np.zeros((0, 4))) is None


def test_a_failing_step_profiler_is_recorded_as_a_failed_profile_and_the_server_serves_on(
        tiny_orpheus: Path, tiny_snac: Path, tmp_path: Path) -> None:
    folder = tmp_path / "profile"
    config = tiny_config(tiny_orpheus, tiny_snac, **{"server.engine_process": False,
                                                     "engine.profile_dir": str(folder)})
    server = start_server(config)
    result, arm = folder / "profile.json", folder / "arm"
    try:
        # The profiler's scratch file is taken by a folder: writing the profile fails once it is made.
        (folder / "profile.json.tmp").mkdir()
        arm.write_text("2 1")
        _speak(server)
        failed = json.loads(result.read_text())
        assert failed["status"] == "failed" and failed["stage"] == "finish", failed
        assert "IsADirectoryError" in failed["reason"]
        _speak(server, "And once more, after the failure.")
        # The way clear and armed again: a real profile this time.
        (folder / "profile.json.tmp").rmdir()
        arm.write_text("2 1")
        _speak(server, "A third request, profiled.")
        profile = json.loads(result.read_text())
        assert profile["steps"] == 2 and profile.get("status") != "failed", profile
        # The arm request cannot be read (a folder in its place): every step's start fails, until the loop gives
        # the profiler up; the requests are served all the same.
        arm.mkdir()
        _speak(server, "A fourth request, while the profiler fails at every step.")
        failed = json.loads(result.read_text())
        assert failed["status"] == "failed" and failed["stage"] == "start", failed
        _speak(server, "And a fifth.")
        assert stats(server)["engine"]["alive"]
    finally:
        server.stop()
