"""The card run's plan (scripts/gpu/plan.py) and run.sh's calls from it: a GPU loan is 15 minutes of machine time
in all, its start included, and no command may run past 10 minutes, so the plan has to fit both, put the most
valuable stages first, and say what it leaves out and why. Fast: no stage runs here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.gpu import plan as loan  # noqa: E402

RUN_SH = ROOT / "scripts" / "gpu" / "run.sh"
PLAN_PY = ROOT / "scripts" / "gpu" / "plan.py"
H200_RESULTS = ROOT / "docs" / "gpu-results" / "2026-11-28-h200"


def check_fits(plan: loan.LoanPlan) -> None:
    """The loan and the per-command limit hold the plan; every stage within its floor and planned time; stages in
    order of value; each call's budget its stages, the fresh machine's setup and the logs."""
    assert plan.refused is None, plan.refused
    assert plan.calls, "a plan that is not refused has a call"
    start = 0 if plan.warm else plan.start_s
    assert start + sum(c.budget_s + plan.costs.between_calls_s for c in plan.calls) == plan.total_s
    assert plan.total_s <= plan.machine_left_s
    for call in plan.calls:
        assert call.budget_s <= plan.per_call_limit_s - plan.costs.reply_margin_s, call
        assert call.budget_s == call.setup_s + sum(s.given_s for s in call.stages) + call.archive_s
        for stage in call.stages:
            assert stage.floor_s <= stage.given_s <= stage.planned_s, stage
    names = plan.stages()
    assert names == [s for s in loan.STAGE_ORDER if s in names], "stages run in order of value"
    assert sorted(names + [d.name for d in plan.dropped] + list(plan.done)) == sorted(loan.STAGE_ORDER)
    if "compiled" in names:
        assert names[-1] == "compiled"


def check_drops_are_forced(plan: loan.LoanPlan) -> None:
    """A stage is dropped only when it fits neither in the last call nor in one more call."""
    last = plan.calls[-1]
    unplanned = plan.machine_left_s - plan.total_s
    room_in_last = min(plan.per_call_limit_s - plan.costs.reply_margin_s - last.budget_s, unplanned)
    room_in_new = min(plan.per_call_limit_s - plan.costs.reply_margin_s,
                      unplanned - plan.costs.between_calls_s) - plan.costs.archive_s
    for dropped in plan.dropped:
        floor = loan.STAGE_COSTS[dropped.name].floor_s(plan.card)
        assert max(room_in_last, room_in_new) < floor, (dropped, room_in_last, room_in_new)
        assert f"its floor is {floor} s" in dropped.reason


@pytest.mark.parametrize("card", ["h100", "h200"])
def test_fifteen_minutes_with_a_90_s_start(card: str) -> None:
    """The loan a task draws: 900 s, a 90 s machine start. Serve (every level at its worst), the engine's base row
    and check take the first call; codec and the engine's variants (fused at least, LoRA, GEMM shapes) the second.
    serve-even and compiled do not fit at their floors in what is left, and the plan says so: a serve that keeps
    up ends call 1 early, and the replan before call 2 (README.md) gets them that time."""
    plan = loan.plan_loan(900, card=card, start_s=90)
    check_fits(plan)
    check_drops_are_forced(plan)
    assert plan.stages()[0] == "serve"
    assert [[s.name for s in c.stages] for c in plan.calls] == [["serve", "base", "check"], ["codec", "engine"]]
    assert [d.name for d in plan.dropped] == ["serve-even", "compiled"]
    serve = plan.calls[0].stages[0]
    assert serve.given_s == serve.planned_s  # the most valuable stage gets all of its worst case
    engine = plan.calls[1].stages[1]
    assert engine.floor_s <= engine.given_s < engine.planned_s  # fused, LoRA and GEMM; FP8 rows while time lasts
    assert plan.calls[0].start_s == 90 and plan.calls[0].setup_s > 0
    assert plan.calls[1].start_s == 0 and plan.calls[1].setup_s == 0  # the machine is held between calls
    assert plan.replan_command(plan.calls[1]) == (f"bash scripts/gpu/run.sh --left LEFT --card {card} --warm "
                                                  "--done serve,base,check --call 1")
    # The replan before call 2 with about three minutes more left than planned (serve ended that early) gives the
    # engine stage its planned time and takes up compiled.
    planned_left = plan.calls[1].left_before_s
    done = ["serve", "base", "check"]
    more = {"h100": 179, "h200": 177}[card]
    assert "compiled" not in loan.plan_loan(planned_left + more - 1, card=card, start_s=90, warm=True,
                                            done=done).stages()
    assert loan.plan_loan(planned_left + more, card=card, start_s=90, warm=True, done=done).stages() == \
        ["codec", "engine", "compiled"]


def test_a_longer_loan_holds_every_stage_with_compiled_last() -> None:
    plan = loan.plan_loan(2400, card="h100", start_s=90)
    check_fits(plan)
    assert plan.stages() == list(loan.STAGE_ORDER) and not plan.dropped
    assert all(s.given_s == s.planned_s for c in plan.calls for s in c.stages)
    assert plan.stages()[-1] == "compiled"


def test_every_call_stays_a_reply_margin_under_the_command_limit() -> None:
    """With a per-command limit under serve's worst case, serve's call is cut at the limit less the margin (the
    stage then runs fewer levels), and the rest go to later calls."""
    plan = loan.plan_loan(1200, card="h200", start_s=60, per_call_limit_s=400)
    check_fits(plan)
    first = plan.calls[0]
    assert first.budget_s == 400 - plan.costs.reply_margin_s
    assert [s.name for s in first.stages] == ["serve"] and first.stages[0].given_s < first.stages[0].planned_s
    assert "bash scripts/gpu/run.sh --left 1200 --card h200 --start-s 60 --call 1" in plan.render()
    assert f"run's timeout_s {first.budget_s + plan.costs.reply_margin_s})" in plan.render()


def test_a_short_loan_keeps_serve_and_drops_the_tail_in_order_of_value() -> None:
    plan = loan.plan_loan(500, card="h200", start_s=90)
    check_fits(plan)
    check_drops_are_forced(plan)
    assert plan.stages() == ["serve"] and len(plan.calls) == 1
    serve = plan.calls[0].stages[0]
    assert serve.floor_s <= serve.given_s < serve.planned_s  # fewer levels, still a useful row
    assert [d.name for d in plan.dropped] == list(loan.STAGE_ORDER[1:])


def test_a_loan_too_short_for_serve_is_refused() -> None:
    floor = loan.STAGE_COSTS["serve"].floor_s(loan.CARDS["h200"])
    plan = loan.plan_loan(300, card="h200", start_s=90)
    assert plan.refused is not None and plan.refused.startswith("serve does not fit")
    assert f"its floor is {floor} s" in plan.refused and not plan.calls
    assert "REFUSED: serve does not fit" in plan.render()


def test_a_replan_on_the_held_machine_leaves_out_what_was_measured() -> None:
    """Before a later call `status` tells the time left: the plan for the rest has no start and no setup."""
    plan = loan.plan_loan(330, card="h200", start_s=90, warm=True, done=["serve", "base"])
    check_fits(plan)
    check_drops_are_forced(plan)
    first = plan.calls[0]
    assert first.start_s == 0 and first.setup_s == 0
    assert plan.stages()[:3] == ["check", "codec", "engine"]
    assert plan.command(first) == "bash scripts/gpu/run.sh --left 330 --card h200 --warm --done serve,base --call 1"


def test_the_h100_is_slower_only_where_bandwidth_bounds_the_time() -> None:
    h100, h200 = loan.CARDS["h100"], loan.CARDS["h200"]
    assert loan.scale("bandwidth", h100) == pytest.approx(4.8 / 3.35)
    assert all(loan.scale(bound, h100) == 1.0 for bound in ("wall", "host", "compute"))
    for name, cost in loan.STAGE_COSTS.items():
        bandwidth = any(p.bound == "bandwidth" for p in cost.pieces)
        assert cost.planned_s(h100) >= cost.planned_s(h200), name
        if not bandwidth:  # serve's time is the clock's: levels, ramps, timeouts
            assert cost.planned_s(h100) == cost.planned_s(h200), name
    engine = loan.STAGE_COSTS["engine"]
    assert engine.planned_s(h100) > engine.planned_s(h200)


def test_the_figures_are_the_h200_runs_and_the_kits() -> None:
    """The table's measured figures match the files they cite, and its worst serve level the kit's own."""
    from orpheus_serve.config import SchedulerConfig
    from scripts.gpu.stages import common, serve

    serve_json = json.loads((H200_RESULTS / "serve.json").read_text())
    check_json = json.loads((H200_RESULTS / "check.json").read_text())
    codec_json = json.loads((H200_RESULTS / "codec.json").read_text())
    assert serve_json["server_start_s"] == loan.SERVER_START_S
    assert round(serve_json["warmup"]["wall_seconds"], 1) == 9.3
    parts = 8.2 + serve_json["server_start_s"] + serve_json["warmup"]["wall_seconds"] + sum(
        r["wall_seconds"] for r in serve_json["rows"])
    assert round(serve_json["stage_seconds"] - parts, 1) == loan.STAGE_COSTS["serve"].pieces[0].h200_s
    pytest_counts = check_json["pytest"]
    assert pytest_counts["passed"] + pytest_counts["failed"] + pytest_counts["skipped"] == loan.GPU_TESTS_H200
    assert pytest.approx(check_json["stage_seconds"]) == loan.CHECK_S_PER_TEST * loan.GPU_TESTS_H200
    assert codec_json["stage_seconds"] == 33.6
    shapes = common.REAL
    worst = serve.serve_level_worst_s(shapes, serve.expected_audio_s(shapes.serve_max_tokens),
                                      SchedulerConfig().queue_timeout_s)
    assert pytest.approx(worst, abs=0.01) == loan.LEVEL_WORST_S
    assert list(loan.SERVE_LEVELS) == shapes.serve_levels
    # The kit's own stage order is the plan's, serve-even (a second serve pass, not a stage of its own) aside.
    assert tuple(s for s in loan.STAGE_ORDER if s != "serve-even") == common.STAGES
    for cost in loan.STAGE_COSTS.values():
        for piece in cost.pieces:
            assert piece.source and (piece.estimated or "estimated" not in piece.source), piece


def test_the_readme_shows_the_plans_plan_py_makes() -> None:
    """scripts/gpu/README.md pastes the 900 s plans for both cards: they change with any figure in the table."""
    readme = (ROOT / "scripts" / "gpu" / "README.md").read_text()
    for card in ("h100", "h200"):
        assert loan.plan_loan(900, card=card, start_s=90).render() in readme, card


def run_sh(*args: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OUT": str(tmp_path / "out"), "KIT_WORK": str(tmp_path / "work"), "PYTHON": sys.executable}
    env.pop("KIT_WHEELS", None)
    return subprocess.run(["bash", str(RUN_SH), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)


def test_run_sh_refuses_a_loan_too_short_for_serve_and_runs_nothing(tmp_path: Path) -> None:
    proc = run_sh("--dry-run", "--left", "60", "--call", "1", tmp_path=tmp_path)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "plan refused: serve does not fit" in proc.stderr and "no call run" in proc.stderr
    assert "REFUSED" in proc.stdout and "===" not in proc.stdout  # no stage started
    assert not (tmp_path / "out").exists() and not (tmp_path / "work").exists()


@pytest.mark.parametrize(("card", "call"), [("h100", 1), ("h200", 2)])
def test_run_sh_prints_plan_py_s_plan_and_takes_its_call(tmp_path: Path, card: str, call: int) -> None:
    args = ["--left", "900", "--card", card, "--start-s", "90"]
    printed = subprocess.run([sys.executable, str(PLAN_PY), *args], capture_output=True, text=True, check=True).stdout
    proc = run_sh("--dry-run", *args, "--call", str(call), "--plan-only", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    plan = loan.plan_loan(900, card=card, start_s=90)
    taken = plan.calls[call - 1]
    assert proc.stdout == printed + (f"=== call {call} of the plan: budget {taken.budget_s} s, "
                                     f"stages {' '.join(s.name for s in taken.stages)}\n")
    assert f"{plan.command(taken)}\n" in printed
    missing = run_sh("--dry-run", *args, "--call", str(len(plan.calls) + 1), "--plan-only", tmp_path=tmp_path)
    assert missing.returncode == 4 and f"not a call {len(plan.calls) + 1}" in missing.stderr


def test_run_sh_keeps_plan_py_s_floors_back_for_later_stages(tmp_path: Path) -> None:
    """A call by hand too small for both stages: serve is skipped for base's floor (plan.py's for the card, not a
    figure of run.sh's own), and base for the logs' 10 s, so nothing runs."""
    floor = loan.STAGE_COSTS["base"].floor_s(loan.CARDS["h100"])
    proc = run_sh("--dry-run", "--budget", "25", "--card", "h100", "serve", "base", tmp_path=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    skipped = [line for line in proc.stdout.splitlines() if line.startswith("=== serve skipped: ")]
    assert len(skipped) == 1, proc.stdout
    left = int(skipped[0].split()[3])
    assert 25 - 10 - floor - 2 <= left <= 25 - 10 - floor, skipped  # a second or two for the plan's interpreter
    assert "=== base skipped" in proc.stdout and "kit.py" not in proc.stdout


def test_run_sh_rejects_mixed_modes_and_unknown_names(tmp_path: Path) -> None:
    for args in (["--left", "900", "serve"], ["--left", "900"], ["--call", "1", "serve"], ["--budget", "100",
                 "--left", "900", "--call", "1"], ["--left", "900", "--call", "1", "--card", "a100"],
                 ["--done", "serve", "check"], ["serve-odd"]):
        proc = run_sh(*args, "--dry-run", tmp_path=tmp_path)
        assert proc.returncode == 2 and "usage" in proc.stderr, args
    unknown = run_sh("--dry-run", "--left", "900", "--call", "1", "--done", "serve,bogus", tmp_path=tmp_path)
    assert unknown.returncode == 2 and "unknown stages" in unknown.stderr


@pytest.mark.gpukit  # about a minute and a half: a dry serve pass, with the kit's full dry run
@pytest.mark.timeout(400)
def test_a_replanned_call_runs_serve_even_as_a_second_serve_pass(tmp_path: Path) -> None:
    """The plan's call end to end on the CPU: serve-even is the serve stage with even codec steps, in its own file
    and logs; compiled does not fit behind it and is not run."""
    args = ["--left", "240", "--card", "h100", "--warm", "--done", "serve,base,check,codec,engine", "--call", "1"]
    plan = loan.plan_loan(240, card="h100", start_s=90, warm=True, done=args[6].split(","))
    assert plan.stages() == ["serve-even"] and [d.name for d in plan.dropped] == ["compiled"]
    env = {**os.environ, "OUT": str(tmp_path / "out"), "KIT_WORK": str(tmp_path / "work"), "PYTHON": sys.executable}
    env.pop("KIT_WHEELS", None)
    proc = subprocess.run(["bash", str(RUN_SH), "--dry-run", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=360)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert f"=== call 1 of the plan: budget {plan.calls[0].budget_s} s, stages serve-even" in proc.stdout
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["logs-serve-even.tar.gz", "serve-even.json"]
    data = json.loads((tmp_path / "out" / "serve-even.json").read_text())
    assert data["stage"] == "serve" and data["ok"] and data["extra_overrides"] == ["codec.ragged_steps=false"]
    assert "codec.ragged_steps=false" in data["overrides"]
    listing = subprocess.run(["tar", "-tzf", str(tmp_path / "out" / "logs-serve-even.tar.gz")], capture_output=True,
                             text=True).stdout
    assert "logs/serve-even.log" in listing and "logs/run.log" in listing
