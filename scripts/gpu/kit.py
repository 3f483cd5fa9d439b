#!/usr/bin/env python3
"""GPU proof kit: the stages `scripts/gpu/run.sh` runs, each writing STAGE.json into the results folder.

    python scripts/gpu/kit.py STAGE --results DIR [--work DIR] [--deadline UNIX_TIME] [--dry-run]
                              [--tests NODE...] [--variants LIST] [--tag NAME] [--override KEY=VALUE]...
    python scripts/gpu/kit.py imports STAGE... [--dry-run]   # only import what the stages import

Stages (ARCHITECTURE §8; README.md plans the card run), one module each under scripts/gpu/stages/:

- serve:    the production server over gRPC, stepped concurrency levels, the admission inputs, a level with
            admission fixed at the slots, a profile of the engine core's steps (stages/serve.py). `--tag NAME`
            writes NAME.json (a second pass), `--override KEY=VALUE` (repeatable) adds server settings.
- base:     the engine bench's `base` row alone, in the server's own configuration (stages/engine.py).
- check:    nvidia-smi, the versions, `pytest -m gpu`, the riskiest test files first, under a session timeout
            short of the stage's deadline (stages/check.py). `--tests` runs the given files / node ids instead.
- codec:    the stateful SNAC decoder in FP16 on its own stream, graphs on and off (stages/codec.py).
- engine:   the other engine variants, the memory plan, the LoRA rows and the GEMM shapes (stages/engine.py).
            `--variants all` (or a comma list) measures those instead of the stage's own.
- compiled: the `compiled` variant alone (stages/engine.py).

Every stage rewrites its STAGE.json (numbers, a Markdown table, `ok`, `complete`, `partial`, `problems`) with
an atomic rename after every piece it measures, and stops starting new pieces as its deadline nears; at
SIGTERM (run.sh's `timeout`) it saves what it measured, `partial: true`. `--dry-run` runs the same code with
tiny shapes on the CPU (tiny random models), so the kit runs end to end on machines without a GPU. Models and
logs go under --work, outside the results folder (run.sh returns the logs as one archive).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

from scripts.gpu.stages.common import STAGES, import_stage_modules  # noqa: E402
from scripts.gpu.stages.runner import StageOptions, run_stage  # noqa: E402

OVERRIDE = re.compile(r"^[A-Za-z_][\w.]*=.*$")


def imports(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description="import what the stages import (and collect the GPU tests)")
    ap.add_argument("stages", nargs="+", choices=STAGES)
    ap.add_argument("--dry-run", action="store_true", help="accepted for symmetry with the stages")
    args = ap.parse_args(argv)
    failures = [line for stage in args.stages for line in import_stage_modules(stage)]
    if "check" in args.stages and not failures:
        from scripts.gpu.stages.check import gpu_test_files, pytest_command

        cmd, env = pytest_command(gpu_test_files(), "--collect-only")
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, **env})
        print(proc.stdout[-2000:] + proc.stderr[-2000:])
        if proc.returncode != 0:
            failures.append(f"pytest --collect-only -m gpu exited {proc.returncode}")
    for line in failures:
        print(f"cannot import {line}", file=sys.stderr)
    print("imports: " + ("FAILED" if failures else "ok") + f" ({', '.join(args.stages)})")
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["imports"]:
        return imports(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=STAGES)
    ap.add_argument("--results", type=Path, required=True, help="where STAGE.json goes")
    ap.add_argument("--work", type=Path, default=Path(os.environ.get("KIT_WORK", "/tmp/orpheus-gpu-kit")),
                    help="models and logs (kept between stages on one machine)")
    ap.add_argument("--deadline", type=float, default=None, help="Unix time the stage must be done by")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU")
    ap.add_argument("--tests", nargs="+", default=None, metavar="NODE",
                    help="check: run these test files / node ids (`-m gpu` still applies) instead of the GPU tests")
    ap.add_argument("--variants", default=None, help="engine: a comma list of variants, or `all`")
    ap.add_argument("--tag", default=None, help="serve: write TAG.json (a second pass with other settings)")
    ap.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                    help="serve: a server setting after the stage's own (repeatable)")
    args = ap.parse_args(argv)
    if args.tests and args.stage != "check":
        ap.error("--tests is the check stage's")
    if args.variants and args.stage != "engine":
        ap.error("--variants is the engine stage's (base and compiled measure their one variant)")
    if (args.tag or args.override) and args.stage != "serve":
        ap.error("--tag and --override are the serve stage's")
    if args.tag is not None and (not re.fullmatch(r"[a-z0-9][a-z0-9-]*", args.tag) or args.tag in STAGES):
        ap.error(f"--tag {args.tag!r}: lower-case letters, digits and dashes, not a stage's name")
    for override in args.override:
        if not OVERRIDE.match(override):
            ap.error(f"--override {override!r}: KEY=VALUE")
    variants = [v for v in args.variants.split(",") if v] if args.variants else None
    deadline = args.deadline if args.deadline is not None else time.time() + 540
    options = StageOptions(tests=args.tests, variants=variants, overrides=args.override, tag=args.tag)
    return run_stage(args.stage, results=args.results, work=args.work, deadline=deadline, dry_run=args.dry_run,
                     options=options)


if __name__ == "__main__":
    sys.exit(main())
