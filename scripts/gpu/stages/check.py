"""The check stage: nvidia-smi, the torch and CUDA versions, and `pytest -m gpu` over the test files that have
GPU tests, the ones most at risk first, under a session timeout a few seconds short of the stage's deadline.

Each test's outcome is written to check.json as it comes (the pytest_progress plugin's file, read every
2 s), so a stage killed at its deadline still says what ran; pytest stops starting tests at its session
timeout and writes its JUnit file (logs/check-junit.xml) before run.sh's `timeout` would kill it. The verdict
counts what ran: passed, failed, skipped, and not run for lack of time.
"""

from __future__ import annotations

import json
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from scripts.gpu.report import markdown_table
from scripts.gpu.stages.common import DEADLINE, ROOT, StageKilled, StageRun, machine_label, python_path_env
from scripts.gpu.stages.pytest_progress import PROGRESS_ENV

# The GPU tests most likely to fail on a card, run first: the fused kernels, the LoRA kernels under CUDA
# graphs, compilation with the Triton attention, the decode attention kernels (two of its tests failed on the
# H200). A file not named here follows, the shortest first where an earlier card run recorded durations.
RISK_FIRST = ("tests/test_fused.py", "tests/test_lora_kernels.py", "tests/test_lora.py", "tests/test_compiled.py",
              "tests/test_decode_attention.py")
# pytest ends itself this long before the stage's deadline (it stops between tests), and the stage sends it
# SIGTERM (a test still running is interrupted; the JUnit file is still written) this long before it.
SESSION_MARGIN_S = 12.0
STOP_MARGIN_S = 6.0


def gpu_test_files() -> list[str]:
    """The test files with `gpu`-marked tests (not `gpukit`, the kit's own dry run): a `@pytest.mark.gpu`
    decorator, a module's `pytestmark` or a parameter's `marks=` naming it (not a mention inside a string)."""
    marked = re.compile(r"^\s*(@pytest\.mark\.gpu\b|pytestmark\s*=.*\bpytest\.mark\.gpu\b)|marks=.*\bpytest\.mark\.gpu\b",
                        re.M)
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py") if marked.search(p.read_text()))


def recorded_durations(results_root: Path = ROOT / "docs" / "gpu-results") -> dict[str, float]:
    """Seconds per GPU test from the newest card run that recorded them (check.json `pytest.durations`)."""
    for path in sorted(results_root.glob("*/check.json"), reverse=True):
        try:
            durations = json.loads(path.read_text()).get("pytest", {}).get("durations")
        except (OSError, ValueError):
            continue
        if durations:
            return {str(k): float(v) for k, v in durations.items()}
    return {}


def ordered_test_files(files: list[str], durations: dict[str, float]) -> list[str]:
    """The files most at risk first (RISK_FIRST's order), then the rest, the shortest known first, unknown last.
    pytest keeps the command line's file order."""
    def known_seconds(file: str) -> float:
        seconds = [s for node, s in durations.items() if node.split("::", 1)[0] == file]
        return sum(seconds) if seconds else float("inf")

    risky = [f for f in RISK_FIRST if f in files]
    rest = sorted((f for f in files if f not in risky), key=lambda f: (known_seconds(f), f))
    return [*risky, *rest]


def has_session_timeout() -> bool:
    """pytest-timeout >= 2.3 has --session-timeout (the kit's wheels pin 2.4.0); an older one on the box's
    path would refuse it: the stage's own SIGTERM short of the deadline then ends the session instead."""
    import pytest_timeout

    return hasattr(pytest_timeout, "SESSION_TIMEOUT_KEY")


