"""How fast this machine runs a fixed piece of torch work right now, for tests that wait on time.

A test that waits on time (a drain window, a first-audio deadline, "freed within a second") states its window
as it holds on the reference machine: two idle cores, the CPU the suite's windows were written on. `MachinePace`
stretches it by how much slower this machine ran the same work just now, up to `MAX_SLOWNESS`.

The work is a fixed workload of its own (`workload_round`), never the code under test: were the calibration the
engine's own steps, an engine that got slower would raise its own pace and widen the very windows meant to catch
it. It has the shape of the tiny model's decode, the step a gateway test's server takes most often: four
sessions' 64-wide hidden states through an output projection (a matmul), a softmax over the outputs, and the
probabilities back through the projection to the next step's state (a second matmul), `STEPS` times. Timing
torch work rather than reading the load average counts what a test's server feels: other processes on the cores,
a slower CPU, a throttled container, all at once.

Measured afresh for each test module that asks (the `pace` fixture in conftest.py; a calibration takes about a
quarter of a second on the reference machine), so load that comes and goes during a run is seen; pytest prints
the samples' spread at the end and records each in the JUnit report. A faster machine keeps the reference window
(the pace never goes below 1). Above `MAX_SLOWNESS` a window is not stretched further: the timing check fails
with "machine too slow for timing checks", since a window stretched without bound can no longer fail, and a
check that cannot fail says nothing. One slow calibration is measured again before that (`measure`): a single
burst from another process should not fail a module.

The reference (`REFERENCE_ROUND_S`, 35 ms): `python -m tests.pace --runs 8` (each run: one warm-up round, then
the median of `ROUNDS` rounds) on the idle 2-core reference machine (AMD EPYC, torch 2.13.0 CPU build, one torch
thread as tests/conftest.py sets; load average 0.4 before it started, nothing else running): run medians
33.9-43.0 ms, 34.9 ms their median (the first run 43 ms, the other seven 33.9-36.7). The same command beside
other work on those cores gave 34-38 ms at a load average of 1.2-1.7 and medians of about 72 ms at 3.7.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import pytest
import torch

# Seconds one `workload_round` takes on the reference machine, idle, one torch thread: see the module docstring.
REFERENCE_ROUND_S = 0.035
# Past 4x the reference a window holds nothing the reference machine would fail: a test's 1 s "at once" is 4 s.
MAX_SLOWNESS = 4.0
TOO_SLOW = "machine too slow for timing checks"

SESSIONS = 4  # the gateway test servers' batch (tests/gateway_support.py: max_batch_size 4)
HIDDEN = 64  # the tiny model's hidden size (orpheus_serve.weights.tiny, not imported: see the docstring)
OUTPUTS = 32_768  # the projection's width: the size the round's time scales with
STEPS = 28  # four frames of audio per session
ROUNDS = 5
THREADS = 1  # as tests/conftest.py sets for the whole run and the servers it starts


@dataclass(frozen=True, slots=True)
class MachinePace:
    """`slowness`: this machine's time for the calibration over the reference machine's, never below 1. Read it
    through `stretch` or `window`, which enforce the cap."""

    slowness: float
    measured_round_s: float

    def stretch(self) -> float:
        """The factor windows stretch by; fails the calling test above `MAX_SLOWNESS` instead of widening."""
        if self.slowness > MAX_SLOWNESS:
            # pytest.fail, not an AssertionError: it is a BaseException, so a retry loop's `except Exception`
            # cannot swallow it, and the test fails where it asked for a window.
            pytest.fail(f"{TOO_SLOW}: {self} (cap {MAX_SLOWNESS:g}x)", pytrace=False)
        return self.slowness

    def window(self, reference_s: float) -> float:
        """A time window that holds on the reference machine, stretched to this one."""
        return reference_s * self.stretch()

    def __str__(self) -> str:
        return (f"machine pace: {self.slowness:.2f}x the reference (a calibration round took "
                f"{self.measured_round_s * 1000:.0f} ms, reference {REFERENCE_ROUND_S * 1000:.0f} ms)")


def workload(outputs: int = OUTPUTS, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The calibration's tensors: a (HIDDEN, outputs) projection and SESSIONS hidden states (fp32, CPU)."""
    generator = torch.Generator().manual_seed(seed)
    projection = torch.randn(HIDDEN, outputs, generator=generator) * HIDDEN ** -0.5
    return projection, torch.randn(SESSIONS, HIDDEN, generator=generator)


def workload_round(projection: torch.Tensor, hidden: torch.Tensor, steps: int = STEPS) -> float:
    """`steps` steps of matmul, softmax, matmul back; seconds taken. Each step needs the last one's result, as
    decoding does, so no step can be skipped or overlapped."""
    started = time.perf_counter()
    for _ in range(steps):
        probabilities = torch.softmax(hidden @ projection, dim=-1)
        hidden = probabilities @ projection.T
    return time.perf_counter() - started


def calibrate(rounds: int = ROUNDS) -> MachinePace:
    """Time `rounds` workload rounds (after one warm-up round) with the torch threads a server gets."""
    previous = torch.get_num_threads()
    torch.set_num_threads(THREADS)  # a module may have changed it; the reference was measured with THREADS
    try:
        projection, hidden = workload()
        workload_round(projection, hidden)
        # The median, not the best: a server under test lives through the machine's load, not its best moments.
        measured = statistics.median(workload_round(projection, hidden) for _ in range(rounds))
    finally:
        torch.set_num_threads(previous)
    return MachinePace(slowness=max(1.0, measured / REFERENCE_ROUND_S), measured_round_s=measured)


def measure() -> MachinePace:
    """`calibrate`, and once more if that came out over the cap: a single burst of someone else's work should not
    fail a module's timing checks, but a machine that stays too slow should. The second measurement stands."""
    measured = calibrate()
    if measured.slowness > MAX_SLOWNESS:
        measured = calibrate()
    return measured


def main(argv: list[str] | None = None) -> None:
    """`python -m tests.pace [--runs N]`: calibrate N times and print each run and the lowest (to set
    REFERENCE_ROUND_S, run it on the reference machine while it is as idle as it gets; check `uptime` first)."""
    import argparse
    import os

    parser = argparse.ArgumentParser(prog="python -m tests.pace", description=main.__doc__)
    parser.add_argument("--runs", type=int, default=5, help="calibrations to run (default 5)")
    args = parser.parse_args(argv)
    medians = []
    for run in range(args.runs):
        load = ", ".join(f"{avg:.2f}" for avg in os.getloadavg())
        pace = calibrate()
        medians.append(pace.measured_round_s)
        print(f"run {run + 1}: median of {ROUNDS} rounds {pace.measured_round_s * 1000:.1f} ms "
              f"({pace.slowness:.2f}x; load average {load})")
    ordered = sorted(medians)
    print(f"lowest run medians: {', '.join(f'{m * 1000:.1f}' for m in ordered[:3])} ms; "
          f"median of runs {statistics.median(medians) * 1000:.1f} ms; {os.cpu_count()} cores, "
          f"{THREADS} torch thread, torch {torch.__version__}")


if __name__ == "__main__":
    main()
