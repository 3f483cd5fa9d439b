"""The engine stages: `scripts/bench_engine.py --variants` on an Orpheus-3B-shaped random checkpoint (the exact
config of canopylabs/orpheus-3b-0.1-ft; weight values do not change speed), weights loaded once, one engine per
variant: decode step ms and tokens/s at batch 1, 128 and 256 with KV lengths up to 1,024 (one CUDA-graph
bucket), graphs on, the constraint on, the attention the server picks, each engine's build time, and a
torch.profiler profile of its step at batch 1 and 256.

- base:     the `base` row alone (the server's own configuration), base.json.
- engine:   the other variants (fused, fp8kv, fp8w, fused+fp8kv, fused+fp8w; every one with --variants all),
            then the memory plan (slots that fit) and two sub-steps, each skipped (and said so) when too little
            of the stage's time is left: bench_lora.py (rows lora0/lora8/lora32) and bench_fp8_gemm.py.
- compiled: the `compiled` row alone (engine.compile; its compilation is its build time), compiled.json.

A variant this tree cannot build is a row marked skipped, with the reason; one that fails, failed; a profile
that recorded no kernel is a failed profile row, never a number. The bench's rows reach STAGE.json while it
runs (its JSON is read every 2 s): a stage killed mid-bench keeps every variant measured.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from scripts.gpu.report import markdown_table
from scripts.gpu.stages.common import (
    DEADLINE,
    ROOT,
    SUBSTEP_FAILED,
    Shapes,
    StageRun,
    ensure_models,
    substep_failed,
    substep_skipped,
)

ALONE = {"base": "base", "compiled": "compiled"}  # the stages that measure one variant, each its own file
BENCH_ENGINE = ROOT / "scripts" / "bench_engine.py"


def stage_variants(stage: str, shapes: Shapes, requested: list[str] | None = None) -> list[str]:
    """The variants `stage` measures: its one for base and compiled; for engine, `requested` (["all"]: every
    one), by default every variant but those two."""
    if stage in ALONE:
        return [ALONE[stage]]
    if requested == ["all"]:
        return list(shapes.variants)
    if requested:
        unknown = [v for v in requested if v not in shapes.variants]
        if unknown:
            raise ValueError(f"unknown variants {unknown}: {shapes.variants}")
        return [v for v in shapes.variants if v in requested]
    return [v for v in shapes.variants if v not in ALONE.values()]


def bench_accepts_attention() -> bool:
    """Whether this tree's bench_engine.py has --attention (older ones ran the engine's default attention)."""
    return '"--attention"' in BENCH_ENGINE.read_text()


def stage_engine(run: StageRun, variants: list[str] | None = None) -> None:
    """The variants of this stage (stage_variants), then for the engine stage the memory plan and the LoRA and
    GEMM sub-steps. README.md states the call plan."""
    shapes = run.shapes
    variants = stage_variants(run.stage, shapes, variants)
    substeps = run.stage == "engine"
    llama, _ = ensure_models(run)
    kept = shapes.lora_reserve_s + shapes.gemm_min_s if substeps else 0.0
    run.data.update(model=llama.name, variants_planned=variants, bench={"rows": [], "skipped": [], "profiles": []},
                    slots_that_fit=[], sdpa=[], variants=variant_rows(variants, {"rows": []}, shapes, lora=None),
                    profile=engine_profile({"profiles": []}, variants[0]))

    def merge(bench: dict[str, Any]) -> None:
        run.data.update(bench=bench, sdpa=sorted({str(r.get("sdpa")) for r in bench["rows"]}),
                        profile=engine_profile(bench, variants[0]))
        run.data["variants"] = variant_rows(variants, bench, shapes, run.data.get("lora") if substeps else None)
        render_engine(run)

    bench, code = _engine_bench(run, llama, tag=f"{run.stage}-variants", variants=variants,
                                # The sub-steps' time is kept back (the bench is stopped there if it runs on); no
                                # variant starts in the last 25 s before it: one engine at batch 256 takes about
                                # 20 s to build and measure.
                                deadline=run.deadline - kept - (25 if substeps else 10), reserve_s=kept,
                                on_bench=merge)
    if code not in (0, 124):
        run.problem(f"bench_engine.py exited {code}")
    for failed in (s for s in bench.get("skipped", []) if s.get("failed")):
        run.problem(f"variant {failed['variant']}: {failed['reason']} {SUBSTEP_FAILED}")
    if not bench.get("complete") and not any(s.get("failed") for s in bench.get("skipped", [])):
        run.problem(f"not every variant was measured {DEADLINE}")
    for failed in run.data["profile"].get("failed", []):
        run.problem(f"profile of {failed['variant']} at batch {failed['batch']}: {failed['reason']} {SUBSTEP_FAILED}")
    if not bench["rows"]:
        run.problem("no engine configuration was measured")
    run.data["complete"] = bool(bench.get("complete")) and code == 0
    if not substeps:
        render_engine(run)
        return
    from scripts.bench_engine import memory_plan

    # Nothing else holds the card now: the plan is against its real free memory.
    run.data["slots_that_fit"] = [memory_plan(llama, slots=max(shapes.variant_batches), max_seq_len=n,
                                              device=shapes.device, dtype=shapes.dtype)
                                  for n in shapes.memory_plan_seq_lens]
    render_engine(run)
    run.save()
    run.data["lora"] = engine_lora(run, llama)
    run.data["variants"] = variant_rows(variants, bench, shapes, run.data["lora"])
    render_engine(run)
    run.save()
    run.data["gemm"] = engine_gemm_shapes(run, llama)
    render_engine(run)
    run.data["complete"] = run.data["complete"] and all(
        run.data[k].get("status") == "measured" for k in ("lora", "gemm"))


def profile_failure(entry: dict[str, Any]) -> str | None:
    """Why a profiled step is no measurement, or None: the bench said it failed, or it recorded no kernel."""
    if entry.get("status") == "failed" or entry.get("failed") or entry.get("error"):
        return str(entry.get("reason") or entry.get("error") or "the profile failed")
    if not entry.get("kernels_per_step"):
        return "the profile recorded no kernels"
    return None


def engine_profile(bench: dict[str, Any], variant: str) -> dict[str, Any]:
    """STAGE.json's `profile`: the profiled steps of `variant` per batch size (kernels per step, top kernels, idle
    share; engines/profiling.py), every other variant's under `variants`, and under `failed` each profiled step
    that is no measurement (with the reason); status `failed` when `variant` has no good profile but failed ones."""
    by_variant: dict[str, list[dict[str, Any]]] = {}
    failed: list[dict[str, Any]] = []
    for entry in bench.get("profiles", []):
        reason = profile_failure(entry)
        if reason is None:
            by_variant.setdefault(entry["variant"], []).append(entry)
        else:
            failed.append({"variant": entry.get("variant"), "batch": entry.get("batch"), "reason": reason})
    batches = by_variant.pop(variant, [])
    status = "failed" if failed and not batches else "measured" if batches else "not measured"
    return {"variant": variant, "status": status, "batches": batches, "variants": by_variant, "failed": failed}


def variant_rows(variants: list[str], bench: dict[str, Any], shapes: Shapes,
                 lora: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """One row per named variant, in the kit's order: measured (step ms and tokens/s per batch size, the
    engine's build time, the attention that ran), or skipped / failed / not measured with the reason, never a
    number. With `lora` (the engine stage), a row per adapter count after them."""
    skipped = {s["variant"]: (s["reason"], "failed" if s.get("failed") else "skipped") for s in bench.get("skipped", [])}
    out: list[dict[str, Any]] = []
    for name in variants:
        rows = [r for r in bench["rows"] if r["variant"] == name]
        if rows:
            out.append({"variant": name, "status": "measured", "build_s": rows[0].get("build_s"),
                        "attention": rows[0].get("attention"),
                        # A compiled engine's compilations (at build, in all, after warm-up: 0 as designed, one
                        # compile serves every padded batch); the bench measured each batch after the warm-up.
                        **({"compiles": rows[0]["compiles"]} if rows[0].get("compiles") else {}),
                        "kv_lens": f"{rows[0]['kv_len_first']}-{rows[0]['kv_len_last']}",
                        "slots_fit": rows[0].get("slots_fit"),
                        "step_ms": {str(r["batch"]): r["step_ms"] for r in rows},
                        "tokens_per_s": {str(r["batch"]): r["tokens_per_s"] for r in rows}})
        else:
            reason, status = skipped.get(name, ("not measured (deadline or a failed run)", "skipped"))
            out.append({"variant": name, "status": status, "reason": reason})
    if lora is None:
        return out
    for count in shapes.lora_counts:
        name = f"lora{count}"
        row = next((r for r in lora.get("rows", []) if r["adapters"] == count), None)
        if row is not None:
            out.append({"variant": name, "status": "measured", "batch": row["batch"],
                        "step_ms": {str(row["batch"]): row["step_ms"]},
                        "tokens_per_s": {str(row["batch"]): row["tokens_per_s"]}, "vs_base": row.get("vs_base")})
        else:
            out.append({"variant": name, "status": "skipped", "reason": lora.get("reason") or "LoRA sub-step not run yet"})
    return out


def _engine_bench(run: StageRun, llama: Path, *, tag: str, variants: list[str], deadline: float,
                  reserve_s: float = 0.0, on_bench: Any = None) -> tuple[dict[str, Any], int]:
    """One `bench_engine.py` run of `variants`: (its JSON, its exit code). `on_bench` gets the JSON as it grows."""
    shapes = run.shapes
    raw = run.work / f"{tag}.json"
    raw.unlink(missing_ok=True)  # never report an earlier run's rows
    cmd = [sys.executable, str(BENCH_ENGINE), "--presets", "", "--model", str(llama),
           "--device", shapes.device, "--dtype", shapes.dtype, "--contexts-are-kv-tops",
           "--batches", ",".join(map(str, shapes.variant_batches)), "--contexts", str(shapes.variant_context),
           "--graphs", "on", "--constrained", shapes.constrained, "--steps", str(shapes.steps),
           "--rounds", str(shapes.rounds), "--warmup", str(shapes.warmup), "--json", str(raw),
           "--deadline", str(deadline), "--variants", ",".join(variants),
           "--profile-batches", ",".join(map(str, shapes.profile_batches))]
    if bench_accepts_attention():
        cmd += ["--attention", shapes.attention]
        run.data["attention_requested"] = shapes.attention
    else:
        run.data["attention_requested"] = None  # this tree's bench runs the engine's default attention
    if run.dry_run:
        cmd += ["--threads", "1"]
    empty: dict[str, Any] = {"rows": [], "memory_plans": [], "complete": False, "profiles": [], "skipped": []}
    seen = {"mtime": 0.0}

    def read() -> dict[str, Any]:
        try:
            return {**empty, **json.loads(raw.read_text())}
        except (OSError, ValueError):  # not written yet
            return dict(empty)

    def progress() -> None:
        if on_bench is None or not raw.exists() or raw.stat().st_mtime == seen["mtime"]:
            return
        seen["mtime"] = raw.stat().st_mtime
        on_bench(read())
        run.save()

    # Triton on a CPU (the dry run) runs in its interpreter only.
    proc = run.run(cmd, log_name=f"{tag}.log", reserve_s=20 + reserve_s, on_progress=progress,
                   env={"TRITON_INTERPRET": "1"} if run.dry_run else None)
    bench = read()
    if on_bench is not None:
        on_bench(bench)
    return bench, proc.returncode


def engine_lora(run: StageRun, llama: Path) -> dict[str, Any]:
    """Decode of one batch with 0, 8 and 32 distinct LoRA adapters (bench_lora.py), graphs on."""
    shapes = run.shapes
    name = f"LoRA adapters in a batch of {shapes.lora_batch}"
    if run.left() < shapes.lora_reserve_s:
        return substep_skipped(run, name, f"{run.left():.0f} s left, {shapes.lora_reserve_s:.0f} s needed")
    raw = run.work / "engine-lora.json"
    raw.unlink(missing_ok=True)
    # Written once per machine (kept with the models): random, PEFT's format, the project's own writer.
    adapters = run.work / "models" / f"lora-{llama.name}-r{shapes.lora_rank}"
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_lora.py"), "--presets", "", "--model", str(llama),
           "--adapters-dir", str(adapters), "--write-adapters", "--device", shapes.device, "--dtype", shapes.dtype,
           "--batch", str(shapes.lora_batch), "--adapters", ",".join(map(str, shapes.lora_counts)),
           "--rank", str(shapes.lora_rank), "--steps", str(shapes.lora_steps), "--rounds", str(shapes.lora_rounds),
           "--graphs", "on", "--json", str(raw)]
    if run.dry_run:
        cmd += ["--threads", "1"]
    proc = run.run(cmd, log_name="engine-lora.log", reserve_s=10)
    if proc.returncode == 124:
        return {"status": "skipped", "reason": "cut short by the stage's deadline", "rows": []}
    if proc.returncode != 0 or not raw.exists():
        return substep_failed(run, name, f"bench_lora.py exited {proc.returncode}: {proc.stdout[-400:]}")
    data = json.loads(raw.read_text())
    counts = [r["adapters"] for r in data["rows"]]
    if counts != shapes.lora_counts:
        return substep_failed(run, name, f"measured adapter counts {counts}, expected {shapes.lora_counts}")
    return {"status": "measured", "adapters_dir": str(adapters), **data}


def engine_gemm_shapes(run: StageRun, llama: Path) -> dict[str, Any]:
    """The decoder's four GEMM shapes in bf16 and FP8 (scripts/bench_fp8_gemm.py) at the variant batch sizes."""
    shapes = run.shapes
    name = "FP8 GEMMs per shape"
    if run.left() < shapes.gemm_min_s:
        return substep_skipped(run, name, f"{run.left():.0f} s left, {shapes.gemm_min_s:.0f} s needed")
    raw = run.work / "engine-gemm.json"
    raw.unlink(missing_ok=True)
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_fp8_gemm.py"), "--model", str(llama), "--device",
           shapes.device, "--batches", ",".join(map(str, shapes.gemm_batches)), "--json", str(raw)]
    if run.dry_run:
        cmd += ["--threads", "1", "--iters", "2"]
    proc = run.run(cmd, log_name="engine-gemm.log", reserve_s=5)
    if proc.returncode == 124:
        return {"status": "skipped", "reason": "cut short by the stage's deadline", "rows": []}
    if proc.returncode != 0 or not raw.exists():
        return substep_failed(run, name, f"bench_fp8_gemm.py exited {proc.returncode}: {proc.stdout[-400:]}")
    return {"status": "measured", **json.loads(raw.read_text())}


