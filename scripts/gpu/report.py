#!/usr/bin/env python3
"""Merge the GPU kit's stage results into the GPU section of docs/PERFORMANCE.md.

    python scripts/gpu/report.py RESULTS_DIR [--doc docs/PERFORMANCE.md] [--allow-dry-run]

Reads STAGE.json and STAGE.md for every stage present in RESULTS_DIR (written by
`scripts/gpu/run.sh`) and writes them, with the machine and date, between the markers below.
A stage missing from RESULTS_DIR keeps what the section already had for it, so stages run in
separate calls (or on separate days) add up. Results of a dry run (CPU, tiny shapes) are refused
unless --allow-dry-run: their numbers say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BEGIN = "<!-- gpu-kit:begin -->"
END = "<!-- gpu-kit:end -->"
STAGE_TITLES = {
    "check": "Check: the card, the versions, `pytest -m gpu`",
    "engine": "Engine: decode steps of the Orpheus-3B shape (torch backend, bf16)",
    "codec": "Codec: stateful SNAC decode in FP16 on its own stream",
    "serve": "Serve: the real server over gRPC, scaling to 256 concurrent streams",
}
STAGE_BEGIN = "<!-- gpu-kit:stage {} -->"
STAGE_END = "<!-- gpu-kit:stage-end {} -->"


def stage_block(stage: str, data: dict, table: str) -> str:
    env = data.get("env", {})
    machine = env.get("gpu") or f"CPU, {env.get('cpu_count')} cores"
    where = f"{machine}, torch {env.get('torch')} (CUDA {env.get('torch_cuda')}), {env.get('date_utc')} UTC"
    if data.get("dry_run"):
        where += ", DRY RUN: tiny shapes on a CPU, not a measurement"
    return (f"{STAGE_BEGIN.format(stage)}\n### {STAGE_TITLES[stage]}\n\n{where}; stage took "
            f"{data.get('stage_seconds')} s.\n\n{table.strip()}\n{STAGE_END.format(stage)}")


def existing_stages(section: str) -> dict[str, str]:
    out = {}
    for stage in STAGE_TITLES:
        match = re.search(re.escape(STAGE_BEGIN.format(stage)) + r".*?" + re.escape(STAGE_END.format(stage)),
                          section, flags=re.S)
        if match:
            out[stage] = match.group(0)
    return out


def merge(doc: str, results: Path, *, allow_dry_run: bool) -> tuple[str, list[str]]:
    """The document with its GPU section updated from `results`, and the stages taken from there."""
    blocks: dict[str, str] = {}
    taken = []
    for stage in STAGE_TITLES:
        json_path, md_path = results / f"{stage}.json", results / f"{stage}.md"
        if not (json_path.exists() and md_path.exists()):
            continue
        data = json.loads(json_path.read_text())
        if data.get("dry_run") and not allow_dry_run:
            raise SystemExit(f"{json_path}: results of a dry run; pass --allow-dry-run to merge them anyway")
        blocks[stage] = stage_block(stage, data, md_path.read_text())
        taken.append(stage)
    if not taken:
        raise SystemExit(f"{results}: no STAGE.json + STAGE.md pairs ({', '.join(STAGE_TITLES)})")

    if BEGIN in doc and END in doc:
        head, rest = doc.split(BEGIN, 1)
        old, tail = rest.split(END, 1)
    else:
        head, old, tail = doc.rstrip() + "\n\n", "", "\n"
    kept = existing_stages(old)
    kept.update(blocks)
    body = "\n\n".join(kept[s] for s in STAGE_TITLES if s in kept)
    section = (f"{BEGIN}\n## GPU: the torch backend on one card (scripts/gpu)\n\n"
               "Written by `scripts/gpu/report.py` from `bash scripts/gpu/run.sh STAGE` on the machine named in "
               "each part (random weights in the exact Orpheus-3B shape; weight values do not change speed).\n\n"
               f"{body}\n{END}")
    return head + section + tail, taken


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", type=Path)
    ap.add_argument("--doc", type=Path, default=ROOT / "docs" / "PERFORMANCE.md")
    ap.add_argument("--allow-dry-run", action="store_true")
    args = ap.parse_args(argv)
    text, taken = merge(args.doc.read_text(), args.results, allow_dry_run=args.allow_dry_run)
    args.doc.write_text(text)
    print(f"{args.doc}: GPU section updated ({', '.join(taken)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
