"""A card's measured costs, read from a GPU kit result folder (scripts/gpu: engine.json, codec.json, serve.json).

What the replay needs, and where each comes from:

- **Engine step** by batch and KV length: the kit's engine stage, decode steps replayed from CUDA graphs
  (`bench.rows` and `variants.rows` with `graphs: true`) of one attention variant (`triton` where measured,
  as the server's `attention: auto` runs on CUDA; else `sdpa`). A row's KV length is the middle of the lengths
  it stepped through. A variant measured only at batch 128/256 still has its batch-1 time: the row's
  `x_batch_1` is tokens/s over batch 1's. Between points the time is linear in batch and in KV length; past
  the largest batch it grows with the last segment's slope; past the KV lengths measured it stays at the
  nearest one (a variant measured near 1,024 tokens only is charged that at every length: never flattering).
- **Prefill**: the kit measures no prefill, so a chunk of p prompt tokens costs what p more rows cost in a
  decode step (the same weights read, p more rows of GEMM): a step of batch b with p prefill tokens costs
  step(b + p). Stated as a model in `sources`.
- **Codec pass** by frames: the kit's codec stage (stateful SNAC, `rows`: batch sessions of
  `frames_per_session` frames each), linear between points, flat below the smallest pass, the last slope past
  the largest.
- **Interpreter time** (host work that holds the GIL): a codec pass of the stateful decoder launches a few
  hundred small kernels from Python whatever its batch, so its floor, the fastest pass measured, is the launch
  time of every pass (`codec_launch_ms`); where the kit measured a pass's host time (`host_ms_median`, with the
  decoder's CUDA graphs where it ran them) that is used instead. An engine step replayed from a graph launches little; its host part
  (`engine_launch_ms` + `engine_launch_per_row_ms` per row: input copies, the graph replay, per-row
  bookkeeping) comes from the serve stage where the folder has one (`engine_launch_from_serve`): the
  engine-core's measured launch phase (`rows[].core_host.step_ms.launch`) where the kit recorded it, else the
  core process's CPU per step (`core_cpu_us_per_token` x tokens a step) less the codec's, at most the loop
  period (one thread cannot hold the interpreter longer than its own loop): an upper bound, since CPU spent
  waiting on the device without the interpreter counts too. Without serve.json it is the defaults below.
  Each input is listed as measured (with its file and field) or estimated (`measured`, `estimated`).
- **Paths the card never ran** (`unmeasured_paths`): a replay that takes one (ragged codec steps while the
  folder's codec stage has no `mixed_passes` with `ragged_ms`) is modelled, not measured, and says so.
- **Contention** on the device: the codec stage ran engine steps and codec passes alone and at once; what
  running both did not hide (`together - max(alone)`) is charged to the engine as a slowdown of its steps
  while a pass runs (`engine_slowdown_under_codec`).

Pure Python and numpy; `ModelledCard` (card.py) turns it into time.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..token_format import FRAME_SECONDS, TOKENS_PER_FRAME

# Host part of a graph-replayed engine step where the folder's serve stage recorded neither the core's launch phase
# nor its CPU per step (engine_launch_from_serve):
# the H200 run's loop period exceeded the step's device time by 0.5-0.9 ms at batches of 4-17, scheduling and
# dispatch included, so the launch alone is taken as about half a millisecond plus a few microseconds a row.
DEFAULT_ENGINE_LAUNCH_MS = 0.5
DEFAULT_ENGINE_LAUNCH_PER_ROW_MS = 0.004
UNMEASURED_LABEL = "modelled, not measured"  # a replay that took a path its card never ran
REALTIME_STEP_MS = 1000.0 * FRAME_SECONDS / TOKENS_PER_FRAME  # a stream needs a token this often: 12.19 ms


class ProfileError(ValueError):
    """The folder does not hold what a replay needs."""


def _interp(x: float, xs: Sequence[float], ys: Sequence[float]) -> float:
    """Linear through the points; flat below the first, the last segment's slope (never negative) past the last."""
    if len(xs) == 1 or x <= xs[0]:
        return ys[0]
    for i in range(1, len(xs)):
        if x <= xs[i]:
            t = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
            return ys[i - 1] + t * (ys[i] - ys[i - 1])
    slope = max(0.0, (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]))
    return ys[-1] + slope * (x - xs[-1])


