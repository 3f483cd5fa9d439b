#!/usr/bin/env python3
"""Merge the GPU kit's stage results into docs/PERFORMANCE.md and keep the run's raw files.

    python scripts/gpu/report.py RESULTS_DIR [--doc docs/PERFORMANCE.md] [--raw-root docs/gpu-results]
                                 [--note TEXT] [--allow-dry-run]

Reads STAGE.json for every stage present in RESULTS_DIR (written by `scripts/gpu/run.sh`), copies every
file of RESULTS_DIR (the stage JSONs, the log archives, a README or `kit-edits.diff` put beside them) to
RAW_ROOT/<date>-<card>/ (committed with the report), and writes each stage's table, with the card,
driver, torch/CUDA versions and date, between the markers below. A stage missing from RESULTS_DIR keeps
what the section already had for it, so stages run in separate calls add up.

A stage run twice in a call (serve with other server settings, `kit.py serve --tag NAME`) is its own block,
named by its tag (NAME.json), after the stage's first.

Every stage that ran is recorded. One that failed (`ok` false: a failed GPU test, requests that failed,
a bench that raised...) is merged as FAILED with its problems and whatever it measured; that result is
what users must see. One cut short by its deadline (`partial`, or `complete` false: killed, or stopped before
its last piece) is merged as PARTIAL with what it measured. The section opens with one row
per stage: machine, date, result and problems. Only the results of a dry run (CPU, tiny shapes) are
refused unless --allow-dry-run: their numbers say nothing about a GPU.

A run made with local edits to the kit says so: a `kit-edits.diff` in RESULTS_DIR is kept with the raw
files and named in the run's line, with the files it touches; --note adds a sentence of explanation.

The serve stage's tables are rendered here from its JSON (`render_serve`, which the kit's serve stage
also uses for the table it writes): the levels, the level run with admission fixed at the slot count, and
the inputs of the admission decision sampled during each level.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
BEGIN = "<!-- gpu-kit:begin -->"
END = "<!-- gpu-kit:end -->"
STAGE_TITLES = {
    "check": "Check: the card, the versions, `pytest -m gpu`",
    "base": "Base: the engine's decode steps in the server's own configuration (Orpheus-3B shape, bf16)",
    "engine": "Engine: decode steps of the Orpheus-3B shape (torch backend, bf16)",
    "compiled": "Compiled: the engine's decode steps with engine.compile (Orpheus-3B shape, bf16)",
    "codec": "Codec: stateful SNAC decode in FP16 on its own stream",
    "serve": "Serve: the production server over gRPC (engine core in its own process), stepped concurrency",
}
STAGE_BEGIN = "<!-- gpu-kit:stage {} -->"
STAGE_END = "<!-- gpu-kit:stage-end {} -->"
SUMMARY = "<!-- gpu-kit:summary {} -->"  # one stage's row of the overview, kept inside its block
RUN_BEGIN = "<!-- gpu-kit:run {} -->"
RUN_END = "<!-- gpu-kit:run-end {} -->"
EDITS_FILE = "kit-edits.diff"


def cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:,.2f}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value).replace("|", "/")


def markdown_table(headers: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


# ----------------------------------------------------------------- the serve stage's tables


def _spread(summary: dict[str, Any] | None) -> str:
    """'median (min-max)' of one admission number, '-' when never reported."""
    if not summary:
        return "-"
    low, mid, high = (cell(summary[k]) for k in ("min", "median", "max"))
    return mid if low == high else f"{mid} ({low}-{high})"


def _level_label(row: dict[str, Any]) -> str:
    return f"{row['concurrency']} (admission {row['admission']})" if row.get("admission") else str(row["concurrency"])


def render_serve(data: dict[str, Any]) -> str:
    """The serve stage's Markdown: its levels (and the level with admission fixed at the slot count), the
    streams held real-time, and the admission inputs per level where they were sampled."""
    rows = data.get("rows") or []
    fixed = data.get("admission_fixed")
    levels = [*rows, *([fixed] if fixed else [])]
    if not levels:
        return ""
    table = markdown_table(
        ["concurrent", "requests", "ok", "TTFB p50 ms", "TTFB p95 ms", "real-time of started", "underruns",
         "stream audio s (min-max)", "audio s / s", "tokens/s", "admitted peak", "capacity at saturation",
         "server CPU s / audio s", "GPU util % (mean)"],
        [[_level_label(r), r["requests"], r["succeeded"], r["ttfb_p50_ms"], r["ttfb_p95_ms"], r["realtime_of_started"],
          r["underrun_events"], f"{r['stream_audio_s_min']}-{r['stream_audio_s_max']}", r["audio_seconds_per_second"],
          r["tokens_per_s"], r.get("admitted_peak"), r.get("capacity_at_saturation"), r["server_cpu_s_per_audio_s"],
          (r.get("gpu") or {}).get("util_mean_pct")] for r in levels])
    held = data.get("realtime_held") or {}
    if held:
        table += "\n\n" + "; ".join(f"real-time streams at p95 TTFB < {t} ms: **{n if n is not None else 'none'}**"
                                    for t, n in held.items())
    shapes = data.get("shapes") or {}
    table += (f" (gRPC, {data.get('max_tokens')}-token utterances = {data.get('expected_stream_audio_s')} s of audio "
              f"each, {shapes.get('serve_requests_per_stream')} per stream, arrivals spread over "
              f"{shapes.get('serve_ramp_s')} s; engine core in its own process)")
    table += "\n\nThe engine-core loop per level (from GET /v1/stats before and after it):\n\n" + markdown_table(
        ["concurrent", "steps", "engine step ms", "loop ms / step", "loop / engine step", "core CPU us / token",
         "API CPU us / token"],
        [[_level_label(r), r.get("steps"), r.get("engine_ms_per_step"), r.get("loop_ms_per_step"),
          r.get("loop_over_engine"), r.get("core_cpu_us_per_token"), r.get("api_cpu_us_per_token")] for r in levels])
    codec = (data.get("server_stats_end") or {}).get("codec") or {}
    if codec.get("passes"):
        table += (f"\n\nThe codec inside the server, over the whole stage (warm-up included): {codec['passes']:,} "
                  f"passes decoded {codec['frames_decoded']:,} frames in {codec['decode_s']:.1f} s, "
                  f"{1000 * codec['decode_s'] / codec['passes']:.1f} ms per pass of "
                  f"{codec['frames_decoded'] / codec['passes']:.1f} frames on average.")
    if fixed:
        table += ("\n\nThe last row ran on a second server with `scheduler.admission=slots`: every request is "
                  "admitted while a slot is free, so it shows what the pipeline carries without the admission "
                  "control's estimate.")
    sampled = [r for r in levels if (r.get("admission_inputs") or {}).get("samples")]
    if sampled:
        table += ("\n\nInputs of the admission decision (`flow` in GET /v1/stats), sampled every 0.5 s during each "
                  "level: median (min-max) over the samples, `-` where the server did not report the field; "
                  "limit reasons counted over the samples.\n\n")
        table += markdown_table(
            ["concurrent", "samples", "limit reasons", "capacity streams", "engine bound", "codec bound",
             "engine margin", "codec margin", "loop period p50 / p99 ms", "codec pass p50 / p99 ms",
             "frames / pass", "lead p5 s", "playing streams"],
            [[_level_label(r), inputs["samples"],
              ", ".join(f"{k} {v}" for k, v in sorted((inputs.get("limit_reasons") or {}).items())) or "-",
              *(_spread(numbers.get(k)) for k in ("capacity_streams", "engine_capacity_streams",
                                                  "codec_capacity_streams", "engine_margin", "codec_margin")),
              f"{_spread(numbers.get('loop_period_ms_p50'))} / {_spread(numbers.get('loop_period_ms_p99'))}",
              f"{_spread(numbers.get('codec_pass_ms_p50'))} / {_spread(numbers.get('codec_pass_ms_p99'))}",
              *(_spread(numbers.get(k)) for k in ("codec_frames_per_pass", "lead_p5_s", "playing_streams"))]
             for r in sampled for inputs in [r["admission_inputs"]] for numbers in [inputs.get("numbers") or {}]])
    return table


def stage_table(stage: str, data: dict[str, Any]) -> str:
    return render_serve(data) if stage == "serve" and data.get("rows") else data.get("table", "")


# ----------------------------------------------------------------- the section


def stage_result(data: dict[str, Any], table: str) -> tuple[str, str]:
    """(FAILED | PARTIAL | ok, the problems as one line)."""
    problems = list(data.get("problems") or [])
    if not table.strip():
        problems.append("the stage measured nothing")
    if not data.get("ok") or not table.strip():
        return "FAILED", "; ".join(problems) or "no verdict recorded"
    if data.get("partial") or not data.get("complete"):
        return "PARTIAL", "; ".join(problems) or "cut short"
    return "ok", "; ".join(problems)


def profile_tables(profile: dict | None, title: str) -> str:
    """Markdown for a `profile` object (engine.json, serve.json; engines/profiling.py): one line per profiled
    batch (kernels per step, busy and idle), then its top kernels with their share of the device time."""
    if not profile:
        return ""
    failed = profile.get("failed") or []
    if not profile.get("batches"):
        if profile.get("status") in ("failed", "skipped"):  # serve.json: the sub-step as a whole
            return f"{title}: **{profile['status'].upper()}**: {profile.get('reason') or '-'}"
        if not failed:
            return ""
    out = [f"{title}:", "", "| batch | activity | steps | step ms | busy ms / step | kernels / step | idle share |",
           "|---|---|---|---|---|---|---|"]
    # A profiled step with no kernel (or one the bench marked failed) is no measurement: a FAILED row.
    out += [f"| {f.get('batch')} ({f.get('variant')}) | **FAILED**: {cell(f.get('reason'))} | - | - | - | - | - |"
            for f in failed]
    for b in profile.get("batches") or []:
        out.append(f"| {b['batch']} | {b['activity']} | {b['steps']} | {b['step_ms']} | {b['busy_ms_per_step']} | "
                   f"{b['kernels_per_step']} | {b['idle_share']:.1%} |")
    for b in profile.get("batches") or []:
        out += ["", f"Top kernels at batch {b['batch']}:", "", "| kernel | share | ms / step | calls / step |",
                "|---|---|---|---|"]
        out += [f"| `{k['name'].replace('|', '/')[:100]}` | {k['share']:.1%} | {k['ms_per_step']} | "
                f"{k['calls_per_step']} |" for k in b["top_kernels"]]
    others = profile.get("variants") or {}
    if others:
        out += ["", "Other variants, same batches:", "", "| variant | batch | step ms | kernels / step | idle share |",
                "|---|---|---|---|---|"]
        out += [f"| {name} | {b['batch']} | {b['step_ms']} | {b['kernels_per_step']} | {b['idle_share']:.1%} |"
                for name, batches in others.items() for b in batches]
    return "\n".join(out)


def machine(data: dict[str, Any]) -> str:
    env = data.get("env", {})
    return env.get("gpu") or f"CPU, {env.get('cpu_count')} cores"


def block_name(data: dict[str, Any]) -> str:
    """A stage's block (and file) name: its tag when it has one (a second serve pass), else the stage."""
    return str(data.get("tag") or data["stage"])


