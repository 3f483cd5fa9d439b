"""The replay against the card it replays: the card's own serve stage, run again on the sim engine and sim codec,
compared with serve.json on the quantities the kit's serve stage measures (docs/PERFORMANCE.md, "Replay
calibration against the H200").

`card_serve_workload` reads the stage's load and server settings from serve.json (`shapes`, `overrides`);
`compare_level` sets a replayed level beside the card's level of the same concurrency. Quantities:

- held streams: `admitted_peak` (generating at once) and `concurrent_peak` (playing at once);
- real-time share: `realtime_of_started`;
- tokens a step (streams generating at once, on average): tokens_per_s x wall_seconds / steps;
- loop ms per step: `loop_ms_per_step`; the core process's CPU per step (`core_cpu_us_per_token` x tokens a step);
- codec ms per pass inside the server and frames per pass: the level's `admission_inputs` medians
  (`numbers.codec_pass_ms_p50.median`, `numbers.codec_frames_per_pass.median`) where the row has them, else the run's codec totals (serve.json `server_stats_end.codec`: decode_s, passes,
  frames_decoded), which is all the first card run recorded.

A ratio is replay / card; within 2x means 0.5 <= ratio <= 2.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .profile import core_cpu_ms_per_step, tokens_per_step

# The card's server settings the replay takes; the rest (model paths, device, dtype, backend) the sim replaces.
SERVER_SETTING_PREFIXES = ("scheduler.", "server.max_connections", "codec.max_batch", "engine.max_seq_len")
WITHIN = 2.0


@dataclass(frozen=True, slots=True)
class CardServeWorkload:
    levels: tuple[int, ...]
    warmup_concurrency: int
    requests_per_stream: int
    ramp_s: float
    max_tokens: int
    protocol: str
    server_overrides: tuple[str, ...]  # the card's, as the sim server takes them
    card_rows: dict[int, dict[str, Any]] = field(default_factory=dict)  # by concurrency
    card_codec: dict[str, float] | None = None  # the run's codec totals: ms a pass, frames a pass


def card_serve_workload(serve: dict[str, Any]) -> CardServeWorkload:
    """The serve stage as the card ran it (serve.json's shapes, overrides, rows)."""
    shapes = serve.get("shapes") or {}
    rows = {int(r["concurrency"]): r for r in serve.get("rows") or [] if r.get("concurrency")}
    overrides = tuple(o for o in serve.get("overrides") or [] if o.startswith(SERVER_SETTING_PREFIXES))
    return CardServeWorkload(
        levels=tuple(shapes.get("serve_levels") or sorted(rows)),
        warmup_concurrency=int(shapes.get("serve_warmup_concurrency") or 0),
        requests_per_stream=int(shapes.get("serve_requests_per_stream") or 2),
        ramp_s=float(shapes.get("serve_ramp_s") or 0.0),
        max_tokens=int(serve.get("max_tokens") or shapes.get("serve_max_tokens") or 280),
        protocol=str(serve.get("protocol") or "grpc"),
        server_overrides=overrides,
        card_rows=rows,
        card_codec=codec_totals((serve.get("server_stats_end") or {}).get("codec")),
    )


def codec_totals(codec: dict[str, Any] | None, before: dict[str, Any] | None = None) -> dict[str, float] | None:
    """Ms a pass and frames a pass inside the server from its codec counters (since `before`, if given)."""
    if not codec:
        return None
    base = before or {}
    passes = codec.get("passes", 0) - base.get("passes", 0)
    if passes <= 0:
        return None
    return {"ms_per_pass": round(1000.0 * (codec.get("decode_s", 0.0) - base.get("decode_s", 0.0)) / passes, 3),
            "frames_per_pass": round((codec.get("frames_decoded", 0) - base.get("frames_decoded", 0)) / passes, 2),
            "passes": passes}


def _level_codec(row: dict[str, Any], run_totals: dict[str, float] | None) -> tuple[float | None, float | None, str]:
    """A level's codec ms a pass and frames a pass, and where they came from."""
    numbers = (row.get("admission_inputs") or {}).get("numbers") or {}
    ms, frames = numbers.get("codec_pass_ms_p50"), numbers.get("codec_frames_per_pass")
    if ms and frames:  # the runner's summary of the level's samples: the median of each
        return float(ms["median"]), float(frames["median"]), "admission_inputs, the level's median"
    if row.get("codec_ms_per_pass") is not None and row.get("codec_frames_per_pass") is not None:
        return float(row["codec_ms_per_pass"]), float(row["codec_frames_per_pass"]), "the level's codec counters"
    if run_totals:
        return run_totals["ms_per_pass"], run_totals["frames_per_pass"], "the run's codec counters"
    return None, None, "not recorded"


def compare_level(card_row: dict[str, Any], replay_row: dict[str, Any], *,
                  card_codec: dict[str, float] | None, replay_codec: dict[str, float] | None) -> list[dict[str, Any]]:
    """Card and replay side by side at one concurrency: one entry per quantity."""
    card_ms, card_frames, card_from = _level_codec(card_row, card_codec)
    replay_ms, replay_frames, replay_from = _level_codec(replay_row, replay_codec)
    pairs = [
        ("admitted_peak", card_row.get("admitted_peak"), replay_row.get("admitted_peak"), ""),
        ("concurrent_peak", card_row.get("concurrent_peak"), replay_row.get("concurrent_peak"), ""),
        ("realtime_of_started", card_row.get("realtime_of_started"), replay_row.get("realtime_of_started"), ""),
        ("tokens_per_step", _rounded(tokens_per_step(card_row)), _rounded(tokens_per_step(replay_row)),
         "streams generating at once, on average"),
        ("loop_ms_per_step", card_row.get("loop_ms_per_step"), replay_row.get("loop_ms_per_step"), ""),
        ("core_cpu_ms_per_step", _rounded(core_cpu_ms_per_step(card_row)), _rounded(core_cpu_ms_per_step(replay_row)),
         "core_cpu_us_per_token x tokens a step"),
        ("codec_ms_per_pass", card_ms, replay_ms, f"card: {card_from}; replay: {replay_from}"),
        ("codec_frames_per_pass", card_frames, replay_frames, f"card: {card_from}; replay: {replay_from}"),
    ]
    return [{"quantity": name, "card": card, "replay": replay, "ratio": ratio(card, replay),
             "within_2x": within(card, replay), **({"from": note} if note else {})}
            for name, card, replay, note in pairs]


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def ratio(card: float | None, replay: float | None) -> float | None:
    if card is None or replay is None or card == 0:
        return None
    return round(float(replay) / float(card), 3)


def within(card: float | None, replay: float | None) -> bool | None:
    r = ratio(card, replay)
    return None if r is None else 1.0 / WITHIN <= r <= WITHIN


def format_comparison(concurrency: int, entries: list[dict[str, Any]]) -> str:
    lines = [f"calibration at {concurrency} streams: quantity, card, replay, replay/card, within 2x"]
    for e in entries:
        lines.append(f"  {e['quantity']:<22} {e['card']!s:>9} {e['replay']!s:>9} {e['ratio']!s:>7} "
                     f"{'yes' if e['within_2x'] else 'no' if e['within_2x'] is False else '-'}")
    return "\n".join(lines)
