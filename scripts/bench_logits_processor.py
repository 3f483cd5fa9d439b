#!/usr/bin/env python3
"""Host cost per runtime iteration of the TensorRT backend's frame-position logits processor.

    PYTHONPATH=src python scripts/bench_logits_processor.py [--batches 1,8,32,64,128,256] [--history 300,1500]

TensorRT-LLM calls `FramePositionLogitsProcessor` once per iteration with every constrained
request's logits and its whole token history as Python lists (prompt included). Per batch size B
and history length L (prompt + tokens generated so far), the median over --calls iterations of:

- histories: building B lists of L ints from a token buffer, what the executor's binding does
  before every call (an emulation: `tolist()` of each request's ids);
- processor (host): the processor's own Python work with the vocabulary-wide add left out
  (position per request, row lookup): what the executor's thread waits for besides the adds;
- processor (CPU add): the whole call on CPU logits [1, 1, 156940] fp32, adds included. On a GPU the
  adds are B kernel launches on the executor's stream instead (a few microseconds of host time each),
  so this column is an upper bound for the host side there.

Each iteration advances every request by one token, as the runtime does. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch

from orpheus_serve.engines.trtllm_engine import FramePositionLogitsProcessor
from orpheus_serve.token_format import (
    AUDIO_TOKEN_BASE,
    BOS,
    CODEBOOK_SIZE,
    PROMPT_SUFFIX,
    START_OF_HUMAN,
    TOKENS_PER_FRAME,
    VOCAB_SIZE,
)

PROMPT = [START_OF_HUMAN, BOS, *range(1000, 1030), *PROMPT_SUFFIX]


class _NoAdd:
    """Logits stand-in whose in-place add does nothing: isolates the processor's host logic."""

    is_cuda = False
    device = torch.device("cpu")
    dtype = torch.float32
    shape = (1, 1, VOCAB_SIZE)

    def __iadd__(self, other: object) -> _NoAdd:
        return self


def histories(batch: int, length: int) -> torch.Tensor:
    audio = max(0, length - len(PROMPT))
    ids = [AUDIO_TOKEN_BASE + (i % TOKENS_PER_FRAME) * CODEBOOK_SIZE for i in range(audio)]
    row = torch.tensor(PROMPT + ids, dtype=torch.int64)
    return row.repeat(batch, 1)


def measure(batch: int, length: int, calls: int, *, real_add: bool) -> tuple[float, float]:
    """(median ms to build the histories, median ms of the processor call) per iteration."""
    processor = FramePositionLogitsProcessor()
    buffer = histories(batch, length + calls + 1)
    req_ids = list(range(batch))
    client_ids: list[int | None] = [None] * batch
    logits: list[object] = ([torch.zeros(1, 1, VOCAB_SIZE) for _ in range(batch)] if real_add
                            else [_NoAdd() for _ in range(batch)])
    build_ms, call_ms = [], []
    for step in range(calls):
        started = time.perf_counter()
        token_ids = [[buffer[b, : length + step].tolist()] for b in range(batch)]
        built = time.perf_counter()
        processor(req_ids, logits, token_ids, None, client_ids)
        done = time.perf_counter()
        build_ms.append((built - started) * 1e3)
        call_ms.append((done - built) * 1e3)
        if real_add:
            for tensor in logits:
                tensor.zero_()  # keep -inf out of the next add's inputs (same work every call)
    skip = min(2, calls - 1)  # the first calls build the table and scan the prompts
    return statistics.median(build_ms[skip:]), statistics.median(call_ms[skip:])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,32,64,128,256")
    ap.add_argument("--history", default="300,1500", help="history lengths (prompt + generated tokens)")
    ap.add_argument("--calls", type=int, default=30, help="iterations per measurement")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    print(f"torch {torch.__version__}, {args.threads} thread(s), median of {args.calls} iterations, ms per iteration")
    print("| requests | history tokens | histories (binding copy, emulated) | processor (host) | "
          "processor (CPU add) | host per request µs |")
    print("|---|---|---|---|---|---|")
    for length in (int(x) for x in args.history.split(",")):
        for batch in (int(x) for x in args.batches.split(",")):
            build, host = measure(batch, length, args.calls, real_add=False)
            _, with_add = measure(batch, length, max(4, args.calls // 3), real_add=True)
            print(f"| {batch} | {length} | {build:.3f} | {host:.3f} | {with_add:.3f} | {host / batch * 1e3:.1f} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