def block_order(name: str) -> tuple[int, str]:
    """Blocks in STAGE_TITLES' order, a tagged pass after its stage (a tag starts with its stage's name)."""
    stage = name if name in STAGE_TITLES else name.split("-", 1)[0]
    return (list(STAGE_TITLES).index(stage) if stage in STAGE_TITLES else len(STAGE_TITLES), name)


def stage_block(stage: str, data: dict[str, Any], folder: str) -> str:
    name = block_name({"stage": stage, **data})
    env = data.get("env", {})
    table = stage_table(stage, data)
    result, problems = stage_result(data, table)
    where = (f"{machine(data)}, driver {env.get('driver') or '-'}, torch {env.get('torch')} (CUDA "
             f"{env.get('torch_cuda')}), {env.get('date_utc')} UTC")
    if data.get("dry_run"):
        where += ", DRY RUN: tiny shapes on a CPU, not a measurement"
    if data.get("extra_overrides"):
        where += "; server settings added: " + ", ".join(f"`{o}`" for o in data["extra_overrides"])
    if result != "ok":
        where += f"; {result}: {problems}"
    label = stage if name == stage else f"{stage} ({name})"
    summary = SUMMARY.format(json.dumps([label, machine(data), env.get("date_utc"), result, problems, folder]))
    profile = profile_tables(data.get("profile"), f"Profile of the {stage} stage's steps (torch.profiler; idle: "
                             "no kernel running inside a step's wall time)")
    body = (table.strip() or "**FAILED**: nothing was measured.") + (f"\n\n{profile}" if profile else "")
    title = STAGE_TITLES[stage] + ("" if name == stage else f"; pass `{name}`")
    return (f"{STAGE_BEGIN.format(name)}\n{summary}\n### {title}\n\n{where}; stage took "
            f"{data.get('stage_seconds')} s. Raw results: `docs/gpu-results/{folder}/{name}.json`.\n\n"
            f"{body}\n{STAGE_END.format(name)}")


