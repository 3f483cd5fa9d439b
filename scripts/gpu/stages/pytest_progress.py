"""A pytest plugin the check stage loads (`-p scripts.gpu.stages.pytest_progress`): each test's outcome is
appended to a JSON-lines file as soon as it is known, so the stage reports what ran even when pytest never
reaches its end; and SIGTERM (the stage's deadline) becomes a KeyboardInterrupt, which pytest ends like
Ctrl-C: the session finishes and the JUnit file is written.

The file (KIT_PYTEST_PROGRESS) holds one `{"collected": [node ids]}` line after collection, then one line
per report: node id, phase (setup, call, teardown), outcome, seconds, and a failure's first line.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest

PROGRESS_ENV = "KIT_PYTEST_PROGRESS"


def _append(record: dict[str, Any]) -> None:
    target = os.environ.get(PROGRESS_ENV)
    if target:
        with Path(target).open("a") as out:
            out.write(json.dumps(record) + "\n")


def _interrupt(signum: int, frame: object) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one interrupt: the session's end must not be cut again
    raise KeyboardInterrupt(f"signal {signum}: the check stage's deadline")


def pytest_configure(config: pytest.Config) -> None:
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)


def pytest_collection_finish(session: pytest.Session) -> None:
    _append({"collected": [item.nodeid for item in session.items]})


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" or report.outcome != "passed":  # a setup or teardown only when it did not pass
        message = ""
        if report.outcome == "failed":
            crash = getattr(report.longrepr, "reprcrash", None)  # the exception's own line, as JUnit has it
            lines = (report.longreprtext or "").strip().splitlines()
            message = (crash.message if crash is not None else lines[-1] if lines else "")[:300]
        elif report.outcome == "skipped" and isinstance(report.longrepr, tuple):
            message = str(report.longrepr[2])[:300]
        _append({"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
                 "seconds": round(report.duration, 3), "message": message})
