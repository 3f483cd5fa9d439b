#!/usr/bin/env python3
"""The card run's plan: which stages of the GPU proof kit each device call runs, and with what budget, from the
machine time a loan has left.

    python scripts/gpu/plan.py --left SECONDS --card h100|h200 [--start-s 90] [--warm] [--done STAGE,...]
    python scripts/gpu/plan.py ... --call-line N      # call N as run.sh reads it: BUDGET STAGE:FLOOR ...
    python scripts/gpu/plan.py --floors --card CARD STAGE...   # each stage's floor: STAGE:FLOOR ...
    python scripts/gpu/plan.py --pieces --card CARD           # every stage's pieces, and where each figure is from

A loan is machine time in all: the machine's start (30-90 s, unknown in advance: planned at --start-s), each
call's command, the transfers around it and the turn to the next call or to giving the machine back. One command
runs at most --per-call-limit-s (600) seconds; a call's budget (run.sh --budget) stays a reply margin under it.

Stages are taken in order of value (STAGE_ORDER), each at its planned time while that fits, else at what is left
if that is at least its floor (the least that gives a useful row), else dropped, and the plan says why. A stage
that fits in the call being filled goes there; one that does not opens the next call when that gives it more
time. A plan whose first stage does not fit is refused: no machine is worth starting for the rest.

Every figure below is the H200's (docs/gpu-results/2026-11-28-h200/, the first card run) or estimated from its
parts, and says which; `scale()` carries it to the card. `--done` leaves out stages already measured in this
loan, `--warm` plans on a machine already held (no start, models and wheels already there): the replan when
`status` shows a different time left before a later call (README.md).
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, field
from typing import Literal

Bound = Literal["wall", "host", "compute", "bandwidth"]

H200_RESULTS = "docs/gpu-results/2026-11-28-h200"

# Stages in order of value, which is also the order they run in. serve answers the first question (does
# the server hold what its engine carries), base is the engine's own answer to set beside it, check whether the
# GPU tests pass, codec and engine the codec's and the other variants' (fused, FP8, LoRA) figures. serve-even
# (the serve stage again with codec.ragged_steps=false) is worth less than check, codec and engine: the codec
# stage already sets even against ragged steps pass by pass in under a minute, serve-even only shows whether
# that choice moves the server's capacity, for at least three minutes. It comes before compiled, which measures
# a path the server does not run by default (engine.compile is off) behind a cold inductor compile no card run
# has timed yet: the least certain figure in the table, so it runs last, where running long costs nothing else.
STAGE_ORDER = ("serve", "base", "check", "codec", "engine", "serve-even", "compiled")


@dataclass(frozen=True)
class Card:
    """A card the kit runs on. Only memory bandwidth differs between the two for the kit's purposes: both are
    GH100 chips with the same SM count and clocks (the same ~990 TFLOP/s of dense bf16), on machines of the same
    shape (16 cores, 128 GiB); the H200 has HBM3e at 4.8 TB/s, the H100 (SXM) HBM3 at 3.35 TB/s."""

    name: str
    bandwidth_tb_s: float


CARDS = {"h200": Card("h200", 4.8), "h100": Card("h100", 3.35)}
MEASURED_ON = CARDS["h200"]


@dataclass(frozen=True)
class Piece:
    """Part of a stage's time on the H200. `bound` says what sets it: the clock (`wall`: ramps, timeouts,
    utterances played in real time), the host (`host`: interpreters, imports, disk, weights to the card),
    tensor-core math (`compute`: prefills, kernel builds), or memory bandwidth (`bandwidth`: measured decode
    steps, which read every weight and the KV cache once per step). `required`: part of the stage's floor."""

    name: str
    h200_s: float
    bound: Bound
    source: str
    required: bool = True
    estimated: bool = False

    def seconds(self, card: Card) -> float:
        return self.h200_s * scale(self.bound, card)


def scale(bound: Bound, card: Card) -> float:
    """How much longer a piece of `bound` takes on `card` than on the H200. Only bandwidth-bound pieces change
    (x1.43 on an H100: 4.8 / 3.35 TB/s): the 3B model's decode step reads its 6.15 GiB of weights and the KV
    cache every step, so it is as much slower as the memory is. Compute is the same chip's, the host the same
    machine shape's, and the clock is the clock: a serve level at its worst is ramp + queue timeout + two
    utterances, on any card (a slower card reaches saturation at fewer streams, so more levels run at their
    worst, which the plan already assumes for every level)."""
    return MEASURED_ON.bandwidth_tb_s / card.bandwidth_tb_s if bound == "bandwidth" else 1.0


