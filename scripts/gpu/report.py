#!/usr/bin/env python3
"""Merge the GPU kit's stage results into docs/PERFORMANCE.md and keep their raw JSON.

    python scripts/gpu/report.py RESULTS_DIR [--doc docs/PERFORMANCE.md] [--raw-root docs/gpu-results]
                                 [--allow-dry-run]

Reads STAGE.json for every stage present in RESULTS_DIR (written by `scripts/gpu/run.sh`), copies
each to RAW_ROOT/<date>-<card>/STAGE.json (small; committed with the report), and writes its table,
with the card, driver, torch/CUDA versions and date, between the markers below. A stage missing from
RESULTS_DIR keeps what the section already had for it, so stages run in separate calls add up.

Refused, with nothing written: a stage that failed (`ok` false: a failed GPU test, no GPU test passed,
a bench that raised...) or measured nothing, and results of a dry run (CPU, tiny shapes) unless
--allow-dry-run: their numbers say nothing about a GPU. A stage cut short by its deadline with
measurements is merged, marked as partial.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BEGIN = "<!-- gpu-kit:begin -->"
END = "<!-- gpu-kit:end -->"
STAGE_TITLES = {
    "check": "Check: the card, the versions, `pytest -m gpu`",
    "engine": "Engine: decode steps of the Orpheus-3B shape (torch backend, bf16)",
    "codec": "Codec: stateful SNAC decode in FP16 on its own stream",
    "serve": "Serve: the production server over gRPC (engine core in its own process), stepped concurrency",
}
STAGE_BEGIN = "<!-- gpu-kit:stage {} -->"
STAGE_END = "<!-- gpu-kit:stage-end {} -->"


def profile_tables(profile: dict | None, title: str) -> str:
    """Markdown for a `profile` object (engine.json, serve.json; engines/profiling.py): one line per profiled
    batch (kernels per step, busy and idle), then its top kernels with their share of the device time."""
    if not profile or not profile.get("batches"):
        return ""
    out = [f"{title}:", "", "| batch | activity | steps | step ms | busy ms / step | kernels / step | idle share |",
           "|---|---|---|---|---|---|---|"]
    for b in profile["batches"]:
        out.append(f"| {b['batch']} | {b['activity']} | {b['steps']} | {b['step_ms']} | {b['busy_ms_per_step']} | "
                   f"{b['kernels_per_step']} | {b['idle_share']:.1%} |")
    for b in profile["batches"]:
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


def stage_block(stage: str, data: dict, table: str) -> str:
    env = data.get("env", {})
    machine = env.get("gpu") or f"CPU, {env.get('cpu_count')} cores"
    where = (f"{machine}, driver {env.get('driver') or '-'}, torch {env.get('torch')} (CUDA {env.get('torch_cuda')}), "
             f"{env.get('date_utc')} UTC")
    if data.get("dry_run"):
        where += ", DRY RUN: tiny shapes on a CPU, not a measurement"
    if not data.get("complete"):
        where += "; PARTIAL: " + "; ".join(data.get("problems") or ["cut short"])
    profile = profile_tables(data.get("profile"), f"Profile of the {stage} stage's steps (torch.profiler; idle: "
                             "no kernel running inside a step's wall time)")
    table = table.strip() + (f"\n\n{profile}" if profile else "")
    return (f"{STAGE_BEGIN.format(stage)}\n### {STAGE_TITLES[stage]}\n\n{where}; stage took "
            f"{data.get('stage_seconds')} s.\n\n{table}\n{STAGE_END.format(stage)}")


def refusal(data: dict, *, allow_dry_run: bool) -> str | None:
    """Why a stage's results must not be merged, or None."""
    if data.get("dry_run") and not allow_dry_run:
        return "results of a dry run; pass --allow-dry-run to merge them anyway"
    if not data.get("ok"):
        return "the stage failed: " + ("; ".join(data.get("problems") or []) or "no verdict recorded")
    if not data.get("table", "").strip():
        return "the stage measured nothing"
    return None


def raw_folder(data: dict) -> str:
    """<date>-<card>, e.g. 2026-12-01-nvidia-h100-80gb-hbm3."""
    env = data.get("env", {})
    card = env.get("gpu") or ("cpu-dry-run" if data.get("dry_run") else "cpu")
    slug = re.sub(r"[^a-z0-9]+", "-", card.lower()).strip("-")
    return f"{str(env.get('date_utc', 'undated'))[:10]}-{slug}"


def existing_stages(section: str) -> dict[str, str]:
    out = {}
    for stage in STAGE_TITLES:
        match = re.search(re.escape(STAGE_BEGIN.format(stage)) + r".*?" + re.escape(STAGE_END.format(stage)),
                          section, flags=re.S)
        if match:
            out[stage] = match.group(0)
    return out


def read_stages(results: Path, *, allow_dry_run: bool) -> dict[str, dict]:
    """Every stage's data in `results`; SystemExit naming each refused stage (nothing is written then)."""
    stages, refused = {}, []
    for stage in STAGE_TITLES:
        json_path = results / f"{stage}.json"
        if not json_path.exists():
            continue
        data = json.loads(json_path.read_text())
        why = refusal(data, allow_dry_run=allow_dry_run)
        if why:
            refused.append(f"{json_path}: {why}")
        stages[stage] = data
    if refused:
        raise SystemExit("refused (nothing written):\n" + "\n".join(refused))
    if not stages:
        raise SystemExit(f"{results}: no STAGE.json ({', '.join(STAGE_TITLES)})")
    return stages


def merge(doc: str, stages: dict[str, dict]) -> tuple[str, list[str]]:
    """The document with its GPU section updated from `stages`, and the stages taken."""
    blocks = {stage: stage_block(stage, data, data["table"]) for stage, data in stages.items()}
    taken = list(blocks)

    if BEGIN in doc and END in doc:
        head, rest = doc.split(BEGIN, 1)
        old, tail = rest.split(END, 1)
    else:
        head, old, tail = doc.rstrip() + "\n\n", "", "\n"
    kept = existing_stages(old)
    kept.update(blocks)
    body = "\n\n".join(kept[s] for s in STAGE_TITLES if s in kept)
    section = (f"{BEGIN}\n## GPU: the torch backend on one card (scripts/gpu)\n\n"
               "Written by `scripts/gpu/report.py` from `bash scripts/gpu/run.sh STAGE...` on the machine named in "
               "each part (random weights in the exact Orpheus-3B shape; weight values do not change speed). "
               "Raw results: `docs/gpu-results/<date>-<card>/`.\n\n"
               f"{body}\n{END}")
    return head + section + tail, taken


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", type=Path)
    ap.add_argument("--doc", type=Path, default=ROOT / "docs" / "PERFORMANCE.md")
    ap.add_argument("--raw-root", type=Path, default=ROOT / "docs" / "gpu-results",
                    help="the raw STAGE.json files go to RAW_ROOT/<date>-<card>/")
    ap.add_argument("--allow-dry-run", action="store_true")
    args = ap.parse_args(argv)
    stages = read_stages(args.results, allow_dry_run=args.allow_dry_run)
    text, taken = merge(args.doc.read_text(), stages)
    for stage, data in stages.items():
        folder = args.raw_root / raw_folder(data)
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(args.results / f"{stage}.json", folder / f"{stage}.json")
        print(f"{folder / (stage + '.json')}: raw results kept")
    args.doc.write_text(text)
    print(f"{args.doc}: GPU section updated ({', '.join(taken)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
