#!/usr/bin/env python3
"""Decode throughput of the torch token engine at several batch sizes.

    python scripts/bench_engine.py                       # tiny + ~100M random Llamas, batch 1, 4, 16, 32
    python scripts/bench_engine.py --presets 100m --batches 1,16 --rounds 5
    python scripts/bench_engine.py --model models/orpheus --device cuda   # a real checkpoint on a GPU
    python scripts/bench_engine.py --presets "" --model models/orpheus-3b --device cuda --dtype bf16 \
        --batches 1,8,32,64,128,256 --contexts 256,1024 --graphs on,off --constrained on,off --json engine.json

For each model, one engine holds max(batches) sessions (prompt prefilled, Orpheus sampling:
temperature 0.6, top_p 0.8, repetition penalty 1.1, constrained, seeded). Each round runs
`--steps` decode steps at every batch size in turn (the first B sessions), so all batch sizes
see the same machine conditions; the median round per batch size is reported. Prints a table of
step time, aggregate tokens/s and the ratio to batch 1. Random-weight models are written with
scripts/make_tiny_models.py into --models-dir when missing.

`--contexts` runs the whole measurement once per prompt length (the context each session
attends over when timing starts; it grows by the steps run), `--graphs on,off` with and without
CUDA graphs (one engine each, sharing one load of the weights; graphs exist on CUDA only), and
`--constrained on,off` with the frame-position constraint's narrowed projection and without it
(sessions prefilled again). With `--contexts-are-kv-tops` each context is instead the longest KV
length the measurement reaches: prompts are shortened by the steps run, so every step attends within
the one CUDA-graph KV bucket that ends at the context (make the contexts powers of two from 256 up),
and graphs on and off attend over the same lengths. `--json` writes one row per (model, context,
graphs, constrained, batch) with the KV lengths it covered, the decode attention that ran (`attention`:
triton or sdpa, resolved as the server resolves engine.attention) and SDPA's kernel (`sdpa`, what serves
prefill, and decode under SDPA attention), and the memory plan of each engine. `--deadline` (Unix time) starts no
configuration after it.

`--attention` (auto, triton or sdpa; default auto) is the decode attention of every engine whose variant
does not name its own: auto is the server's engine.attention default, the Triton kernel on CUDA and SDPA
elsewhere (on a CPU, `--attention triton` runs the kernel in Triton's interpreter, with TRITON_INTERPRET=1).

`--variants` compares engine variants, one engine each (VARIANTS): base (the server's defaults),
fused (engine.fused: engines/fused.py), compiled (engine.compile, where this tree's engine has it),
fp8kv (an FP8 KV cache), fp8w (FP8 GEMM weights), fused+fp8kv, fused+fp8w (FP8 weights, activations
quantised inside the fused norms), and the attention kernels by name: sdpa (SDPA over the batch's
gathered cache), triton (the split-K kernel over the slot cache), triton+fp8kv, triton+fp8kv+fp8w.
Each row carries the engine's build time (`build_s`: caches, compilation, CUDA graphs), and a compiled
engine's rows its compilations (`compiles`: `at_build`, `total`, and `after_warm_up`, 0 as designed: one
compilation serves every batch size, engines/compiled.py; a graph break or a recompilation past dynamo's
limit raises, so the variant fails rather than measuring eager code). A variant the engine cannot build (an
option it does not take, or one it refuses here) is listed under `skipped` with the reason, and one that
fails while built or measured likewise, marked `failed`; the others still run, after the failed engine's
memory is released (its KV caches detached from the shared weights, collected, and CUDA's cache emptied),
so the next variant's memory plan sees the whole device.
The memory plan of each says how many slots of the largest context fit the device:

    python scripts/bench_engine.py --presets "" --model models/orpheus-3b --device cuda --dtype bf16 \
        --batches 1,128,256 --contexts 1024 --contexts-are-kv-tops \
        --variants base,fused,compiled,fp8kv,fp8w,fused+fp8kv,fused+fp8w --profile-batches 1,256

(triton on a CPU runs in Triton's interpreter only, with TRITON_INTERPRET=1: a smoke test, not a speed.)

`--profile-batches 1,256` then records, on each configuration's engine, a torch.profiler trace of
`--profile-steps` decode steps (CUDA graphs replayed, as served) at each of those batch sizes, and
`--json` holds its summary per (variant, context, graphs, batch) under `profiles`: kernels per step,
the top kernels by share of GPU time, the GPU's idle share inside a step (engines/profiling.py; CPU
activity on a CPU). A profile that recorded no kernel is `status: failed` with the reason, never a number.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from orpheus_serve import token_format as P  # noqa: E402
from orpheus_serve.config import resolve_device, resolve_dtype  # noqa: E402
from orpheus_serve.engines.llama import LlamaConfig, Transformer, load_transformer, torch_dtype  # noqa: E402
from orpheus_serve.engines.memory import available_bytes, plan_memory  # noqa: E402
from orpheus_serve.engines.profiling import profile_steps  # noqa: E402
from orpheus_serve.engines.torch_engine import TorchEngine, resolve_attention  # noqa: E402
from orpheus_serve.scheduler.step import EngineError, PrefillChunk, SamplingParams, StepPlan  # noqa: E402

PRESET_FOLDERS = {"tiny": "tiny-orpheus", "100m": "orpheus-100m"}
# TorchEngine options of each --variants name (beside --attention, for those that name no attention of their
# own). The kit's rows (scripts/gpu/stages/engine.py): base (the server's defaults: attention auto), fused
# (engine.fused), compiled (engine.compile), fp8kv (FP8 KV cache), fp8w (FP8 GEMM weights), fused+fp8kv (with the
# fused decode attention's FP8 blocks) and fused+fp8w (FP8 weights with the activations quantised inside the
# fused norms).
VARIANTS: dict[str, dict[str, str | bool]] = {
    "base": {},
    "fused": {"fused": True},
    "compiled": {"compile_decode": True},
    "fp8kv": {"kv_cache_dtype": "fp8"},
    "fp8w": {"quantization": "fp8"},
    "fused+fp8kv": {"fused": True, "kv_cache_dtype": "fp8"},
    "fused+fp8w": {"fused": True, "quantization": "fp8"},
    "sdpa": {"attention": "sdpa"},
    "triton": {"attention": "triton"},
    "triton+fp8kv": {"attention": "triton", "kv_cache_dtype": "fp8"},
    "triton+fp8kv+fp8w": {"attention": "triton", "kv_cache_dtype": "fp8", "quantization": "fp8"},
}


def variant_options(variant: str, attention: str = "auto") -> dict[str, str | bool]:
    """The TorchEngine options of `variant`: its own, with `attention` where it names none."""
    return {"attention": attention, **VARIANTS[variant]}


@dataclass(slots=True)
class VariantMeasurement:
    """What `bench_model` measured on one engine."""

    step_s: dict[bool, dict[int, float]]  # median seconds per decode step, per constrained mode and batch size
    sdpa: str  # SDPA's kernel (engine.sdpa_backend)
    attention: str  # the decode attention that ran: triton or sdpa
    build_s: float  # caches, compilation, CUDA graphs
    profiles: list[dict[str, object]] = field(default_factory=list)
    compiles: dict[str, int] | None = None  # a compiled engine's compilations: at build, in all, after warm-up


def variant_unavailable(variant: str) -> str | None:
    """Why this tree's TorchEngine cannot build `variant` (an option it does not take), or None."""
    import inspect

    accepted = inspect.signature(TorchEngine.__init__).parameters
    missing = [k for k in VARIANTS[variant] if k not in accepted]
    return f"TorchEngine takes no {', '.join(missing)} option in this tree" if missing else None