@dataclass(frozen=True)
class StageCost:
    """A stage's pieces: its planned time is all of them, its floor the required ones."""

    name: str
    pieces: tuple[Piece, ...]
    note: str = ""

    def planned_s(self, card: Card) -> int:
        return math.ceil(sum(p.seconds(card) for p in self.pieces))

    def floor_s(self, card: Card) -> int:
        return math.ceil(sum(p.seconds(card) for p in self.pieces if p.required))

    @property
    def estimated(self) -> bool:
        return any(p.estimated for p in self.pieces)


# ----------------------------------------------------------------- the H200's figures

# serve: the kit's worst case for one level (stages/serve.py serve_level_worst_s): the 1 s ramp, a request's
# whole 30 s wait in the queue (scheduler.queue_timeout_s), its 280-token utterance (3.413 s of audio) at half
# real time, and 5 s of set-up. The H200's saturated levels took 62.5-65.5 s (serve.json rows[].wall_seconds)
# with two utterances per stream and a 2 s ramp, the same formula's 50.7 s plus the second request's own wait.
LEVEL_WORST_S = 1.0 + 30.0 + 2 * 3.413 + 5.0
LEVEL_SOURCE = (f"stages/serve.py serve_level_worst_s (1 s ramp + 30 s queue timeout + 2 x 3.413 s + 5 s); "
                f"{H200_RESULTS}/serve.json rows[].wall_seconds 62.5-65.5 s at two utterances per stream")
SERVER_START_S = 29.3  # serve.json server_start_s
SERVE_LEVELS = (16, 64, 128, 192, 256)  # stages/common.py REAL.serve_levels


def _serve_pieces() -> tuple[Piece, ...]:
    return (
        Piece("imports, GPU sampler, saves, server stops", 10.7, "host",
              f"{H200_RESULTS}/serve.json stage_seconds 343.8 less model 8.2 (serve.log), server start 29.3, "
              "warm-up 9.3 and the five levels' wall_seconds 286.3"),
        Piece("server start (weights, KV cache, 10 decode graphs)", SERVER_START_S, "host",
              f"{H200_RESULTS}/serve.json server_start_s"),
        Piece("warm-up level, 4 streams", 9.3, "wall", f"{H200_RESULTS}/serve.json warmup.wall_seconds 9.294"),
        Piece(f"level {SERVE_LEVELS[0]} at its worst", LEVEL_WORST_S, "wall", LEVEL_SOURCE),
        Piece("gate: a level starts with 10 s to spare", 10.0, "wall", "stages/serve.py (level + fixed row + 10 s)"),
        Piece(f"levels {', '.join(map(str, SERVE_LEVELS[1:]))} at their worst", LEVEL_WORST_S * (len(SERVE_LEVELS) - 1),
              "wall", LEVEL_SOURCE, required=False),
        Piece("profile round at the top level, at its worst, and its 10 s more gate", LEVEL_WORST_S + 10.0, "wall",
              "stages/serve.py serve_profile (needs level + fixed row + 20 s)", required=False),
        Piece("second server (admission=slots): start and one level at its worst", SERVER_START_S + LEVEL_WORST_S,
              "wall", f"{H200_RESULTS}/serve.json server_start_s + the level above"),
    )