def render_engine(run: StageRun) -> None:
    data = run.data
    shapes = run.shapes
    batches = [str(b) for b in shapes.variant_batches]
    variants = [v for v in data.get("variants", []) if not v["variant"].startswith("lora")]
    # The attention each row ran (bench_engine.py's `attention`), a column once the bench reports it.
    attention = any(v.get("attention") for v in variants)
    columns = 2 * len(batches) + 2 + int(attention)
    run.table = markdown_table(
        ["variant", "KV lengths", *(["attention"] if attention else []), *(f"batch {b} ms" for b in batches),
         *(f"batch {b} tok/s" for b in batches), "build s", "slots that fit"],
        [[v["variant"], v.get("kv_lens", "-"), *([v.get("attention")] if attention else []),
          *(v["step_ms"].get(b, "-") for b in batches), *(v["tokens_per_s"].get(b, "-") for b in batches),
          v.get("build_s", "-"), v.get("slots_fit", "-")]
         if v["status"] == "measured" else [v["variant"], f"**{v['status'].upper()}**: {v['reason']}",
                                            *(["-"] * columns)]
         for v in variants])
    run.table += (f"\n\nDecode step per variant (`variants`), KV lengths up to {shapes.variant_context:,}, "
                  f"CUDA graphs on where the device has them, constrained; build s: the engine's start (caches, "
                  f"compilation, graphs)" + (f"; the lora rows (a batch of {shapes.lora_batch}) follow."
                                             if run.stage == "engine" else "."))
    run.table += f"\n\nAttention (SDPA) kernel: {', '.join(data.get('sdpa') or []) or '-'}."
    for v in variants:
        if compiles := v.get("compiles"):
            run.table += (f"\n\n{v['variant']}: {compiles['at_build']} compilation(s) at build, "
                          f"{compiles['after_warm_up']} after warm-up (0: one compile served every batch size).")
    if plans := data.get("slots_that_fit"):
        run.table += "\n\nMemory plan (engine planner, 90% of the free memory measured with nothing loaded):\n\n"
        run.table += markdown_table(
            ["slots", "max_seq_len", "free GiB", "weights GiB", "KV MiB / slot", "budget GiB", "slots that fit"],
            [[p["slots"], p["max_seq_len"], p["free_gib_measured"], p["weights_gib"], p["kv_mib_per_slot"],
              p["budget_gib"], p["max_slots"]] for p in plans])
    if lora := data.get("lora"):
        graphs = "on" if any(r.get("graphs") for r in lora["rows"]) else "off"
        run.table += (f"\n\nLoRA adapters in a batch of {shapes.lora_batch} (rows lora0/lora8/lora32; rank "
                      f"{shapes.lora_rank}, q,k,v,o,gate,up,down; CUDA graphs {graphs}; pool of "
                      f"{max(shapes.lora_counts)}; session i uses adapter i mod N):")
        run.table += "\n\n" + (markdown_table(
            ["variant", "distinct adapters", "step ms", "tokens/s", "vs no adapters"],
            [[f"lora{r['adapters']}", r["adapters"], r["step_ms"], r["tokens_per_s"], r["vs_base"]]
             for r in lora["rows"]])
            if lora["status"] == "measured" else f"**{lora['status'].upper()}**: {lora['reason']}")
    if gemm := data.get("gemm"):
        run.table += ("\n\nDecoder GEMMs per shape (`scripts/bench_fp8_gemm.py`): bf16 against FP8 "
                      "`torch._scaled_mm` (row-major A, column-major B), per-row scales and one scale per tensor, "
                      "activation quantisation not included:")
        run.table += "\n\n" + (markdown_table(
            ["GEMM", "M", "N x K", "bf16 us", "fp8 rowwise us", "fp8 tensorwise us", "best / bf16"],
            [[r["gemm"], r["m"], f"{r['n']} x {r['k']}", r["bf16_us"], r["fp8_rowwise_us"],
              r["fp8_tensorwise_us"], r["best_vs_bf16"]] for r in gemm["rows"]])
            if gemm["status"] == "measured" else f"**{gemm['status'].upper()}**: {gemm['reason']}")