def ensure_model(models_dir: Path, preset: str) -> Path:
    folder = models_dir / PRESET_FOLDERS[preset]
    if not (folder / "config.json").exists():
        from scripts.make_tiny_models import main as make_tiny_models

        make_tiny_models(["--out", str(models_dir), "--preset", preset, "--skip-snac"])
    return folder


def _on_off(value: str) -> list[bool]:
    modes = {"on": True, "off": False}
    try:
        return [modes[v] for v in value.split(",") if v]
    except KeyError as exc:
        raise argparse.ArgumentTypeError(f"expected on, off or on,off, got {value!r}") from exc


def _variants(value: str) -> list[str]:
    names = [v for v in value.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown variants {unknown}; expected some of {', '.join(VARIANTS)}")
    return names


def memory_plan(folder: Path, *, slots: int, max_seq_len: int, device: str, dtype: str,
                memory_fraction: float = 0.9, resident: Transformer | None = None,
                variant: str = "sdpa") -> dict[str, object]:
    """What the engine's planner says about `slots` sessions of `max_seq_len` on this device, against its
    free memory now (plus the weights of `resident`, loaded already and counted by the plan)."""
    from orpheus_serve.engines.llama import kv_torch_dtype

    options = VARIANTS[variant]
    kv_dtype = str(options["kv_cache_dtype"]) if "kv_cache_dtype" in options else None
    budget = available_bytes(torch.device(device))
    free = budget
    if budget is not None and resident is not None:
        budget += sum(p.numel() * p.element_size() for p in resident.parameters())
    plan = plan_memory(LlamaConfig.from_folder(folder), num_slots=slots, max_seq_len=max_seq_len,
                       dtype=torch_dtype(dtype), max_batch_size=slots,
                       budget_bytes=None if budget is None else int(budget * memory_fraction),
                       kv_dtype=kv_torch_dtype(kv_dtype) if kv_dtype else None,
                       quantization=str(options.get("quantization", "none")))
    return {"slots": slots, "max_seq_len": max_seq_len, "weights_gib": round(plan.weights_bytes / 2**30, 3),
            "kv_mib_per_slot": round(plan.kv_bytes_per_slot / 2**20, 2),
            "workspace_gib": round(plan.workspace_bytes / 2**30, 3),
            "budget_gib": None if plan.budget_bytes is None else round(plan.budget_bytes / 2**30, 2),
            "max_slots": plan.max_slots, "fits": plan.fits, "describe": plan.describe(),
            "free_gib_measured": None if free is None else round(free / 2**30, 2)}


def steps_per_mode(batches: list[int], *, steps: int, rounds: int, warmup: int) -> int:
    """Decode steps the first session runs per constrained mode: what its KV length grows by."""
    return warmup * len(batches) + rounds * steps * len(batches)


def bench_model(folder: Path, *, batches: list[int], steps: int, rounds: int, warmup: int, device: str,
                dtype: str, prompt_len: int, graphs: bool = True, constrained_modes: tuple[bool, ...] = (True,),
                max_seq_len: int | None = None, model: Transformer | None = None, variant: str = "sdpa",
                attention: str = "auto", profile_batches: tuple[int, ...] = (), profile_step_count: int = 5,
                ) -> VariantMeasurement:
    """Median seconds per decode step, per constrained mode and batch size (one engine for all), the
    attention that served them, a profile of the engine's decode step at each of `profile_batches` (the
    last constrained mode's sessions; `status: failed` when it recorded no kernel), and the seconds the
    engine took to build (caches, compilation, CUDA graphs). `model`: weights loaded once and shared by the
    engines (not with FP8 weights, which quantise their own copy). `attention`: the decode attention of a
    variant that names none (auto: the server's choice)."""
    max_batch = max(batches)
    if max_seq_len is None:
        max_seq_len = prompt_len + 1 + steps_per_mode(batches, steps=steps, rounds=rounds, warmup=warmup) + 8
    options = variant_options(variant, attention)
    started = time.perf_counter()
    engine = TorchEngine(folder, num_slots=max_batch, max_seq_len=max_seq_len, device=device, dtype=dtype,
                         max_batch_size=max_batch, cuda_graphs=graphs,
                         model=None if options.get("quantization") == "fp8" else model, **options)  # type: ignore[arg-type]
    measured = VariantMeasurement(step_s={}, sdpa=engine.sdpa_backend, attention=engine.attention,
                                  build_s=time.perf_counter() - started)
    compiled = engine.compiled_decode
    at_build = compiled.compilations if compiled is not None else 0
    try:
        for constrained in constrained_modes:
            measured.step_s[constrained] = _bench_sessions(engine, batches=batches, steps=steps, rounds=rounds,
                                                           warmup=warmup, prompt_len=prompt_len,
                                                           constrained=constrained)
        for batch in profile_batches:
            plan = StepPlan(decode=list(range(batch)))
            engine.step(plan)  # warm: the profile is of a serving step, not of a first one
            summary = profile_steps(lambda plan=plan: engine.step(plan), steps=profile_step_count, device=device)
            measured.profiles.append({"batch": batch, **summary.as_dict()})
        if compiled is not None:
            measured.compiles = {"at_build": at_build, "total": compiled.compilations,
                                 "after_warm_up": compiled.compilations_after_warm_up}
    finally:
        engine.close()
    return measured


def release_failed_variant(model: Transformer | None, device: str) -> None:
    """After a variant failed (built part-way, or while measured): no KV cache of its engine stays on the
    device for the next variant's plan to miss. TorchEngine releases its own on a failed build and on close;
    here the shared weights' caches are detached too (whatever raised), the exception's frames collected, and
    CUDA's cached blocks returned."""
    if model is not None:
        for layer in model.layers:
            layer.attention.kv_cache = None
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def _bench_sessions(engine: TorchEngine, *, batches: list[int], steps: int, rounds: int, warmup: int,
                    prompt_len: int, constrained: bool) -> dict[int, float]:
    max_batch = max(batches)
    gen = torch.Generator().manual_seed(0)
    for slot in range(max_batch):  # a chunk with start == 0 (re)starts the slot's session
        text = torch.randint(0, 1000, (prompt_len - 6,), generator=gen).tolist()
        prompt = (P.START_OF_HUMAN, P.BOS, *text, *P.PROMPT_SUFFIX)
        sampling = SamplingParams(temperature=0.6, top_p=0.8, repetition_penalty=1.1, seed=slot,
                                  constrained=constrained)
        out = engine.step(StepPlan(prefill=[PrefillChunk(slot, f"bench-{slot}", prompt, 0, len(prompt), sampling)]))
        assert not out.failed, out.failed
    for batch in batches:
        for _ in range(warmup):
            engine.step(StepPlan(decode=list(range(batch))))
    per_round: dict[int, list[float]] = {b: [] for b in batches}
    for _ in range(rounds):
        for batch in batches:
            plan_slots = list(range(batch))
            started = time.perf_counter()
            for _ in range(steps):
                out = engine.step(StepPlan(decode=plan_slots))
                assert not out.failed, out.failed
            per_round[batch].append((time.perf_counter() - started) / steps)
    return {b: statistics.median(times) for b, times in per_round.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="tiny,100m", help="random-weight models to bench (tiny, 100m)")
    ap.add_argument("--model", action="append", default=[], help="also bench this local checkpoint folder")
    ap.add_argument("--models-dir", default=str(ROOT / "models"), help="where the random-weight models live")
    ap.add_argument("--batches", default="1,4,16,32")
    ap.add_argument("--steps", type=int, default=8, help="decode steps per batch size per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--contexts", default=None, help="prompt lengths to measure at, e.g. 256,1024 (default: --prompt-len)")
    ap.add_argument("--graphs", type=_on_off, default=[True], help="CUDA graphs: on, off or on,off (default on)")
    ap.add_argument("--constrained", type=_on_off, default=[True],
                    help="frame-position constraint: on, off or on,off (default on)")
    ap.add_argument("--attention", choices=["auto", "triton", "sdpa"], default="auto",
                    help="decode attention of the variants that name none (auto: the server's, triton on CUDA)")
    ap.add_argument("--variants", type=_variants, default=["sdpa"],
                    help=f"decode attention / precision variants to compare: {', '.join(VARIANTS)} (default sdpa)")
    ap.add_argument("--profile-batches", default="",
                    help="profile the decode step at these batch sizes (each at most max(--batches)), e.g. 1,256")
    ap.add_argument("--profile-steps", type=int, default=5, help="decode steps per profile")
    ap.add_argument("--json", default=None, help="also write the rows and memory plans to this JSON file")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto", choices=["auto", "fp32", "fp16", "bf16"])
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--contexts-are-kv-tops", action="store_true",
                    help="each context is the longest KV length reached (one graph bucket for graphs on and off)")
    ap.add_argument("--deadline", type=float, default=None, help="Unix time after which no configuration starts")
    args = ap.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    batches = sorted({int(b) for b in args.batches.split(",") if b})
    if 1 not in batches:
        batches.insert(0, 1)
    profile_batches = tuple(int(b) for b in args.profile_batches.split(",") if b)
    if any(b > max(batches) for b in profile_batches):
        ap.error(f"--profile-batches {args.profile_batches}: the engine holds at most {max(batches)} sessions")
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    try:  # as the server resolves engine.attention; refused here (triton on a CPU without the interpreter) once
        attention = resolve_attention(args.attention, torch.device(device))
    except EngineError as exc:
        ap.error(f"--attention {args.attention}: {exc}")
    folders = [ensure_model(Path(args.models_dir), p) for p in args.presets.split(",") if p]
    folders += [Path(m) for m in args.model]

    contexts = [int(c) for c in args.contexts.split(",") if c] if args.contexts else [args.prompt_len]
    growth = steps_per_mode(batches, steps=args.steps, rounds=args.rounds, warmup=args.warmup)
    if args.contexts_are_kv_tops and min(contexts) - growth - 1 < 8:
        ap.error(f"context {min(contexts)} leaves no prompt: the measurement grows the KV length by {growth}")
    print(f"device {device}, dtype {dtype}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"attention {args.attention} ({attention}); "
          f"{args.rounds} rounds x {args.steps} steps per batch size, median round")
    print(f"{'model':<16} {'params':>8} {'ctx':>5} {'graphs':>6} {'variant':>17} {'attn':>7} {'slots fit':>9} {'constr':>6} "
          f"{'batch':>5} {'step ms':>9} {'tokens/s':>10} {'x batch 1':>10}")
    rows: list[dict[str, object]] = []
    plans: list[dict[str, object]] = []
    profiles: list[dict[str, object]] = []
    skipped: list[dict[str, object]] = []  # variants this engine cannot build, with the reason (never a number)
    complete = True
    for folder in folders:
        params = LlamaConfig.from_folder(folder).num_parameters
        started = time.perf_counter()
        model = load_transformer(folder, dtype=torch_dtype(dtype), device=device)  # once, shared by its engines
        print(f"{folder.name}: weights loaded to {device} in {time.perf_counter() - started:.1f} s", flush=True)
        for context in contexts:
            if args.contexts_are_kv_tops:  # KV lengths prompt+1 .. context: inside the bucket that ends at context
                prompt_len, max_seq_len = context - growth - 1, context + 8
            else:
                prompt_len, max_seq_len = context, context + 1 + growth + 8
            for graphs, variant in ((g, v) for g in args.graphs for v in args.variants):
                if args.deadline is not None and time.time() > args.deadline:
                    print(f"deadline passed: context {context}, graphs {_word(graphs)}, {variant} not measured",
                          flush=True)
                    complete = False
                    continue
                where = {"model": folder.name, "context": context, "graphs": graphs, "variant": variant}
                if reason := variant_unavailable(variant):
                    print(f"{variant}: skipped ({reason})", flush=True)
                    skipped.append({**where, "reason": reason})
                    continue
                plan = memory_plan(folder, slots=max(batches), max_seq_len=max_seq_len, device=device, dtype=dtype,
                                   resident=model, variant=variant)
                plans.append({**where, **plan})
                failure: dict[str, object] | None = None
                try:
                    measured = bench_model(
                        folder, batches=batches, steps=args.steps, rounds=args.rounds, warmup=args.warmup,
                        device=device, dtype=dtype, prompt_len=prompt_len, graphs=graphs,
                        constrained_modes=tuple(args.constrained), max_seq_len=max_seq_len, model=model,
                        variant=variant, attention=args.attention, profile_batches=profile_batches,
                        profile_step_count=args.profile_steps)
                except EngineError as exc:  # the engine refuses this variant here (a kernel it lacks, ...)
                    print(f"{variant}: skipped (the engine refused it: {exc})", flush=True)
                    failure = {**where, "reason": f"the engine refused it: {exc}"}
                except Exception as exc:  # a kernel that fails to compile or run: this variant only, said so
                    traceback.print_exc()
                    failure = {**where, "reason": f"failed: {type(exc).__name__}: {str(exc)[:300]}", "failed": True}
                if failure is not None:  # out of the except block: its traceback (and the frames) let go now
                    skipped.append(failure)
                    complete = complete and not failure.get("failed")
                    release_failed_variant(model, device)
                    continue
                for p in measured.profiles:
                    profiles.append({"model": folder.name, "context": context, "variant": variant,
                                     "graphs": graphs and device.startswith("cuda"), "attention": measured.attention,
                                     **p})
                    if p.get("status") == "failed":
                        print(f"profile {variant} batch {p['batch']}: FAILED ({p['reason']})", flush=True)
                        continue
                    print(f"profile {variant} batch {p['batch']}: {p['kernels_per_step']} kernels/step, "
                          f"idle {p['idle_share']:.0%}, top {p['top_kernels'][0]['name'] if p['top_kernels'] else '-'}",
                          flush=True)
                if measured.compiles is not None and measured.compiles["after_warm_up"]:
                    print(f"{variant}: compiled again after the warm-up ({measured.compiles}): the rows include "
                          "compilation time", flush=True)
                fit = "?" if plan["max_slots"] is None else plan["max_slots"]
                for constrained, step_s in measured.step_s.items():
                    base = 1 / step_s[1]
                    for batch in batches:
                        rate = batch / step_s[batch]
                        print(f"{folder.name:<16} {params / 1e6:>7.1f}M {context:>5} {_word(graphs):>6} "
                              f"{variant:>17} {measured.attention:>7} {fit:>9} {_word(constrained):>6} {batch:>5} "
                              f"{step_s[batch] * 1e3:>9.2f} {rate:>10.1f} {rate / base:>10.2f}", flush=True)
                        row: dict[str, object] = {
                            "model": folder.name, "params_m": round(params / 1e6, 1), "context": context,
                            "graphs": graphs and device.startswith("cuda"), "variant": variant,
                            "slots_fit": plan["max_slots"], "constrained": constrained,
                            "batch": batch, "step_ms": round(step_s[batch] * 1e3, 3),
                            "tokens_per_s": round(rate, 1), "x_batch_1": round(rate / base, 2),
                            "kv_len_first": prompt_len + 1, "kv_len_last": prompt_len + growth,
                            "sdpa": measured.sdpa, "attention": measured.attention,
                            "build_s": round(measured.build_s, 2)}
                        if measured.compiles is not None:
                            row["compiles"] = measured.compiles
                        rows.append(row)
                if args.json:  # after every configuration: a run stopped part-way keeps what it measured
                    _write_atomically(Path(args.json), {
                        "device": device, "dtype": dtype, "torch": torch.__version__, "attention": attention,
                        "steps": args.steps, "rounds": args.rounds, "warmup": args.warmup, "contexts_are_kv_tops": args.contexts_are_kv_tops,
                        "complete": False, "rows": rows, "memory_plans": plans, "profiles": profiles,
                        "skipped": skipped})
        del model
    if args.json:
        _write_atomically(Path(args.json), {
            "device": device, "dtype": dtype, "torch": torch.__version__, "attention": attention,
            "steps": args.steps, "rounds": args.rounds,
            "warmup": args.warmup, "contexts_are_kv_tops": args.contexts_are_kv_tops, "complete": complete,
            "rows": rows, "memory_plans": plans, "profiles": profiles, "skipped": skipped})
    return 0


def _write_atomically(path: Path, data: dict[str, object]) -> None:
    """A reader (or a run killed mid-write) sees the previous file or the new one, never half of one."""
    scratch = path.with_name(path.name + ".tmp")
    scratch.write_text(json.dumps(data, indent=2))
    scratch.replace(path)


def _word(flag: bool) -> str:
    return "on" if flag else "off"


if __name__ == "__main__":
    sys.exit(main())