def overview(blocks: dict[str, str]) -> str:
    rows = []
    for name in sorted(blocks, key=block_order):
        match = re.search(r"^<!-- gpu-kit:summary (\[.*\]) -->$", blocks[name], flags=re.M)
        if match:
            label, card, date, result, problems, folder = json.loads(match.group(1))
            rows.append([label, card, date, f"**{result}**" if result != "ok" else result, problems or "-",
                         f"`docs/gpu-results/{folder}/`"])
    return markdown_table(["stage", "machine", "date (UTC)", "result", "problems", "raw results"], rows)


def run_block(folder: str, results: Path, note: str | None) -> str | None:
    """The run's line: its raw folder, the local edits it ran with (kit-edits.diff), a note; None if neither."""
    edits = results / EDITS_FILE
    if not edits.exists() and not note:
        return None
    text = f"Run `{folder}`"
    if note:
        text += f": {note.strip()}"
    if edits.exists():
        touched = sorted(set(re.findall(r"^\+\+\+ b/(\S+)", edits.read_text(), flags=re.M)))
        text += (f"{'.' if note else ':'} It ran with local edits to the kit, `docs/gpu-results/{folder}/{EDITS_FILE}` "
                 f"({', '.join(f'`{t}`' for t in touched) or 'no file named'}).")
    return f"{RUN_BEGIN.format(folder)}\n{text}\n{RUN_END.format(folder)}"


