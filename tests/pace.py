"""How fast this machine runs the tiny model right now, for tests that wait on time.

A test that waits on time (a drain window, a first-audio deadline, "freed within a second") states its window
as it holds on the reference machine: two idle cores, the CPU the suite's windows were written on. `MachinePace`
stretches it by how much slower this run measured the same work: the tiny random-weight Llama, four sessions
decoded together, the step a gateway test's server takes most often. Measured once per test run (the `pace`
fixture in conftest.py); the whole run shares it. It never shrinks a window: a faster machine keeps the
reference one.

Measuring the model rather than reading the load average counts what a test's server actually feels: other
processes on the cores, a slower CPU, a throttled container, all at once.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from orpheus_serve import token_format as P
from orpheus_serve.engines.torch_engine import TorchEngine
from orpheus_serve.scheduler.step import PrefillChunk, SamplingParams, StepPlan

# Seconds one calibration round (`_round`) takes on the reference machine: the 2-core CI machine, idle, one torch
# thread as tests/conftest.py sets (41-43 ms there; 150-740 ms while other test runs shared its cores).
REFERENCE_ROUND_S = 0.042
SESSIONS = 4  # the gateway test servers' batch (tests/gateway_support.py: max_batch_size 4)
DECODE_STEPS = 28  # four frames of audio per session
ROUNDS = 7


@dataclass(frozen=True, slots=True)
class MachinePace:
    """`slowness`: this machine's time for the calibration over the reference machine's, never below 1."""

    slowness: float
    measured_round_s: float

    def window(self, reference_s: float) -> float:
        """A time window that holds on the reference machine, stretched to this one."""
        return reference_s * self.slowness

    def __str__(self) -> str:
        return (f"machine pace: {self.slowness:.2f}x the reference (a calibration round took "
                f"{self.measured_round_s * 1000:.0f} ms, reference {REFERENCE_ROUND_S * 1000:.0f} ms)")


def _round(engine: TorchEngine, round_index: int) -> float:
    """Prefill `SESSIONS` short prompts, then decode them together for `DECODE_STEPS` steps; seconds taken."""
    greedy = SamplingParams(temperature=0.0)
    slots = list(range(SESSIONS))
    started = time.perf_counter()
    plan = StepPlan(prefill=[
        PrefillChunk(slot, f"pace-{round_index}-{slot}", prompt := (P.START_OF_HUMAN, P.BOS, *range(200 + slot, 212 + slot),
                                                                     *P.PROMPT_SUFFIX),
                     0, len(prompt), greedy)
        for slot in slots])
    engine.step(plan)
    for _ in range(DECODE_STEPS):
        out = engine.step(StepPlan(decode=slots))
        assert not out.failed, out.failed
    engine.step(StepPlan(release=slots))
    return time.perf_counter() - started


def calibrate(tiny_orpheus: Path) -> MachinePace:
    """Time `ROUNDS` rounds of the tiny model (after one warm-up round) with the torch threads a server gets
    (one: tests/conftest.py)."""
    engine = TorchEngine(tiny_orpheus, num_slots=SESSIONS, max_seq_len=128, device="cpu", dtype="fp32",
                         max_batch_size=SESSIONS, cuda_graphs=False, seed=0)
    _round(engine, -1)
    # The median, not the best: a server under test lives through the machine's load, not its best moments.
    measured = statistics.median(_round(engine, i) for i in range(ROUNDS))
    return MachinePace(slowness=max(1.0, measured / REFERENCE_ROUND_S), measured_round_s=measured)


def main() -> None:
    """`python -m tests.pace [TINY_ORPHEUS]`: print this machine's pace (to set REFERENCE_ROUND_S on a new
    reference machine, run it there while idle)."""
    import os
    import sys
    import tempfile

    os.environ.setdefault("OMP_NUM_THREADS", "1")  # as tests/conftest.py; torch reads it when first used
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

    if len(sys.argv) > 1:
        print(calibrate(Path(sys.argv[1])))
        return
    from scripts.make_tiny_models import main as make_tiny_models

    with tempfile.TemporaryDirectory() as folder:
        assert make_tiny_models(["--out", folder, "--seed", "0", "--skip-snac"]) == 0
        print(calibrate(Path(folder) / "tiny-orpheus"))
    print(f"torch threads: {torch.get_num_threads()}")


if __name__ == "__main__":
    main()