# The engine bench, per engine (bench_engine.py --variants): its build (KV cache, 256 prefills of ~1,000 tokens,
# 9 graphs) and a profile of 5 steps at batch 1 and 256. Not logged apart on the H200: its engine stage built 7
# engines (4 SDPA configurations, 3 variants) with two weight loads, LoRA and the memory plans in 149.8 s
# (engine.json stage_seconds), about 12 s an engine with the rest.
ENGINE_BUILD_S = 12.0
ENGINE_BUILD_SOURCE = f"estimated: {H200_RESULTS}/engine.json stage_seconds 149.8 over 7 engines and the rest"
# The measured steps of one variant: warm-up 2 + 8 steps x 3 rounds at batch 1, 128 and 256, plus 5 profiled steps
# at 1 and 256, at the Triton rows' step ms (engine.json variants.rows: 5.23, 12.76, 19.97 ms).
VARIANT_STEPS_S = (26 * (5.23 + 12.76 + 19.97) + 5 * (5.23 + 19.97)) / 1000
VARIANT_STEPS_SOURCE = f"{H200_RESULTS}/engine.json variants.rows step_ms (triton) x 26 steps, 5 more profiled"
STAGE_START = Piece("stage start: imports, CUDA, the machine's environment", 5.0, "host",
                    "estimated (not logged apart on the H200)", estimated=True)
BENCH_START = Piece("bench_engine.py start (interpreter, torch)", 4.0, "host",
                    "estimated (not logged apart on the H200)", estimated=True)
WEIGHTS = Piece("3B weights to the card", 6.0, "host", f"{H200_RESULTS}/call2-logs.tar.gz engine-bench.log "
                "'weights loaded to cuda in 6.0 s'")


def _one_engine(name: str, *, required: bool = True) -> tuple[Piece, ...]:
    return (Piece(f"{name}: build, prefills, graphs, profile", ENGINE_BUILD_S, "compute", ENGINE_BUILD_SOURCE,
                  required=required, estimated=True),
            Piece(f"{name}: measured decode steps", VARIANT_STEPS_S, "bandwidth", VARIANT_STEPS_SOURCE,
                  required=required))


ENGINE_OTHERS = ("fp8kv", "fp8w", "fused+fp8kv", "fused+fp8w")  # after `fused`, the engine stage's first
GPU_TESTS_H200 = 24  # check.json pytest: 18 passed, 3 failed, 3 skipped
GPU_TESTS_NOW = 34  # `pytest -m gpu --collect-only` when this table was written
CHECK_S_PER_TEST = 45.8 / GPU_TESTS_H200  # check.json stage_seconds over its tests

STAGE_COSTS: dict[str, StageCost] = {
    "serve": StageCost("serve", _serve_pieces(), "all five levels, the profile round and the row with admission "
                                                  "at the slots, each level at its worst"),
    "serve-even": StageCost("serve-even", _serve_pieces(),
                            "the serve stage again with codec.ragged_steps=false: the same pieces"),
    "base": StageCost("base", (STAGE_START, BENCH_START, WEIGHTS, *_one_engine("base"),
                               Piece("the bench stops 10 s before the stage's deadline", 10.0, "wall",
                                     "stages/engine.py (deadline - 10 s without sub-steps)"))),
    "check": StageCost("check", (
        Piece("pytest start, collection, the risk-first files", 25.0, "host",
              "estimated: the first tests of stages/check.py RISK_FIRST", estimated=True),
        Piece(f"the other GPU tests ({GPU_TESTS_NOW} in all)", CHECK_S_PER_TEST * GPU_TESTS_NOW - 25.0, "compute",
              f"estimated: {H200_RESULTS}/check.json stage_seconds 45.8 for {GPU_TESTS_H200} tests, "
              f"x {GPU_TESTS_NOW}/{GPU_TESTS_H200}", required=False, estimated=True),
        Piece("pytest's session ends 12 s before the stage's deadline", 12.0, "wall",
              "stages/check.py SESSION_MARGIN_S"))),
    "codec": StageCost("codec", (
        Piece("SNAC load, graph capture, the first batch sizes", 25.0, "compute",
              "estimated: stages/codec.py stops starting batch sizes with 15 s left", estimated=True),
        Piece("the other batch sizes, SNR, overlap with the engine", 33.6 - 25.0, "compute",
              f"{H200_RESULTS}/codec.json stage_seconds 33.6 (graphs-on rows only)", required=False),
        Piece("graphs-off rows beside them, frames per replay, mixed passes", 15.0, "compute",
              "estimated: added to the stage after the H200 run", required=False, estimated=True))),
    "engine": StageCost("engine", (
        STAGE_START, BENCH_START, WEIGHTS, *_one_engine("fused"),
        *(piece for name in ENGINE_OTHERS for piece in _one_engine(name, required=False)),
        Piece("no variant starts in the 25 s before the sub-steps", 25.0, "wall", "stages/engine.py"),
        Piece("memory plan (slots that fit)", 2.0, "host", "estimated", estimated=True),
        Piece("LoRA rows lora0/lora8/lora32 (kept back for them)", 60.0, "compute",
              "stages/common.py lora_reserve_s; README.md: ~25-40 s with the adapters written"),
        Piece("GEMM shapes (kept back for them)", 15.0, "compute", "stages/common.py gemm_min_s; README.md: ~5 s"))),
    "compiled": StageCost("compiled", (
        STAGE_START, BENCH_START, WEIGHTS,
        Piece("cold inductor compile of the 3B decode (dynamic batch, per KV bucket)", 90.0, "compute",
              "estimated: no card run has compiled it yet", estimated=True),
        *_one_engine("compiled"),
        Piece("the bench stops 10 s before the stage's deadline", 10.0, "wall",
              "stages/engine.py (deadline - 10 s without sub-steps)"))),
}
assert set(STAGE_COSTS) == set(STAGE_ORDER)