def pytest_command(files: list[str], *extra: str) -> tuple[list[str], dict[str, str]]:
    """`pytest -m gpu` as the check stage runs it. The box's own pytest plugins (benchmark, cov, xdist...)
    are not loaded: only pytest-timeout, which pyproject's `timeout` setting and `--session-timeout` need,
    and the kit's progress plugin."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "pytest_timeout", "-p",
           "scripts.gpu.stages.pytest_progress", "-p", "no:cacheprovider", *extra, *files]
    return cmd, {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", **python_path_env()}


def read_progress(path: Path) -> tuple[list[str] | None, dict[str, dict[str, Any]]]:
    """(collected node ids or None if collection never finished, {node id: outcome, seconds, message}) from the
    progress plugin's file. A test's outcome: failed if any phase failed, else skipped if one skipped, else
    passed once its call passed; a test still running has none yet and is left out."""
    collected: list[str] | None = None
    tests: dict[str, dict[str, Any]] = {}
    if not path.exists():
        return None, tests
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # the last line, cut by a kill
        if "collected" in record:
            collected = list(record["collected"])
            continue
        test = tests.setdefault(record["nodeid"], {"outcome": None, "seconds": 0.0, "message": ""})
        test["seconds"] = round(test["seconds"] + record["seconds"], 3)
        outcome = record["outcome"]
        if outcome == "failed" or (outcome == "skipped" and test["outcome"] != "failed") or (
                outcome == "passed" and test["outcome"] is None):
            test["outcome"] = outcome
            if record["message"]:
                test["message"] = record["message"]
    return collected, {k: v for k, v in tests.items() if v["outcome"] is not None}


def count_outcomes(collected: list[str] | None, tests: dict[str, dict[str, Any]]) -> dict[str, int]:
    counts = {kind: sum(t["outcome"] == kind for t in tests.values()) for kind in ("passed", "failed", "skipped")}
    counts["collected"] = len(collected) if collected is not None else len(tests)
    counts["not_run"] = max(0, counts["collected"] - len(tests))
    return counts


def check_verdict(counts: dict[str, int], exit_code: int, *, dry_run: bool) -> list[str]:
    """What makes the check stage fail, or partial. On a GPU box at least one GPU test must pass: every one
    skipping (pytest then exits 0) means CUDA was not seen. A dry run on a CPU skips them all by design.
    Tests not run for lack of time make the stage partial (a deadline), not failed."""
    problems = []
    ran = counts["passed"] + counts["failed"] + counts["skipped"]
    not_run = counts.get("not_run", 0)
    if counts["failed"]:
        problems.append(f"{counts['failed']} GPU test(s) failed")
    if ran + not_run == 0:
        problems.append("no GPU test was collected")
    elif not dry_run and ran and counts["passed"] == 0:
        problems.append(f"no GPU test passed ({counts['skipped']} skipped): the tests did not see the GPU")
    if not_run:
        problems.append(f"{not_run} of {ran + not_run} GPU test(s) not run: the stage's time ran out {DEADLINE}")
    # pytest exits 1 at its session timeout and 2 when interrupted (the stage's SIGTERM): the deadline's doing
    # when nothing failed and tests were left.
    stopped_for_time = bool(not_run) and not counts["failed"] and exit_code in (1, 2, 124)
    if not stopped_for_time and (exit_code not in (0, 5) or (exit_code == 5 and not problems)):
        problems.append(f"pytest exited {exit_code}")
    return problems


def junit_failures(path: Path) -> list[tuple[str, str]]:
    if not path.exists():
        return []
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError:
        return []
    out = []
    for case in root.iter("testcase"):
        for child in case:
            if child.tag in ("failure", "error"):
                out.append((f"{case.get('classname')}::{case.get('name')}", child.get("message") or ""))
    return out


def stage_check(run: StageRun, tests: list[str] | None = None) -> None:
    """`pytest -m gpu` over the GPU test files (or `tests`, node ids or files, when given), the riskiest first."""
    files = tests or ordered_test_files(gpu_test_files(), recorded_durations())
    junit = run.logs / "check-junit.xml"
    progress = run.work / "check-progress.jsonl"
    for stale in (junit, progress):
        stale.unlink(missing_ok=True)
    session_s = max(5, int(run.left() - SESSION_MARGIN_S)) if has_session_timeout() else None
    cmd, extra_env = pytest_command(files, f"--junitxml={junit}",
                                    *([f"--session-timeout={session_s}"] if session_s else []))
    summary: dict[str, Any] = {"files": files, "session_timeout_s": session_s, "junit": f"logs/{junit.name}",
                               "exit_code": None}
    run.data["pytest"] = summary

    def merge() -> None:
        collected, outcomes = read_progress(progress)
        counts = count_outcomes(collected, outcomes)
        failures = [(node, t["message"]) for node, t in outcomes.items() if t["outcome"] == "failed"]
        summary.update(counts, failures=failures, durations={k: t["seconds"] for k, t in outcomes.items()},
                       not_run_tests=[n for n in (collected or []) if n not in outcomes])
        render_check(run)
        run.save()

    def finish(exit_code: int) -> None:
        summary["exit_code"] = exit_code
        if junit.exists():  # its messages are pytest's own: kept beside the progress file's last lines
            summary["junit_failures"] = junit_failures(junit)
        for text in check_verdict(summary, exit_code, dry_run=run.dry_run):
            run.problem(text)
        render_check(run)
        run.data["complete"] = exit_code != 124 and not summary["not_run"]

    try:
        proc = run.run(cmd, log_name="check-pytest.log", reserve_s=STOP_MARGIN_S, on_progress=merge,
                       env={**extra_env, PROGRESS_ENV: str(progress)})
    except StageKilled:  # pytest had its SIGTERM too, and the seconds to write its JUnit file
        finish(124)
        raise
    finish(proc.returncode)


def render_check(run: StageRun) -> None:
    env, summary = run.data["env"], run.data["pytest"]
    rows = [["machine", machine_label(env)], ["torch / CUDA / cuDNN", f"{env['torch']} / {env['torch_cuda']} / "
                                                                     f"{env['cudnn']}"]]
    if env.get("nvidia_smi"):
        rows.append(["nvidia-smi (name, MiB, driver)", "; ".join(env["nvidia_smi"])])
    exit_code = summary.get("exit_code")
    rows.append(["pytest -m gpu", f"{summary.get('passed', 0)} passed, {summary.get('failed', 0)} failed, "
                                  f"{summary.get('skipped', 0)} skipped, {summary.get('not_run', 0)} not run of "
                                  f"{summary.get('collected', 0)} collected "
                                  + ("(running)" if exit_code is None else f"(exit {exit_code})")])
    rows += [[f"failed: {name}", message[:160].replace("\n", " ")] for name, message in summary.get("failures", [])]
    rows += [[f"not run: {name}", "the stage's time ran out"] for name in summary.get("not_run_tests", [])
             if exit_code is not None]
    run.table = markdown_table(["check", "result"], rows)