@dataclass(frozen=True, slots=True)
class StepCurve:
    """Decode-step time over batch and KV length: one column of (batch, ms) points per KV length measured."""

    kv_lens: tuple[float, ...]  # ascending
    columns: tuple[tuple[tuple[int, float], ...], ...]  # per KV length: (batch, ms), batch ascending

    def step_ms(self, batch: float, kv_len: float) -> float:
        values = [_interp(batch, [b for b, _ in col], [ms for _, ms in col]) for col in self.columns]
        if kv_len <= self.kv_lens[0]:
            return values[0]
        if kv_len >= self.kv_lens[-1]:
            return values[-1]
        return _interp(kv_len, self.kv_lens, values)


@dataclass(frozen=True, slots=True)
class CardProfile:
    name: str  # the result folder's name
    card: str  # the GPU, as the kit recorded it
    variant: str  # the engine rows replayed
    steps: StepCurve
    codec_points: tuple[tuple[int, float], ...]  # (frames in the pass, ms), ascending
    codec_launch_ms: float  # interpreter time of every codec pass
    engine_launch_ms: float  # interpreter time of every engine step
    engine_launch_per_row_ms: float
    engine_slowdown_under_codec: float  # >= 1: an engine step's device time while a codec pass runs
    # The stateful decoder on snac_24khz (ARCHITECTURE §4): a frame's audio is final once 3 more are in.
    codec_lookahead_frames: int = 3
    sources: dict[str, str] = field(default_factory=dict)  # where each number came from
    # Each input the replay takes, by name: measured (the file and field it came from) or estimated (why).
    measured: dict[str, str] = field(default_factory=dict)
    estimated: dict[str, str] = field(default_factory=dict)
    ragged_steps_measured: bool = False  # the codec stage timed ragged steps (codec.json mixed_passes)

    def step_ms(self, batch: int, kv_len: float, prefill_tokens: int = 0) -> float:
        """Device time of one step: `batch` rows decoded at a mean KV length, plus prefill (module docstring)."""
        if batch + prefill_tokens <= 0:
            return 0.0
        return self.steps.step_ms(batch + prefill_tokens, kv_len)

    def codec_pass_ms(self, frames: int) -> float:
        if frames <= 0:
            return 0.0
        return _interp(frames, [f for f, _ in self.codec_points], [ms for _, ms in self.codec_points])

    def launch_ms(self, batch: int) -> float:
        return self.engine_launch_ms + self.engine_launch_per_row_ms * batch

    def realtime_bound(self, *, mean_kv_len: float, max_frames_per_pass: int, prefill_share: float = 0.0,
                       max_streams: int = 4096) -> int:
        """Most streams this card keeps real time when every stream decodes every step: the largest n whose step
        (n rows, plus `prefill_share` prompt tokens per generated token, the mean prefill a step carries), slowed
        while the codec is busy for the share of time n streams' frames keep it busy, takes at most 12.19 ms (a
        token per stream every FRAME_SECONDS / 7), and whose frames the codec decodes in time."""
        best = 0
        pass_frames = max(1, max_frames_per_pass)
        frames_per_ms = pass_frames / self.codec_pass_ms(pass_frames)
        for n in range(1, max_streams + 1):
            codec_busy = (n / (FRAME_SECONDS * 1000.0)) / frames_per_ms  # share of time the codec runs
            if codec_busy > 1.0:
                break
            step = self.step_ms(n, mean_kv_len, round(n * prefill_share)) \
                * (1.0 + (self.engine_slowdown_under_codec - 1.0) * codec_busy)
            if step > REALTIME_STEP_MS:
                break
            best = n
        return best

    def unmeasured_paths(self, *, ragged_steps: bool) -> list[str]:
        """The paths a replay with these settings takes that the card never ran: their cost is extrapolated from
        what it did run (modelled, not measured)."""
        return ["codec.ragged_steps"] if ragged_steps and not self.ragged_steps_measured else []

    def inputs_record(self, *, ragged_steps: bool) -> dict[str, Any]:
        """What a replay with these settings rests on, for its header and result JSON: the measured inputs
        (file and field), the estimated ones (why), and the paths the card never ran, which make the whole result
        modelled, not measured."""
        unmeasured = self.unmeasured_paths(ragged_steps=ragged_steps)
        return {"profile": self.name, "card": self.card, "measured": dict(self.measured),
                "estimated": dict(self.estimated), "unmeasured_paths": unmeasured,
                "label": UNMEASURED_LABEL if unmeasured else None}

    def describe(self) -> dict[str, Any]:
        """The profile as plain values, for benchmark output."""
        return {
            "name": self.name, "card": self.card, "variant": self.variant,
            "step_ms": {f"kv{round(kv)}": {str(b): round(ms, 3) for b, ms in col}
                        for kv, col in zip(self.steps.kv_lens, self.steps.columns, strict=True)},
            "codec_pass_ms": {str(f): round(ms, 3) for f, ms in self.codec_points},
            "codec_launch_ms": round(self.codec_launch_ms, 3), "engine_launch_ms": round(self.engine_launch_ms, 3),
            "engine_launch_per_row_ms": self.engine_launch_per_row_ms,
            "engine_slowdown_under_codec": round(self.engine_slowdown_under_codec, 3), "sources": self.sources,
            "measured": self.measured, "estimated": self.estimated,
            "ragged_steps_measured": self.ragged_steps_measured,
        }