@dataclass(frozen=True)
class LoanCosts:
    """Machine time outside the stages."""

    # Kept between a call's budget and the command's limit: run.sh's backstop (a stage still running at its
    # deadline gets TERM 5 s after it, KILL 10 s later) and the command's own start.
    reply_margin_s: int = 30
    # Around every call: the tree's upload (~14 MiB of wheels with it), the results' return and the turn to the
    # next call, or to giving the machine back after the last. A held machine goes back after 30 s idle, so the
    # next call must come at once; the H200 run's turn took 67 s (call1/call2 run.log), when machines stayed longer.
    between_calls_s: int = 40
    # A fresh machine's first call: the wheels installed (2 s, call1-logs run.log "2 s used") and the random models
    # written (8.2 s, call1-logs serve.log); kept while the machine is held.
    fresh_setup_s: int = 11
    # run.sh keeps this back in every call for the logs' archive.
    archive_s: int = 10


@dataclass
class PlannedStage:
    name: str
    given_s: int  # what the plan gives it: its planned time, or less down to its floor
    planned_s: int
    floor_s: int
    estimated: bool


@dataclass
class PlannedCall:
    number: int
    left_before_s: int  # machine time left when the call is asked for
    start_s: int  # the machine's start, in this call (the first on a fresh machine)
    setup_s: int
    archive_s: int
    stages: list[PlannedStage] = field(default_factory=list)

    @property
    def budget_s(self) -> int:
        return self.setup_s + sum(s.given_s for s in self.stages) + self.archive_s


@dataclass
class Dropped:
    name: str
    reason: str


