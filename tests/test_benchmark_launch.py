"""The benchmark's server launch: `--server-cpus` pins the server and the processes it starts."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from orpheus_serve.benchmarking.cli import build_parser
from orpheus_serve.benchmarking.launch import LaunchedServer
from tests.gateway_support import wait_for


def test_cpu_list_parses_single_ranges_and_lists() -> None:
    parse = build_parser().parse_args
    assert parse(["--server-cpus", "0"]).server_cpus == (0,)
    assert parse(["--server-cpus", "3,0-2"]).server_cpus == (0, 1, 2, 3)
    assert parse([]).server_cpus is None
    json.dumps(parse(["--server-cpus", "0"]).server_cpus)  # the results file records the arguments
    with pytest.raises(SystemExit):
        parse(["--server-cpus", "one"])


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="CPU affinity is Linux-only")
def test_server_and_engine_core_run_on_the_pinned_cpu(tiny_orpheus: Path, tmp_path: Path) -> None:
    cpu = min(os.sched_getaffinity(0))
    settings = {
        "engine.backend": "sim", "engine.model_path": tiny_orpheus, "codec.decoder": "sim",
        "codec.path": tiny_orpheus.parent / "tiny-snac", "server.engine_process": "true",
    }
    with LaunchedServer([f"{k}={v}" for k, v in settings.items()], ready_timeout_s=120, cpus=(cpu,),
                        log_path=tmp_path / "server.log") as launched:
        assert launched.process is not None
        server = launched.process.pid
        # The engine core is a child process of the server (spawned before /ready).
        wait_for(lambda: bool(_children(server)), 30.0, "the engine-core process started")
        processes = [server, *_children(server)]
        assert {frozenset(os.sched_getaffinity(pid)) for pid in processes} == {frozenset({cpu})}


def _children(pid: int) -> list[int]:
    """Every descendant of `pid`, from /proc."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            out += [int(child), *_children(int(child))]
    return out