def load_profile(folder: str | Path, *, variant: str | None = None) -> CardProfile:
    """Read a kit result folder (module docstring). `variant`: the engine rows to replay (default: triton where
    measured, else sdpa)."""
    folder = Path(folder)
    engine = _read(folder, "engine.json")
    codec = _read(folder, "codec.json")
    serve = _read(folder, "serve.json", required=False)
    sources: dict[str, str] = {}
    measured: dict[str, str] = {}
    estimated: dict[str, str] = {}
    rows = [r for r in (*engine.get("bench", {}).get("rows", []), *engine.get("variants", {}).get("rows", []))
            if r.get("graphs") and r.get("step_ms")]
    variants_measured = {r.get("variant") for r in rows}
    chosen = variant or ("triton" if "triton" in variants_measured else "sdpa")
    steps = _step_curve([r for r in rows if r.get("variant") == chosen], chosen, folder)
    sources["steps"] = f"engine.json: {chosen} decode steps, CUDA graphs"
    sources["prefill"] = "model: p prefill tokens cost p more decode rows (no prefill measured)"
    measured["engine.step"] = f"engine.json: bench.rows/variants.rows step_ms, variant {chosen}, graphs"
    estimated["engine.prefill"] = sources["prefill"]

    codec_rows = [r for r in codec.get("rows", []) if r.get("pass_ms_median")]
    if not codec_rows:
        raise ProfileError(f"{folder / 'codec.json'} has no measured codec passes")
    points = sorted({int(r["batch"]) * int(r.get("frames_per_session", 1)): float(r["pass_ms_median"])
                     for r in codec_rows}.items())
    sources["codec"] = f"codec.json: stateful decoder, {codec.get('dtype', '?')}, passes of {len(points)} sizes"
    measured["codec.pass"] = "codec.json: rows[].pass_ms_median"
    hosts = [float(r["host_ms_median"]) for r in codec_rows if r.get("host_ms_median")]
    if hosts:  # the kit measured the host's share of a pass (thread CPU time; with CUDA graphs where it ran them)
        codec_launch = max(hosts)
        sources["codec_launch"] = "codec.json: host ms per pass (thread CPU), the largest measured"
        measured["codec.launch"] = "codec.json: rows[].host_ms_median (the largest)"
    else:
        codec_launch = min(ms for _, ms in points)
        sources["codec_launch"] = "codec.json: the fastest pass measured (launch-bound at small batches)"
        estimated["codec.launch"] = "the fastest pass in codec.json rows[].pass_ms_median (no host_ms_median)"
    ragged_measured = any(r.get("ragged_ms") for r in codec.get("mixed_passes") or [])

    per_row = DEFAULT_ENGINE_LAUNCH_PER_ROW_MS
    from_serve = engine_launch_from_serve(serve, codec_launch_ms=codec_launch)
    if from_serve is not None:
        launch_ms, field_used = from_serve
        sources["engine_launch"] = f"serve.json: {field_used}"
        measured["engine.launch"] = sources["engine_launch"]
    else:
        launch_ms = DEFAULT_ENGINE_LAUNCH_MS
        sources["engine_launch"] = "estimated (serve.json has no core_host and no core CPU per step)"
        estimated["engine.launch"] = (f"{DEFAULT_ENGINE_LAUNCH_MS} ms a step: the loop period over the step's device "
                                      "time at the H200's small batches (no serve.json measurement)")
    estimated["engine.launch_per_row"] = f"{DEFAULT_ENGINE_LAUNCH_PER_ROW_MS} ms a row (no card measured it)"

    slowdown = 1.0
    overlap = codec.get("overlap") or {}
    if overlap.get("engine_alone_s") and overlap.get("codec_alone_s") and overlap.get("together_s"):
        unhidden = overlap["together_s"] - max(overlap["engine_alone_s"], overlap["codec_alone_s"])
        slowdown = 1.0 + max(0.0, unhidden) / overlap["engine_alone_s"]
        sources["contention"] = (f"codec.json overlap at batch {overlap.get('batch')}: "
                                 f"{overlap['together_s']} s together, {overlap['engine_alone_s']} s engine, "
                                 f"{overlap['codec_alone_s']} s codec alone")
        measured["contention"] = "codec.json: overlap together_s, engine_alone_s, codec_alone_s"
    else:
        sources["contention"] = "none measured: no slowdown"
        estimated["contention"] = sources["contention"]
    env = engine.get("env", {})
    return CardProfile(name=folder.name, card=str(env.get("gpu") or engine.get("bench", {}).get("device", "?")),
                       variant=chosen, steps=steps, codec_points=tuple(points), codec_launch_ms=codec_launch,
                       engine_launch_ms=launch_ms, engine_launch_per_row_ms=per_row,
                       engine_slowdown_under_codec=slowdown, sources=sources, measured=measured,
                       estimated=estimated, ragged_steps_measured=ragged_measured)