@dataclass
class LoanPlan:
    card: Card
    machine_left_s: int
    start_s: int
    warm: bool
    per_call_limit_s: int
    costs: LoanCosts
    done: tuple[str, ...]
    calls: list[PlannedCall] = field(default_factory=list)
    dropped: list[Dropped] = field(default_factory=list)
    refused: str | None = None

    @property
    def call_limit_s(self) -> int:
        """The most one call's budget may be."""
        return self.per_call_limit_s - self.costs.reply_margin_s

    def machine_s(self, call: PlannedCall) -> int:
        """Machine time the call holds: its start, its budget, and the transfers and turn around it."""
        return call.start_s + call.budget_s + self.costs.between_calls_s

    @property
    def total_s(self) -> int:
        return sum(self.machine_s(c) for c in self.calls)

    def stages(self) -> list[str]:
        return [s.name for c in self.calls for s in c.stages]

    def command(self, call: PlannedCall) -> str:
        args = [f"--left {self.machine_left_s}", f"--card {self.card.name}"]
        args.append("--warm" if self.warm else f"--start-s {self.start_s}")
        if self.done:
            args.append(f"--done {','.join(self.done)}")
        return f"bash scripts/gpu/run.sh {' '.join(args)} --call {call.number}"

    def replan_command(self, call: PlannedCall) -> str:
        """Call `call` (after the first) as a replan from the time `status` shows then: the machine held, the
        stages of the calls before it measured."""
        done = [*self.done, *(s.name for c in self.calls[:call.number - 1] for s in c.stages)]
        return (f"bash scripts/gpu/run.sh --left LEFT --card {self.card.name} --warm --done {','.join(done)} "
                f"--call 1")

    def call_line(self, number: int) -> str:
        """Call `number` as run.sh reads it: its budget, then STAGE:FLOOR for each stage in order."""
        call = self.calls[number - 1]
        return " ".join([str(call.budget_s), *(f"{s.name}:{s.floor_s}" for s in call.stages)])

    def render(self) -> str:
        state = "a machine already held" if self.warm else f"a fresh machine, its start planned at {self.start_s} s"
        lines = [f"GPU loan plan: {self.card.name}, {self.machine_left_s} s of machine time left, {state}; "
                 f"calls of at most {self.call_limit_s} s ({self.per_call_limit_s} s per command less "
                 f"{self.costs.reply_margin_s} s), {self.costs.between_calls_s} s around each call"]
        if self.done:
            lines.append(f"already measured: {', '.join(self.done)}")
        if self.refused:
            lines.append(f"REFUSED: {self.refused}")
            return "\n".join(lines)
        for call in self.calls:
            start = f", machine start {call.start_s} s" if call.start_s else ""
            lines += ["", f"call {call.number}: budget {call.budget_s} s (run's timeout_s "
                          f"{call.budget_s + self.costs.reply_margin_s}), machine time {self.machine_s(call)} s"
                          f"{start}; {call.left_before_s} s left before it",
                      f"  {'stage':<12} {'given s':>8} {'planned s':>10} {'floor s':>8}"]
            if call.setup_s:
                lines.append(f"  {'(setup)':<12} {call.setup_s:>8}   wheels installed, models written")
            for s in call.stages:
                mark = "  estimated" if s.estimated else ""
                lines.append(f"  {s.name:<12} {s.given_s:>8} {s.planned_s:>10} {s.floor_s:>8}{mark}")
            lines += [f"  {'(logs)':<12} {call.archive_s:>8}   the logs' archive", f"  {self.command(call)}"]
            if call.number > 1:
                lines.append(f"  or, LEFT being status's budget_left_s then: {self.replan_command(call)}")
        lines.append("")
        for d in self.dropped:
            lines.append(f"dropped: {d.name}: {d.reason}")
        lines.append(f"total: {self.total_s} s of {self.machine_left_s} s in {len(self.calls)} call(s), "
                     f"{self.machine_left_s - self.total_s} s unplanned")
        return "\n".join(lines)


def plan_loan(machine_left_s: int, *, card: str | Card, start_s: int, warm: bool = False,
              per_call_limit_s: int = 600, done: tuple[str, ...] | list[str] = (),
              costs: LoanCosts | None = None, stage_costs: dict[str, StageCost] | None = None) -> LoanPlan:
    """The calls for the stages not in `done`, in STAGE_ORDER, inside `machine_left_s` (module docstring)."""
    card = CARDS[card] if isinstance(card, str) else card
    costs = costs or LoanCosts()
    stage_costs = stage_costs or STAGE_COSTS
    unknown = [s for s in done if s not in STAGE_ORDER]
    if unknown:
        raise ValueError(f"unknown stages {unknown}: {STAGE_ORDER}")
    plan = LoanPlan(card, machine_left_s, 0 if warm else start_s, warm, per_call_limit_s, costs, tuple(done))
    if plan.call_limit_s <= costs.archive_s + costs.fresh_setup_s:
        plan.refused = f"a call may take {plan.call_limit_s} s: too little for any stage"
        return plan
    todo = [s for s in STAGE_ORDER if s not in done]
    if not todo:
        plan.refused = "every stage is already measured"
        return plan

    def new_call(number: int, used_s: int) -> PlannedCall:
        first = number == 1
        return PlannedCall(number=number, left_before_s=machine_left_s - used_s,
                           start_s=plan.start_s if first else 0,
                           setup_s=costs.fresh_setup_s if first and not warm else 0, archive_s=costs.archive_s)

    def room(call: PlannedCall, used_before_s: int) -> int:
        """Seconds a stage could still be given in `call`, which starts after `used_before_s` of machine time."""
        by_limit = plan.call_limit_s - call.budget_s
        by_loan = machine_left_s - used_before_s - call.start_s - call.budget_s - costs.between_calls_s
        return min(by_limit, by_loan)

    used_s = 0  # machine time of the calls before the one being filled
    current: PlannedCall | None = None
    for name in todo:
        cost = stage_costs[name]
        planned, floor = cost.planned_s(card), cost.floor_s(card)
        here = room(current, used_s) if current else -1
        if here >= planned:
            target, given = current, planned
        else:
            after_s = used_s + (plan.machine_s(current) if current else 0)
            candidate = new_call(current.number + 1 if current else 1, after_s)
            there = room(candidate, after_s)
            if max(here, there) < floor:
                left = max(here, there, 0)
                reason = (f"its floor is {floor} s (planned {planned} s), {left} s of the loan left for it "
                          f"after the stages before it")
                if current is None:  # the most valuable stage left: nothing else is worth a machine
                    plan.refused = f"{name} does not fit: {reason}"
                    plan.dropped.clear()
                    return plan
                plan.dropped.append(Dropped(name, reason))
                continue
            if here >= floor and here >= min(planned, there):
                target, given = current, here
            else:
                if current is not None:
                    plan.calls.append(current)
                    used_s = after_s
                current = candidate
                target, given = candidate, min(planned, there)
        assert target is not None
        target.stages.append(PlannedStage(name, given, planned, floor, cost.estimated))
    if current is not None:
        plan.calls.append(current)
    return plan


