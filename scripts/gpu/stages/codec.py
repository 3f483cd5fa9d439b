"""The codec stage: the stateful SNAC decoder in FP16 on its own CUDA stream: ms per decode pass at each batch
size with CUDA graphs (`codec.cuda_graphs`, the server's default) and without, side by side, and the host (thread
CPU) ms of a pass for both; audio seconds decoded per GPU second, one 4-frame step against four 1-frame ones,
mixed passes as a server makes them (streaming pushes, a first push, a final one) in even steps against ragged
ones (`codec.ragged_steps`), overlap of graph passes with engine decode steps (both at once against each alone;
every step checked to have decoded every row), and FP16 against FP32 on the same codes (SNR). The dry run runs
the static path eagerly where the graphs would be. Each batch size's row is saved as soon as it is measured.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from scripts.gpu.report import markdown_table
from scripts.gpu.stages.common import DEADLINE, StageRun, ensure_models


def _half_precision_snr(snac_dir: Path, device: str, codes: Any) -> dict[str, Any]:
    """The stateful decoder in FP16 against FP32 on the same codes, streamed in pushes of two frames."""
    import numpy as np

    from orpheus_serve.codec.base import CodecPush
    from orpheus_serve.codec.loader import load_snac
    from orpheus_serve.codec.stateful import StatefulDecoder

    def stream(dtype: str) -> Any:
        decoder = StatefulDecoder(load_snac(snac_dir, device=device, dtype=dtype, noise=False))
        pieces = [decoder.decode([CodecPush("snr", codes[i : i + 2], final=i + 2 >= len(codes))])[0].pcm
                  for i in range(0, len(codes), 2)]
        return np.concatenate(pieces).astype(np.float64)

    half_dtype = "fp16" if device.startswith("cuda") else "fp32"  # CPU: no FP16 kernels worth timing
    reference, half = stream("fp32"), stream(half_dtype)
    error = float(np.sum((reference - half) ** 2))
    snr = float("inf") if error == 0 else 10 * np.log10(float(np.sum(reference**2)) / error)
    return {"frames": len(codes), "dtype": half_dtype, "snr_db": round(snr, 1), "expected_min_db": 40}


def stage_codec(run: StageRun) -> None:
    import numpy as np
    import torch

    from orpheus_serve.codec.loader import load_snac
    from orpheus_serve.codec.stateful import StatefulDecoder
    from orpheus_serve.token_format import CODEBOOK_SIZE, FRAME_SECONDS, TOKENS_PER_FRAME
    from scripts.bench_codec_stateful import PUSH_FRAMES, time_mixed_passes, time_passes

    shapes = run.shapes
    llama, snac_dir = ensure_models(run)
    cuda = shapes.device.startswith("cuda")
    codec_dtype = "fp16" if cuda else "fp32"
    model = load_snac(snac_dir, device=shapes.device, dtype=codec_dtype, noise=False)
    stream = torch.cuda.Stream() if cuda else None
    push_frames = PUSH_FRAMES  # the codec worker's steady-state push: every two frames (flush_every_n_tokens 14)
    rng = np.random.default_rng(0)

    def frames(n: int) -> np.ndarray:
        return rng.integers(0, CODEBOOK_SIZE, size=(n, TOKENS_PER_FRAME), dtype=np.int64)

    def on_stream() -> Any:
        import contextlib

        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def sync() -> None:
        if stream is not None:
            stream.synchronize()

    def codec_passes(decoder: StatefulDecoder, batch: int, passes: int, tag: str) -> tuple[list[float], list[float]]:
        """(wall, host) seconds per pass for `passes` passes of `batch` sessions, 2 new frames each, on the
        codec's own stream; host = the calling thread's CPU time inside `decode`."""
        with on_stream():
            times = time_passes(decoder, batch, passes, rng, tag, sync)
        return times.wall_s, times.host_s

    rows: list[dict[str, Any]] = []
    # graphs: the server's path on CUDA (codec.cuda_graphs); the dry run runs the same static steps eagerly.
    graph_path = "graphs" if cuda else "static-eager"
    run.data.update(device=shapes.device, dtype=codec_dtype, decoder="stateful", graph_path=graph_path, rows=rows)

    def render() -> None:
        run.table = markdown_table(
            ["batch", f"{graph_path} ms / pass (median)", "p90", "dynamic ms / pass (median)", "p90",
             f"host ms / pass, {graph_path}", "host ms / pass, dynamic", f"audio s per GPU s ({graph_path})"],
            [[r["batch"], r["pass_ms_median"], r["pass_ms_p90"], r["dynamic_pass_ms_median"], r["dynamic_pass_ms_p90"],
              r["host_ms_median"], r["dynamic_host_ms_median"], r["audio_s_per_gpu_s"]] for r in rows])
        if capture := run.data.get("graph_capture"):
            shapes_text = (f"buckets {capture['buckets']}, frames per step {capture['step_frames']}, with and without "
                           "edge masks")
            run.table += (f"\n\n{capture['graphs']} CUDA graphs ({shapes_text}) captured in {capture['seconds']} s"
                          if capture["graphs"] else f"\n\nNo CUDA: the static steps ({shapes_text}) ran eagerly")
            run.table += ("; dynamic = graphs off (eager steps of the exact batch). host = the calling thread's CPU "
                          "time inside a pass.")
        if fidelity := run.data.get("fp16_vs_fp32"):
            run.table += "\n\n" + markdown_table(
                [f"{fidelity['dtype'].upper()} vs FP32 (same codes)", "SNR dB", "expected"],
                [[f"{fidelity['frames']} frames", fidelity["snr_db"], ">= 40"]])
        if per_replay := run.data.get("frames_per_replay"):
            run.table += "\n\n" + markdown_table(
                ["passes of 4 frames per session, batch", "one 4-frame step: ms / pass", "host ms",
                 "four 1-frame steps: ms / pass", "host ms"],
                [[r["batch"], r["steps_1_2_4_ms"], r["steps_1_2_4_host_ms"], r["steps_1_ms"], r["steps_1_host_ms"]]
                 for r in per_replay])
        if mixed := run.data.get("mixed_passes"):
            run.table += "\n\n" + markdown_table(
                ["mixed passes (streaming 2 frames, one first push, one final), batch", "even steps: ms / pass",
                 "host ms", "ragged steps: ms / pass", "host ms"],
                [[r["batch"], r["even_ms"], r["even_host_ms"], r["ragged_ms"], r["ragged_host_ms"]] for r in mixed])
            run.table += ("\n\nEven steps take such a pass in three steps (2, 1, then 1 for the final's flush), ragged "
                          "ones (`codec.ragged_steps`, the server's default on CUDA) in one of 4 frames.")
        if overlap := run.data.get("overlap"):
            run.table += "\n\n" + markdown_table(
                ["overlap at batch", "engine steps", "engine alone s", "codec alone s", "both at once s", "overlap"],
                [[overlap["batch"], overlap["engine_steps"], overlap["engine_alone_s"], overlap["codec_alone_s"],
                  overlap["together_s"], overlap["overlap"]]])
            run.table += ("\n\noverlap = (engine alone + codec alone - both at once) / min(engine alone, codec "
                          f"alone), codec passes on the {graph_path} path: 1 = the shorter one is hidden completely, "
                          "0 = they run one after the other.")

    def median_p90(times: list[float]) -> tuple[float, float]:
        ordered = sorted(times)
        return ordered[len(ordered) // 2], ordered[round(0.9 * (len(ordered) - 1))]

    with torch.inference_mode():
        max_batch = max(shapes.codec_batches)
        dynamic = StatefulDecoder(model, max_batch=max_batch, noise=False)  # graphs off: the eager, unpadded steps
        started = time.perf_counter()
        graphs = StatefulDecoder(model, max_batch=max_batch, noise=False, static=True, cuda_graphs=cuda)
        run.data["graph_capture"] = {"graphs": graphs.graph_count, "buckets": graphs.batch_buckets,
                                     "step_frames": list(graphs.step_frames),
                                     "seconds": round(time.perf_counter() - started, 2)}
        for batch in shapes.codec_batches:
            if run.left() < shapes.codec_batch_min_s:
                run.problem(f"codec batch {batch} and above not measured {DEADLINE}")
                break
            measured: dict[str, tuple[list[float], list[float]]] = {"graphs": ([], []), "dynamic": ([], [])}
            for decoder in (graphs, dynamic):
                codec_passes(decoder, batch, 2, f"warm{batch}")
            for half in range(2):  # interleaved halves: drifting clocks or load hit both paths alike
                for name, decoder in (("graphs", graphs), ("dynamic", dynamic)):
                    wall, host = codec_passes(decoder, batch, max(1, shapes.codec_passes // 2), f"b{batch}h{half}")
                    measured[name][0].extend(wall)
                    measured[name][1].extend(host)
            (median, p90), (dynamic_median, dynamic_p90) = (median_p90(measured[n][0]) for n in ("graphs", "dynamic"))
            host, dynamic_host = (median_p90(measured[n][1])[0] for n in ("graphs", "dynamic"))
            audio_s = batch * push_frames * FRAME_SECONDS
            rows.append({"batch": batch, "frames_per_session": push_frames, "path": graph_path,
                         "pass_ms_median": round(median * 1e3, 3), "pass_ms_p90": round(p90 * 1e3, 3),
                         "host_ms_median": round(host * 1e3, 3), "audio_s_per_gpu_s": round(audio_s / median, 1),
                         "dynamic_pass_ms_median": round(dynamic_median * 1e3, 3),
                         "dynamic_pass_ms_p90": round(dynamic_p90 * 1e3, 3),
                         "dynamic_host_ms_median": round(dynamic_host * 1e3, 3)})
            print(f"codec batch {batch}: {graph_path} {median * 1e3:.2f} ms per pass (host {host * 1e3:.2f}), "
                  f"dynamic {dynamic_median * 1e3:.2f} ms (host {dynamic_host * 1e3:.2f}), "
                  f"{audio_s / median:.1f} audio s per s", flush=True)
            render()
            run.save()
        if run.left() > shapes.codec_overlap_min_s + 30:  # leaves the overlap its time
            # The decoder's choice of one graph per (bucket, frames) against one frame per replay (stateful.py).
            one_frame = StatefulDecoder(model, max_batch=max_batch, noise=False, static=True, cuda_graphs=cuda,
                                        step_frames=(1,))
            per_replay: list[dict[str, Any]] = []
            run.data["frames_per_replay"] = per_replay
            for batch in sorted({shapes.codec_batches[0], min(32, max_batch)}):
                cells: dict[str, float] = {}
                for name, decoder in (("steps_1_2_4", graphs), ("steps_1", one_frame)):
                    with on_stream():
                        time_passes(decoder, batch, 1, rng, f"fw{batch}", sync, push_frames=4)
                        times = time_passes(decoder, batch, max(2, shapes.codec_passes // 2), rng, f"f{batch}",
                                            sync, push_frames=4)
                    cells[f"{name}_ms"] = round(median_p90(times.wall_s)[0] * 1e3, 3)
                    cells[f"{name}_host_ms"] = round(median_p90(times.host_s)[0] * 1e3, 3)
                per_replay.append({"batch": batch, **cells})
            del one_frame
            # A server's passes mix first, streaming and final pushes: even steps against ragged ones (stateful.py).
            ragged = StatefulDecoder(model, max_batch=max_batch, noise=False, static=True, cuda_graphs=cuda,
                                     ragged=True)
            mixed: list[dict[str, Any]] = []
            run.data["mixed_passes"] = mixed
            for batch in sorted({3, max(3, min(32, max_batch))}):
                cells = {}
                for name, decoder in (("even", graphs), ("ragged", ragged)):
                    with on_stream():
                        time_mixed_passes(decoder, batch, 1, rng, f"mw{batch}", sync)
                        times = time_mixed_passes(decoder, batch, max(2, shapes.codec_passes // 2), rng, f"m{batch}",
                                                  sync)
                    cells[f"{name}_ms"] = round(median_p90(times.wall_s)[0] * 1e3, 3)
                    cells[f"{name}_host_ms"] = round(median_p90(times.host_s)[0] * 1e3, 3)
                mixed.append({"batch": batch, **cells})
            del ragged
            render()
            run.save()
        else:
            run.problem(f"frames per replay and mixed passes not measured {DEADLINE}")
        fidelity = _half_precision_snr(snac_dir, shapes.device, frames(48))
        run.data["fp16_vs_fp32"] = fidelity
        if fidelity["snr_db"] < fidelity["expected_min_db"]:
            run.problem(f"{fidelity['dtype']} vs fp32 SNR {fidelity['snr_db']} dB < {fidelity['expected_min_db']} dB")
        render()
        run.save()
        if run.left() > shapes.codec_overlap_min_s:
            run.data["overlap"] = _codec_engine_overlap(
                run, llama, graphs, lambda *args: codec_passes(*args)[0])
        else:
            run.problem(f"overlap not measured {DEADLINE}")
    render()
    run.data["complete"] = not run.data["problems"]


def _codec_engine_overlap(run: StageRun, llama: Path, decoder: Any,
                          codec_passes: Callable[..., list[float]]) -> dict[str, Any]:
    """Engine decode steps and codec passes on their own streams, each alone, then both at once."""
    from orpheus_serve import token_format as P
    from orpheus_serve.engines.torch_engine import TorchEngine
    from orpheus_serve.scheduler.step import PrefillChunk, SamplingParams, StepPlan

    shapes = run.shapes
    batch, steps = shapes.overlap_batch, shapes.overlap_steps
    prompt = (P.START_OF_HUMAN, P.BOS, *range(1000, 1032), *P.PROMPT_SUFFIX)
    rounds = 3  # warm-up, engine alone, both at once: every one of them must decode every row
    engine = TorchEngine(llama, num_slots=batch, max_seq_len=len(prompt) + rounds * steps + 16,
                         device=shapes.device, dtype=shapes.dtype, max_batch_size=batch)
    decoded = {"steps": 0, "short": 0}
    try:
        for slot in range(batch):
            out = engine.step(StepPlan(prefill=[PrefillChunk(slot, f"o{slot}", prompt, 0, len(prompt),
                                                             SamplingParams(seed=slot))]))
            if out.failed:
                raise RuntimeError(f"overlap prefill failed: {out.failed}")

        def engine_steps() -> None:
            for _ in range(steps):
                out = engine.step(StepPlan(decode=list(range(batch))))  # returns host tokens: the step has finished
                decoded["steps"] += 1
                if out.failed or len(out.tokens) != batch:
                    decoded["short"] += 1

        passes = max(2, steps // 4)

        def codec_work() -> None:
            codec_passes(decoder, batch, passes, "overlap")

        def timed(*work: Callable[[], None]) -> float:
            threads = [threading.Thread(target=w) for w in work]
            started = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            return time.perf_counter() - started

        engine_steps()  # warm both
        codec_work()
        engine_alone = timed(engine_steps)
        codec_alone = timed(codec_work)
        together = timed(engine_steps, codec_work)
    finally:
        engine.close()
    if decoded["short"]:
        run.problem(f"overlap: {decoded['short']} of {decoded['steps']} engine steps did not decode every row")
    shorter = min(engine_alone, codec_alone)
    overlap = (engine_alone + codec_alone - together) / shorter if shorter > 0 else 0.0
    return {"batch": batch, "engine_steps": steps, "codec_passes": passes, "steps_checked": decoded["steps"],
            "steps_short": decoded["short"], "sdpa": engine.sdpa_backend,
            "engine_alone_s": round(engine_alone, 3), "codec_alone_s": round(codec_alone, 3),
            "together_s": round(together, 3), "overlap": round(overlap, 2)}
