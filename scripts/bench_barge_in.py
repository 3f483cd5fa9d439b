#!/usr/bin/env python3
"""The server's cancel latency: how soon a barge-in stops generation, in milliseconds and in engine steps.

    .venv/bin/python scripts/bench_barge_in.py [--barge-ins 30] [--core process|inproc] [--models models]
                                               [--json results/barge_in.json]

A real server (the torch engine on the tiny models, greedy, chunks of up to 50 frames; its engine core in a
process of its own as shipped, or `--core inproc`) runs on a loop of its own in this process, with a token log.
One Cartesia-compatible WebSocket opens a context per barge-in, waits for its first audio (the answer is then
still generating: hundreds of tokens are left) and cancels it.

Measured, per barge-in, from the cancel reaching the server's socket to the engine core dropping the session:

- milliseconds: `time.monotonic()` just before the client writes the cancel (on loopback its bytes are in the
  server's socket when the write returns) to the token log's `ended_at` of the session, which the core stamps
  with `time.monotonic()` when it applies the cancel (CLOCK_MONOTONIC is system-wide, so the two compare across
  the processes);
- engine steps: the core's step counter read just before the cancel is written to the token log's `ended_step`
  (so a step that ends between that read and the write counts against the server: an upper bound).

Printed: p50 and p95 of both, the mean engine step, and p95 against the target of at most one engine step (on
an idle machine; on a busy one the gateway's event loop, the core's input thread and the engine share the
cores, and the figure says how much that costs). A benchmark: it fails nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

TARGET_STEPS = 1.0  # p95 of the cancel latency, in engine steps, on an idle machine
ANSWER = "This answer is interrupted by the user, who starts talking over it right away, long before its end."


def server_config(models: Path, core: str, max_tokens: int) -> Any:
    from orpheus_serve.config import load_config

    return load_config(overrides={
        "server.host": "127.0.0.1", "server.http_port": 0, "server.grpc_port": 0, "server.shutdown_grace_s": 2.0,
        "server.log_level": "warning", "server.engine_process": core == "process",
        "engine.backend": "torch", "engine.device": "cpu", "engine.model_path": str(models / "tiny-orpheus"),
        "codec.path": str(models / "tiny-snac"), "codec.device": "cpu", "codec.noise": False,
        "scheduler.max_concurrent_sessions": 4, "scheduler.max_batch_size": 4, "scheduler.admission": "slots",
        "sampling.temperature": 0.0, "sampling.min_tokens": 28, "sampling.max_tokens": max_tokens,
    }, env={})


def generation(context_id: str, transcript: str) -> str:
    return json.dumps({"context_id": context_id, "transcript": transcript, "continue": True, "model_id": "sonic-2",
                       "voice": {"mode": "id", "id": "tara"}, "language": "en",
                       "output_format": {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 24000}})


def request_entries(server: Any, first_text: str) -> list[dict[str, Any]]:
    """Token-log entries of the request whose first text chunk starts with `first_text`, in order."""
    entries = server.server.service.token_log.snapshot()
    ids = [key.rsplit("-", 1)[0] for key, e in entries.items() if key.endswith("-0") and e["text"].startswith(first_text)]
    return [e for key, e in entries.items() if ids and key.rsplit("-", 1)[0] == ids[-1]]


def core_steps(server: Any) -> int:
    return server.server.service.snapshot().core.steps


async def barge_ins(server: Any, count: int, timeout_s: float) -> list[dict[str, Any]]:
    from websockets.asyncio.client import connect

    audio: dict[str, int] = {}  # context id -> audio chunks received
    first_audio: dict[str, asyncio.Event] = {}
    results: list[dict[str, Any]] = []

    async def read(ws: Any) -> None:
        async for raw in ws:
            message = json.loads(raw)
            context_id = message.get("context_id")
            if message.get("type") == "chunk" and message.get("data"):
                audio[context_id] = audio.get(context_id, 0) + len(base64.b64decode(message["data"]))
                if context_id in first_audio:
                    first_audio[context_id].set()

    async with connect(f"ws://127.0.0.1:{server.http_port}/tts/websocket") as ws:
        reader = asyncio.create_task(read(ws))
        try:
            for k in range(count):
                context_id = f"barge-{k}"
                first_audio[context_id] = asyncio.Event()
                await ws.send(generation(context_id, ANSWER))
                await asyncio.wait_for(first_audio[context_id].wait(), timeout_s)
                before = await asyncio.to_thread(core_steps, server)
                sent_at = time.monotonic()
                await ws.send(json.dumps({"context_id": context_id, "cancel": True}))
                deadline = time.monotonic() + timeout_s
                while True:
                    entries = await asyncio.to_thread(request_entries, server, ANSWER[:20])
                    if entries and all(e["finish_reason"] is not None for e in entries):
                        break
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"barge-in {k}: the sessions did not end within {timeout_s} s")
                    await asyncio.sleep(0.005)
                cancelled = [e for e in entries if e["finish_reason"] == "cancelled"]
                if not cancelled:  # the answer ended by itself before the cancel: nothing to measure
                    results.append({"barge_in": k, "measured": False})
                    continue
                last = max(cancelled, key=lambda e: e["ended_at"])
                results.append({"barge_in": k, "measured": True,
                                "latency_ms": (last["ended_at"] - sent_at) * 1000,
                                "steps": last["ended_step"] - before,
                                "frames": sum(len(e["frames"]) for e in entries)})
                await asyncio.sleep(0.05)  # the freed slot goes back before the next answer
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
    return results


def summarize(results: list[dict[str, Any]], step_ms: float | None) -> dict[str, Any]:
    from orpheus_serve.client.records import percentile

    measured = [r for r in results if r["measured"]]
    ms = [r["latency_ms"] for r in measured]
    steps = [float(r["steps"]) for r in measured]

    def rounded(value: float | None, digits: int) -> float | None:
        return None if value is None else round(value, digits)

    p95_steps = percentile(steps, 0.95)
    return {
        "barge_ins": len(results), "measured": len(measured),
        "latency_ms_p50": rounded(percentile(ms, 0.5), 3), "latency_ms_p95": rounded(percentile(ms, 0.95), 3),
        "latency_ms_max": rounded(max(ms, default=None), 3),
        "steps_p50": rounded(percentile(steps, 0.5), 2), "steps_p95": rounded(p95_steps, 2),
        "steps_max": max((r["steps"] for r in measured), default=None),
        "step_ms_mean": rounded(step_ms, 3), "target_steps_p95": TARGET_STEPS,
        "target_met": None if p95_steps is None else p95_steps <= TARGET_STEPS,
        "runs": results,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from orpheus_serve.api.launch import ServerThread
    from orpheus_serve.service.build import build_service

    torch.set_num_threads(1)  # as the server's own engine process does on a small machine: no thread fights
    config = server_config(args.models, args.core, args.max_tokens)
    server = ServerThread(config, build_service(config, record_tokens=True)).start()
    try:
        start = server.server.service.snapshot().core
        results = asyncio.run(barge_ins(server, args.barge_ins, args.timeout_s))
        end = server.server.service.snapshot().core
    finally:
        server.stop()
    steps = end.steps - start.steps
    step_ms = (end.loop_s - start.loop_s) / steps * 1000 if steps else None
    summary = summarize(results, step_ms)
    summary["core"] = args.core
    return summary


def report(summary: dict[str, Any]) -> str:
    lines = [f"barge-ins: {summary['barge_ins']} ({summary['measured']} measured; engine core: {summary['core']}; "
             f"mean engine step {summary['step_ms_mean']} ms)",
             "cancel latency, from the cancel reaching the server's socket to the engine core dropping the session:",
             f"  ms:    p50 {summary['latency_ms_p50']}  p95 {summary['latency_ms_p95']}  max {summary['latency_ms_max']}",
             f"  steps: p50 {summary['steps_p50']}  p95 {summary['steps_p95']}  max {summary['steps_max']}"]
    if summary["target_met"] is not None:
        lines.append(f"  target: p95 <= {summary['target_steps_p95']:g} engine step on an idle machine: "
                     + ("met" if summary["target_met"] else "missed"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--barge-ins", type=int, default=30, help="answers to interrupt (default 30)")
    parser.add_argument("--core", choices=("process", "inproc"), default="process",
                        help="the engine core in a process of its own (as shipped) or in the server's process")
    parser.add_argument("--models", type=Path, default=ROOT / "models",
                        help="folder with tiny-orpheus/ and tiny-snac/ (scripts/make_tiny_models.py)")
    parser.add_argument("--max-tokens", type=int, default=350, help="tokens per text chunk (350: 50 frames, 4 s)")
    parser.add_argument("--timeout-s", type=float, default=60.0, help="longest wait for one answer's first audio "
                                                                      "or its end")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures (and every run) here")
    args = parser.parse_args(argv)
    if args.barge_ins < 1:
        parser.error("--barge-ins must be at least 1")
    args.models = args.models.resolve()
    summary = run(args)
    print(report(summary))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