def stage_floors(card: str | Card, stages: list[str]) -> str:
    """STAGE:FLOOR for each of `stages` (run.sh --budget keeps the later stages' floors back)."""
    card = CARDS[card] if isinstance(card, str) else card
    return " ".join(f"{s}:{STAGE_COSTS[s].floor_s(card)}" for s in stages)


def render_table(card: str | Card) -> str:
    """Every stage's pieces on `card`, with where each figure comes from."""
    card = CARDS[card] if isinstance(card, str) else card
    lines = []
    for name in STAGE_ORDER:
        cost = STAGE_COSTS[name]
        lines.append(f"{name}: planned {cost.planned_s(card)} s, floor {cost.floor_s(card)} s"
                     f"{' (estimated)' if cost.estimated else ''}{': ' + cost.note if cost.note else ''}")
        for p in cost.pieces:
            flags = ("" if p.required else "optional, ") + ("estimated, " if p.estimated else "") + p.bound
            lines.append(f"  {p.seconds(card):6.1f} s  {p.name} ({flags}): {p.source}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--left", type=int, help="machine time left (status: budget_left_s), seconds")
    ap.add_argument("--card", choices=sorted(CARDS), required=True)
    ap.add_argument("--start-s", type=int, default=90, help="the machine's start, planned (30-90 s)")
    ap.add_argument("--warm", action="store_true", help="a machine already held: no start, models kept")
    ap.add_argument("--done", default="", help="stages already measured in this loan, comma-separated")
    ap.add_argument("--per-call-limit-s", type=int, default=600)
    ap.add_argument("--call-line", type=int, metavar="N", help="print only call N as run.sh reads it")
    ap.add_argument("--floors", nargs="*", metavar="STAGE", help="print each stage's floor on the card")
    ap.add_argument("--pieces", action="store_true", help="print every stage's pieces and their sources")
    args = ap.parse_args(argv)
    if args.floors is not None:
        unknown = [s for s in args.floors if s not in STAGE_COSTS]
        if unknown:
            ap.error(f"unknown stages {unknown}")
        print(stage_floors(args.card, args.floors))
        return 0
    if args.pieces:
        print(render_table(args.card))
        return 0
    if args.left is None:
        ap.error("--left is required")
    done = [s for s in args.done.split(",") if s]
    try:
        plan = plan_loan(args.left, card=args.card, start_s=args.start_s, warm=args.warm,
                         per_call_limit_s=args.per_call_limit_s, done=done)
    except ValueError as exc:
        ap.error(str(exc))
    if args.call_line is None:
        print(plan.render())
    if plan.refused:
        print(f"plan refused: {plan.refused}", file=sys.stderr)
        return 3
    if args.call_line is not None:
        if not 1 <= args.call_line <= len(plan.calls):
            print(f"the plan has {len(plan.calls)} call(s), not a call {args.call_line}", file=sys.stderr)
            return 4
        print(plan.call_line(args.call_line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