def existing_blocks(section: str, begin: str, end: str, names: list[str] | None = None) -> dict[str, str]:
    """Blocks between `begin`/`end` markers (formatted with each name; with names None, any name)."""
    out = {}
    pattern = re.escape(begin).replace(re.escape("{}"), r"(\S+)") + r".*?" + re.escape(end).replace(
        re.escape("{}"), r"\1")
    for match in re.finditer(pattern, section, flags=re.S):
        if names is None or match.group(1) in names:
            out[match.group(1)] = match.group(0)
    return out


def read_stages(results: Path, *, allow_dry_run: bool) -> dict[str, dict]:
    """Every stage's data in `results`, by block name (the stage, or a pass's tag); SystemExit naming each refused
    stage (nothing is written then). A JSON file that is no stage's (a bench's raw output) is left alone."""
    stages, refused = {}, []
    for json_path in sorted(results.glob("*.json")):
        try:
            data = json.loads(json_path.read_text())
        except ValueError:
            continue
        if not isinstance(data, dict) or data.get("stage") not in STAGE_TITLES:
            continue
        if data.get("dry_run") and not allow_dry_run:
            refused.append(f"{json_path}: results of a dry run; pass --allow-dry-run to merge them anyway")
        stages[block_name(data)] = data
    if refused:
        raise SystemExit("refused (nothing written):\n" + "\n".join(refused))
    if not stages:
        raise SystemExit(f"{results}: no STAGE.json ({', '.join(STAGE_TITLES)})")
    return stages


def raw_folder(stages: dict[str, dict]) -> str:
    """<date>-<card> of the run, e.g. 2026-12-01-h100-80gb-hbm3 (the vendor's name left out)."""
    data = next(iter(stages.values()))
    env = data.get("env", {})
    card = env.get("gpu") or ("cpu-dry-run" if data.get("dry_run") else "cpu")
    slug = re.sub(r"[^a-z0-9]+", "-", card.lower()).strip("-").removeprefix("nvidia-")
    return f"{str(env.get('date_utc', 'undated'))[:10]}-{slug}"


def merge(doc: str, stages: dict[str, dict], *, folder: str, run: str | None) -> str:
    """The document with its GPU section updated from `stages` (and the run's line, when there is one)."""
    if BEGIN in doc and END in doc:
        head, rest = doc.split(BEGIN, 1)
        old, tail = rest.split(END, 1)
    else:
        head, old, tail = doc.rstrip() + "\n\n", "", "\n"
    kept = existing_blocks(old, STAGE_BEGIN, STAGE_END)
    kept.update({name: stage_block(data["stage"], data, folder) for name, data in stages.items()})
    runs = existing_blocks(old, RUN_BEGIN, RUN_END)
    if run is not None:
        runs[folder] = run
    body = "\n\n".join(kept[name] for name in sorted(kept, key=block_order))
    section = (f"{BEGIN}\n## GPU: the torch backend on one card (scripts/gpu)\n\n"
               "Written by `scripts/gpu/report.py` from `bash scripts/gpu/run.sh STAGE...` on the machine named in "
               "each part (random weights in the exact Orpheus-3B shape; weight values do not change speed). "
               "A stage that failed is shown as FAILED with its problems and whatever it measured.\n\n"
               + "".join(f"{runs[name]}\n\n" for name in sorted(runs))
               + f"{overview(kept)}\n\n{body}\n{END}")
    return head + section + tail


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", type=Path)
    ap.add_argument("--doc", type=Path, default=ROOT / "docs" / "PERFORMANCE.md")
    ap.add_argument("--raw-root", type=Path, default=ROOT / "docs" / "gpu-results",
                    help="the run's files go to RAW_ROOT/<date>-<card>/")
    ap.add_argument("--note", help="a sentence on the run (e.g. what its local edits did)")
    ap.add_argument("--allow-dry-run", action="store_true")
    args = ap.parse_args(argv)
    stages = read_stages(args.results, allow_dry_run=args.allow_dry_run)
    folder = raw_folder(stages)
    text = merge(args.doc.read_text(), stages, folder=folder, run=run_block(folder, args.results, args.note))
    dest = args.raw_root / folder
    dest.mkdir(parents=True, exist_ok=True)
    for path in sorted(p for p in args.results.iterdir() if p.is_file()):
        shutil.copyfile(path, dest / path.name)
        print(f"{dest / path.name}: kept")
    args.doc.write_text(text)
    print(f"{args.doc}: GPU section updated ({', '.join(stages)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