def tokens_per_step(row: dict[str, Any]) -> float | None:
    """Tokens an engine step made at a serve level: its tokens over its steps."""
    tokens_per_s, wall_s, steps = row.get("tokens_per_s"), row.get("wall_seconds"), row.get("steps")
    if not tokens_per_s or not wall_s or not steps:
        return None
    return float(tokens_per_s) * float(wall_s) / float(steps)


def core_cpu_ms_per_step(row: dict[str, Any]) -> float | None:
    """The engine-core process's CPU per engine step at a serve level (core_cpu_us_per_token x tokens a step)."""
    per_token, tokens = row.get("core_cpu_us_per_token"), tokens_per_step(row)
    if not per_token or tokens is None:
        return None
    return float(per_token) * tokens / 1000.0


def engine_launch_from_serve(serve: dict[str, Any], *, codec_launch_ms: float) -> tuple[float, str] | None:
    """The interpreter time of an engine step as the serve stage measured it, median over its levels, and the
    fields it came from; None without serve.json's rows or any of the fields.

    Preferred: the core's launch phase (`core_host.step_ms.launch.p50`: building inputs and the graph replay,
    wall time on the loop thread). Else the core process's CPU per step less the codec's (its host ms a pass x
    passes a step, from `server_stats_end`), at most the loop period (`loop_ms_per_step`)."""
    rows = [r for r in serve.get("rows") or [] if isinstance(r, dict)]
    launches = [float(launch["p50"]) for r in rows
                if isinstance(r.get("core_host"), dict)
                and isinstance(launch := (r["core_host"].get("step_ms") or {}).get("launch"), dict)
                and launch.get("p50") is not None]
    if launches:
        return _median(launches), f"rows[].core_host.step_ms.launch.p50 (median of {len(launches)} levels)"
    stats = serve.get("server_stats_end") or {}
    codec_passes = (stats.get("codec") or {}).get("passes")
    engine_steps = (stats.get("engine") or {}).get("steps")
    codec_per_step = codec_launch_ms * codec_passes / engine_steps if codec_passes and engine_steps else 0.0
    holds = []
    for r in rows:
        cpu = core_cpu_ms_per_step(r)
        if cpu is None or not r.get("loop_ms_per_step"):
            continue
        holds.append(min(cpu - codec_per_step, float(r["loop_ms_per_step"])))
    if not holds:
        return None
    return (max(0.0, _median(holds)),
            f"rows[].core_cpu_us_per_token x tokens a step (tokens_per_s, wall_seconds, steps) less the codec's "
            f"host ms x server_stats_end codec.passes / engine.steps ({codec_per_step:.2f} ms), at most "
            f"rows[].loop_ms_per_step (median of {len(holds)} levels; an upper bound: device waits count)")


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _step_curve(rows: list[dict[str, Any]], variant: str, folder: Path) -> StepCurve:
    if not rows:
        raise ProfileError(f"{folder / 'engine.json'} has no graph-replayed decode steps of variant {variant!r}")
    by_kv: dict[float, dict[int, float]] = {}
    for r in rows:
        kv = (r.get("kv_len_first", r.get("context", 0)) + r.get("kv_len_last", r.get("context", 0))) / 2
        column = by_kv.setdefault(kv, {})
        column[int(r["batch"])] = float(r["step_ms"])
        if r.get("x_batch_1") and int(r["batch"]) > 1 and 1 not in column:
            # tokens/s over batch 1's: batch-1 step = step * x_batch_1 / batch
            column[1] = float(r["step_ms"]) * float(r["x_batch_1"]) / int(r["batch"])
    kv_lens = tuple(sorted(by_kv))
    columns = tuple(tuple(sorted(by_kv[kv].items())) for kv in kv_lens)
    if any(not math.isfinite(ms) or ms <= 0 for col in columns for _, ms in col):
        raise ProfileError(f"{folder / 'engine.json'} has a step time that is not a positive number")
    return StepCurve(kv_lens, columns)


def _read(folder: Path, name: str, *, required: bool = True) -> dict[str, Any]:
    path = folder / name
    if not path.is_file():
        if required:
            raise ProfileError(f"{path} is missing: a replay needs the kit's engine and codec stages")
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ProfileError(f"{path} cannot be read: {exc}") from exc
    if not isinstance(data, dict):
        raise ProfileError(f"{path} is not a kit stage result")
    return data


def format_inputs(record: dict[str, Any]) -> str:
    """`inputs_record` as the header a replay prints before its results."""
    lines = [f"replay of {record['profile']} ({record['card']})"]
    if record.get("unmeasured_paths"):
        lines.append(f"  {record['label'].upper()}: paths the card never ran: {', '.join(record['unmeasured_paths'])}")
    lines += [f"  measured  {name}: {where}" for name, where in record["measured"].items()]
    lines += [f"  estimated {name}: {why}" for name, why in record["estimated"].items()]
    return "\n".join(lines)
