"""One stage's run: imports checked first, the machine's environment, the stage itself, and its verdict in
STAGE.json. A stage killed at its deadline (SIGTERM from run.sh's `timeout`) saves what it measured, marked
partial, before the KILL that follows 10 s later."""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scripts.gpu.stages.common import (
    DEADLINE,
    DRY,
    REAL,
    SUBSTEP_FAILED,
    StageKilled,
    StageRun,
    environment,
    import_stage_modules,
    raise_on_sigterm,
)


@dataclass(frozen=True)
class StageOptions:
    """What a stage may be told beyond its shapes and deadline."""

    tests: list[str] | None = None  # check: these test files / node ids instead of every GPU test file
    variants: list[str] | None = None  # engine: these variants (["all"]: every one) instead of its own
    overrides: list[str] = field(default_factory=list)  # serve: server settings after the stage's own
    tag: str | None = None  # serve: the file is TAG.json (a second pass with other settings)


def measured(stage: str, data: dict[str, Any]) -> bool:
    """Whether the stage has anything to show."""
    if stage == "check":
        return bool(data.get("pytest"))
    if stage in ("base", "engine", "compiled"):
        return bool(data.get("bench", {}).get("rows"))
    return bool(data.get("rows"))


def verdict(run: StageRun) -> bool:
    """`ok`: something measured, and no problem but a deadline or a failed sub-step (recorded as such beside
    numbers that stand): those make a stage partial, not failed."""
    return measured(run.stage, run.data) and not [p for p in run.data["problems"]
                                                   if not p.endswith((DEADLINE, SUBSTEP_FAILED))]


def call_stage(run: StageRun, options: StageOptions) -> None:
    if run.stage == "check":
        from scripts.gpu.stages.check import stage_check

        stage_check(run, options.tests)
    elif run.stage in ("base", "engine", "compiled"):
        from scripts.gpu.stages.engine import stage_engine

        stage_engine(run, options.variants)
    elif run.stage == "codec":
        from scripts.gpu.stages.codec import stage_codec

        stage_codec(run)
    elif run.stage == "serve":
        from scripts.gpu.stages.serve import stage_serve

        stage_serve(run, options.overrides)
    else:
        raise ValueError(f"unknown stage {run.stage}")


def run_stage(stage: str, *, results: Path, work: Path, deadline: float, dry_run: bool,
              options: StageOptions | None = None) -> int:
    options = options or StageOptions()
    shapes = DRY if dry_run else REAL
    run = StageRun(stage, shapes, results=results, work=work, deadline=deadline, dry_run=dry_run, tag=options.tag)
    if options.overrides:
        run.data["extra_overrides"] = list(options.overrides)
    raise_on_sigterm()
    try:
        missing = import_stage_modules(stage)
        if missing:
            for line in missing:
                run.problem(f"cannot import {line}")
            run.save()
            return 1
        import torch

        if not dry_run and not torch.cuda.is_available():
            run.problem("no CUDA device: run with --dry-run on a machine without a GPU")
            run.save()
            return 2
        if dry_run:
            torch.set_num_threads(1)  # a dry run shares small machines; its numbers mean nothing anyway
        run.data["env"] = environment()
        run.save()
        call_stage(run, options)
    except StageKilled:
        run.data["complete"] = False
        run.data["killed"] = "SIGTERM: the stage's deadline"
        run.problem(f"killed before it finished; what it measured until then stands {DEADLINE}")
    except Exception:
        run.problem("stage raised:\n" + traceback.format_exc()[-3000:])
        run.save()
        return 1
    run.data["ok"] = verdict(run)
    run.save()
    print(f"{stage}: {'ok' if run.data['ok'] else 'FAILED'}{'' if run.data['complete'] else ' (partial)'}, wrote "
          f"{run.path} in {run.data['stage_seconds']} s", flush=True)
    return 0 if run.data["ok"] else 1
