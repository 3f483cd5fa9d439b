"""`python benchmark.py`: measure a server the way every run measures it (ARCHITECTURE §8).

    python benchmark.py --mode all --compare baseline --output results/results.json
    python benchmark.py --mode scaling --concurrent 32 --protocol mixed --url http://host:8000 --grpc-addr host:50051
    python benchmark.py --mode input-stream --concurrent 8   (text streamed in at 30 tokens/s; or --input-stream)
    python benchmark.py --mode sim --sim-profile docs/gpu-results/DIR --sim-card-serve   (the card's serve stage, replayed)

Without --url the benchmark starts its own servers (production_server.py subprocesses on
loopback) with the config plus --set overrides; with --url it measures that server
(modes that need servers with other settings are then skipped). Results go to the
JSON file, plots next to it.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..replay import CardProfile
from ..request.types import PROTOCOLS
from ..token_format import FRAME_SECONDS
from .launch import LaunchedServer
from .runner import (
    LoadSpec,
    Target,
    analytic_realtime_bound,
    best_realtime_level,
    environment,
    frames_for_seconds,
    h100_fp8_cost,
    measure,
    profile_ttfb_bound,
    scaling_levels,
    sim_overrides,
    ttfb_feasible_bound,
    write_results,
)

MODES = ("single", "scaling", "tuning", "sim", "input-stream", "all")


def _cpu_list(text: str) -> tuple[int, ...]:
    """'0', '0,1' or '0-3' as CPU numbers, ascending."""
    cpus: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise argparse.ArgumentTypeError(f"not a CPU list: {text!r} (e.g. 0 or 0,1 or 0-3)")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return tuple(sorted(cpus))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="benchmark.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=MODES, default="all")
    ap.add_argument("--requests", type=int, default=None, help="requests per load level (default: 2 x concurrency, >= 4)")
    ap.add_argument("--concurrent", type=int, default=16, help="highest concurrency (scaling, tuning, compare)")
    ap.add_argument("--protocol", choices=(*PROTOCOLS, "mixed"), default="rest")
    ap.add_argument("--output", type=Path, default=Path("results/results.json"))
    ap.add_argument("--url", default=None, help="measure this running server instead of starting one")
    ap.add_argument("--grpc-addr", default=None, help="its gRPC address (default: host of --url, port 50051)")
    ap.add_argument("--config", default=None, help="config file for servers started here")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="config override for servers started here (repeatable)")
    ap.add_argument("--compare", choices=("baseline",), default=None,
                    help="also run the same load against an engine.mode=baseline server and print the ratio")
    ap.add_argument("--max-tokens", type=int, default=140,
                    help="cap per request (keeps CPU runs short; 0 = the server's text-length rule)")
    ap.add_argument("--ttfb-target-ms", type=float, default=None, help="default: the profile's target_ttfb_ms")
    ap.add_argument("--sim-streams", type=int, default=None,
                    help="highest concurrency of the sim run (default 128; with --sim-profile 1.5x its bound)")
    ap.add_argument("--sim-profile", type=Path, default=None, metavar="DIR",
                    help="replay a measured card: a GPU kit result folder (docs/gpu-results/...), instead of the "
                         "H100 cost model")
    ap.add_argument("--sim-profile-variant", default=None,
                    help="the profile's engine rows to replay (default: triton where measured, else sdpa)")
    ap.add_argument("--sim-card-serve", action="store_true",
                    help="with --sim-profile: replay the folder's own serve stage (serve.json: its levels, load and "
                         "server settings) and compare each level with the card's (held streams, real-time share, "
                         "loop ms a step, codec ms a pass)")
    ap.add_argument("--sim-levels", type=int, nargs="+", default=None, metavar="N",
                    help="the levels of --sim-card-serve (default: serve.json's)")
    ap.add_argument("--sim-max-batch", type=int, default=512,
                    help="scheduler.max_batch_size of the sim server: smaller steps for new sessions' first audio")
    ap.add_argument("--sim-admission", nargs="+", choices=("queue", "reject"), default=["queue", "reject"],
                    help="scheduler.admission modes to run the sim sweep with (one server each)")
    ap.add_argument("--sim-protocol", choices=(*PROTOCOLS, "mixed"), default="grpc",
                    help="protocol of the sim run (gRPC's client costs this machine the least CPU per stream)")
    ap.add_argument("--input-stream", action="store_true",
                    help="also run the text-streamed-in workload: WebSocket contexts whose words arrive at "
                         "--input-tokens-per-s (a voice agent's LLM), at 1 and --concurrent streams")
    ap.add_argument("--input-tokens-per-s", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--server-cpus", type=_cpu_list, default=None, metavar="LIST",
                    help="pin the servers started here (and their engine-core processes) to these CPUs, e.g. 0 or 0,1;"
                         " the client stays unpinned")
    ap.add_argument("--no-progress", action="store_true")
    return ap


class Bench:
    def __init__(self, args: argparse.Namespace, max_chars: int, *, max_frames_per_pass: int = 64) -> None:
        self.args = args
        self.max_chars = max_chars
        self.max_frames_per_pass = max_frames_per_pass  # the codec's, for a replayed card's bound
        self.out_dir = args.output.parent
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._launches = 0

    def spec(self, concurrency: int, **kw: Any) -> LoadSpec:
        requests = self.args.requests or max(4, 2 * concurrency)
        return LoadSpec(requests=requests, concurrency=concurrency, protocol=kw.pop("protocol", self.args.protocol),
                        seed=self.args.seed, max_tokens=self.args.max_tokens or None, max_chars=self.max_chars,
                        **kw)

    @contextlib.contextmanager
    def server(self, label: str, extra: list[str] | None = None) -> Iterator[Target]:
        if self.args.url:
            grpc = self.args.grpc_addr or f"{self.args.url.split('://')[-1].split(':')[0]}:50051"
            yield Target(self.args.url, grpc, label)
            return
        self._launches += 1
        log = self.out_dir / f"server_{self._launches:02d}_{label}.log"
        with LaunchedServer([*self.args.set, *(extra or [])], config=self.args.config, log_path=log,
                            cpus=self.args.server_cpus) as srv:
            yield Target(srv.url, srv.grpc_addr, label)

    def run_level(self, target: Target, spec: LoadSpec, title: str) -> dict[str, Any]:
        bar = None
        if not self.args.no_progress:
            from tqdm import tqdm

            bar = tqdm(total=spec.requests, desc=f"{title} c={spec.concurrency}", unit="req", leave=False)
        try:
            row = measure(target, spec, progress=bar.update if bar else None)
        finally:
            if bar:
                bar.close()
        print_row(title, row)
        return row

    # ------------------------------------------------------------------ modes

    def single(self, target: Target) -> dict[str, Any]:
        return {"rows": [self.run_level(target, self.spec(1), "single")]}

    def scaling(self, target: Target, ttfb_target: float, target_concurrent: int) -> dict[str, Any]:
        rows = [self.run_level(target, self.spec(c), "scaling") for c in scaling_levels(self.args.concurrent)]
        held = best_realtime_level(rows, ttfb_target)
        print(f"\nscaling: {held} concurrent streams real-time with p95 TTFB < {ttfb_target:g} ms "
              f"(the profile targets {target_concurrent})")
        return {"rows": rows, "max_realtime_concurrency": held, "target_concurrent": target_concurrent,
                "meets_target_concurrent": held is not None and held >= target_concurrent}

    def tuning(self) -> dict[str, Any]:
        grid = [
            ("batch4-stateful", ["scheduler.max_batch_size=4"]),
            ("batch16-stateful", ["scheduler.max_batch_size=16"]),
            ("batch16-windowed-L2R2", ["scheduler.max_batch_size=16", "codec.decoder=windowed",
                                        "codec.left_context_frames=2", "codec.lookahead_frames=2"]),
            ("batch16-windowed-L1R1", ["scheduler.max_batch_size=16", "codec.decoder=windowed",
                                        "codec.left_context_frames=1", "codec.lookahead_frames=1"]),
        ]
        rows = []
        for name, overrides in grid:
            with self.server(name, overrides) as target:
                row = self.run_level(target, self.spec(self.args.concurrent), f"tuning {name}")
            rows.append({"setting": name, "overrides": overrides, **row})
        return {"rows": rows}

    def compare(self, batched_row: dict[str, Any] | None) -> dict[str, Any]:
        spec = self.spec(self.args.concurrent)
        if batched_row is None:
            with self.server("batched") as target:
                batched_row = self.run_level(target, spec, "batched")
        with self.server("baseline", ["engine.mode=baseline"]) as target:
            baseline_row = self.run_level(target, spec, "baseline")
        ratio = None
        if baseline_row["audio_seconds_per_second"]:
            ratio = round(batched_row["audio_seconds_per_second"] / baseline_row["audio_seconds_per_second"], 3)
        print(f"\naudio seconds per wall second at {spec.concurrency} concurrent: batched "
              f"{batched_row['audio_seconds_per_second']} vs baseline {baseline_row['audio_seconds_per_second']}"
              f" -> {ratio}x")
        return {"concurrency": spec.concurrency, "batched": batched_row, "baseline": baseline_row,
                "audio_seconds_per_second_ratio": ratio}

    def input_stream(self, target: Target, ttfb_target: float) -> dict[str, Any]:
        """Text streamed in: first audio after the first clause, not after the whole reply."""
        rows = []
        # The usual mix (mostly one-sentence turns), then replies of two or three sentences alone (the medium
        # texts), where writing the reply takes longer than the first audio does.
        levels = [(c, "mix", (0.6, 0.3, 0.1)) for c in sorted({1, self.args.concurrent})] + [(1, "medium", (0, 1, 0))]
        for c, texts, mix in levels:
            spec = self.spec(c, protocol="ws", input_tokens_per_s=self.args.input_tokens_per_s, text_mix=mix)
            row = self.run_level(target, spec, f"input-stream {texts}")
            row["texts"] = texts
            print(f"{'':>28} first audio from the first word p50/p95={row['ttfb_from_first_word_p50_ms']}/"
                  f"{row['ttfb_from_first_word_p95_ms']} ms, from the end of the first clause p50/p95="
                  f"{row['ttfb_from_first_clause_p50_ms']}/{row['ttfb_from_first_clause_p95_ms']} ms; "
                  f"{row['first_audio_before_last_word']}/{row['input_streams']} spoke before their last word "
                  f"(writing a reply took {row['input_writing_p50_ms']} ms, p50)",
                  flush=True)
            rows.append(row)
        return {"rows": rows, "tokens_per_s": self.args.input_tokens_per_s, "ttfb_target_ms": ttfb_target}

    def sim(self) -> dict[str, Any]:
        """The sim engine and sim codec behind the real gateway, with an H100 FP8 cost model or a measured card
        replayed (`--sim-profile`), offered loads up to `--sim-streams` (past the analytic bound: overload),
        once per admission mode."""
        cost = h100_fp8_cost()
        seconds = 4.0
        frames = frames_for_seconds(seconds)
        prompt_tokens = 40
        profile = None
        if self.args.sim_profile is not None:
            from ..replay import load_profile

            profile = load_profile(self.args.sim_profile, variant=self.args.sim_profile_variant)
            bound = profile.realtime_bound(mean_kv_len=prompt_tokens + frames * 7 / 2,
                                           max_frames_per_pass=self.max_frames_per_pass,
                                           prefill_share=prompt_tokens / (frames * 7))
            ttfb_bound = profile_ttfb_bound(profile, prompt_tokens=prompt_tokens, bound=bound,
                                            first_audio_tokens=21, ttfb_ms=150.0)
            streams = self.args.sim_streams or max(1, round(1.5 * bound))
        else:
            streams = self.args.sim_streams or 128
            shape = {"prompt_tokens": prompt_tokens, "utterance_tokens": frames * 7, "max_batch": 4 * streams}
            bound = analytic_realtime_bound(cost, **shape)
            ttfb_bound = ttfb_feasible_bound(cost, **shape, first_audio_tokens=21, ttfb_ms=150.0)
        levels = sorted({32, 64, ttfb_bound, streams, int(0.9 * bound)} - {0})
        slots = max(levels)
        overrides = sim_overrides(cost, slots=slots, frames=frames, max_batch=self.args.sim_max_batch)
        inputs = None
        if profile is not None:
            overrides += self.profile_overrides()
            inputs = self.replay_inputs(profile, overrides)
        out: dict[str, Any] = {
            "cost_model": cost.model_dump() if profile is None else profile.describe(),
            "profile": None if profile is None else profile.name, "replay_inputs": inputs,
            "utterance_seconds": round(frames * FRAME_SECONDS, 3),
            "max_batch_size": min(self.args.sim_max_batch, slots), "protocol": self.args.sim_protocol,
            "analytic_bound": bound, "ttfb_feasible_bound": ttfb_bound,
            "server_cpus": self.args.server_cpus,
        }
        for admission in self.args.sim_admission:
            rows = []
            with self.server(f"sim-{admission}", [*overrides, f"scheduler.admission={admission}"]) as target:
                for c in levels:
                    spec = LoadSpec(requests=2 * c, concurrency=c, protocol=self.args.sim_protocol,
                                    seed=self.args.seed, max_tokens=frames * 7 + 7, max_chars=self.max_chars,
                                    ramp_s=seconds)
                    row = self.run_level(target, spec, f"sim {admission}")
                    row["flow"] = target.stats().get("flow")
                    if profile is not None and row.get("codec_ms_per_pass") and row.get("codec_frames_per_pass"):
                        # The pass inside the server against the card's codec alone with the same frames (the kit's
                        # passes: 2 frames a session, so the same batch).
                        alone = profile.codec_pass_ms(round(row["codec_frames_per_pass"]))
                        row["codec_over_alone"] = round(row["codec_ms_per_pass"] / alone, 3)
                        print(f"{'':>28} codec pass {row['codec_ms_per_pass']} ms for {row['codec_frames_per_pass']}"
                              f" frames: {row['codec_over_alone']}x the card's codec alone", flush=True)
                    rows.append(row)
            held = max((r["concurrent_peak"] for r in rows
                        if r["errors"] == 0 and (r["realtime_of_started"] or 0) >= 0.95), default=0)
            worst = min((r["realtime_of_started"] for r in rows if r["realtime_of_started"] is not None), default=None)
            print(f"\nsim ({admission}): throughput bound {bound} real-time streams (TTFB-feasible {ttfb_bound}); "
                  f"held {held} playing at once with >= 95% of started streams real-time ({held / bound:.0%} of "
                  f"the bound); worst level {'-' if worst is None else f'{worst:.1%}'} real-time of started; "
                  f"refused {sum(r['rejected'] for r in rows)}, errors {sum(r['errors'] for r in rows)}")
            out[admission] = {"rows": rows, "held_realtime_streams": held,
                              "fraction_of_bound": round(held / bound, 3) if bound else None,
                              "worst_realtime_of_started": worst}
        # The sweep plotted and compared across runs: the default admission mode.
        out["rows"] = out[self.args.sim_admission[0]]["rows"]
        return out

    def profile_overrides(self) -> list[str]:
        assert self.args.sim_profile is not None
        overrides = [f"engine.sim.profile={self.args.sim_profile.resolve()}"]
        if self.args.sim_profile_variant:
            overrides.append(f"engine.sim.profile_variant={self.args.sim_profile_variant}")
        return overrides

    def replay_inputs(self, profile: CardProfile, overrides: list[str]) -> dict[str, Any]:
        """What the replay rests on (measured, estimated, paths the card never ran), printed before its results."""
        from ..config import load_config
        from ..replay import format_inputs

        config = load_config(self.args.config, overrides=[*self.args.set, *overrides])
        inputs = profile.inputs_record(ragged_steps=config.codec.ragged_steps is not False)
        print(format_inputs(inputs), flush=True)
        return inputs

    def card_serve(self) -> dict[str, Any]:
        """The profile folder's own serve stage, replayed: its levels, load and server settings on the sim engine
        and sim codec, each level set beside the card's (replay/calibration.py)."""
        import json

        from ..replay import load_profile
        from ..replay.calibration import card_serve_workload, codec_totals, compare_level, format_comparison

        assert self.args.sim_profile is not None
        profile = load_profile(self.args.sim_profile, variant=self.args.sim_profile_variant)
        serve_path = self.args.sim_profile / "serve.json"
        workload = card_serve_workload(json.loads(serve_path.read_text()))
        levels = tuple(self.args.sim_levels or workload.levels)
        frames = workload.max_tokens // 7
        slots = max(levels)
        # The card's utterances ran to max_tokens (random weights never end one early): every one is `frames` long.
        overrides = [*sim_overrides(h100_fp8_cost(), slots=slots, frames=frames, max_batch=self.args.sim_max_batch),
                     *workload.server_overrides, *self.profile_overrides()]
        inputs = self.replay_inputs(profile, overrides)
        out: dict[str, Any] = {"profile": profile.describe(), "replay_inputs": inputs, "levels": list(levels),
                               "overrides": overrides, "protocol": workload.protocol, "max_tokens": workload.max_tokens,
                               "ramp_s": workload.ramp_s, "requests_per_stream": workload.requests_per_stream,
                               "card_codec": workload.card_codec, "server_cpus": self.args.server_cpus}

        def spec(c: int) -> LoadSpec:
            # As the kit's serve stage: short texts only, so max_tokens fixes every length.
            return LoadSpec(requests=c * workload.requests_per_stream, concurrency=c, protocol=workload.protocol,
                            seed=self.args.seed, max_tokens=workload.max_tokens, ramp_s=workload.ramp_s,
                            text_mix=(1.0, 0.0, 0.0))

        rows, comparison = [], {}
        with self.server("sim-card-serve", overrides) as target:
            if workload.warmup_concurrency:
                out["warmup"] = self.run_level(target, spec(workload.warmup_concurrency), "card serve warm-up")
            codec_start = target.stats().get("codec")
            for c in levels:
                before = target.stats().get("codec")
                row = self.run_level(target, spec(c), "card serve")
                level_codec = codec_totals(target.stats().get("codec"), before)
                if level_codec and row.get("codec_ms_per_pass") is None:
                    row["codec_ms_per_pass"] = level_codec["ms_per_pass"]
                    row["codec_frames_per_pass"] = level_codec["frames_per_pass"]
                rows.append(row)
            run_codec = codec_totals(target.stats().get("codec"), codec_start)
        out["replay_codec"] = run_codec
        for row in rows:
            card_row = workload.card_rows.get(row["concurrency"])
            if card_row is None:
                continue
            # The card recorded its codec per run, not per level: both sides then use the run's totals.
            per_run = not (card_row.get("admission_inputs") or card_row.get("codec_ms_per_pass"))
            replay_row = {k: v for k, v in row.items()
                          if not (per_run and k in ("admission_inputs", "codec_ms_per_pass"))}
            entries = compare_level(card_row, replay_row, card_codec=workload.card_codec, replay_codec=run_codec)
            comparison[str(row["concurrency"])] = entries
            print(format_comparison(row["concurrency"], entries), flush=True)
        if inputs["unmeasured_paths"]:
            print(f"{inputs['label']}: {', '.join(inputs['unmeasured_paths'])}", flush=True)
        out["rows"] = rows
        out["comparison"] = comparison
        return out


def print_row(title: str, row: dict[str, Any]) -> None:
    share = row.get("realtime_of_started")
    print(f"{title:>28} c={row['concurrency']:<4} ok={row['succeeded']}/{row['requests']} "
          f"refused={row['rejected']} errors={row['errors']} "
          f"ttfb p50/p95={row['ttfb_p50_ms']}/{row['ttfb_p95_ms']} ms  rtf={row['rtf_mean']}  "
          f"underrun streams={row['underrun_streams']}  realtime={row['realtime_streams']}"
          f" ({'-' if share is None else f'{share:.1%}'} of started)  playing at once={row['concurrent_peak']}  "
          f"audio s/s={row['audio_seconds_per_second']}  cpu s/audio s={row['server_cpu_s_per_audio_s']}  "
          f"cpu us/token core/api={row.get('core_cpu_us_per_token')}/{row.get('api_cpu_us_per_token')}  "
          f"step loop/engine ms={row.get('loop_ms_per_step')}/{row.get('engine_ms_per_step')}  "
          f"codec ms/pass={row.get('codec_ms_per_pass')} ({row.get('codec_frames_per_pass')} frames)  "
          f"generating at once peak/capacity at saturation={row.get('admitted_peak')}/"
          f"{row.get('capacity_at_saturation')}  "
          f"lag ms gateway max/client p99/max={row.get('gateway_lag_ms_max')}/{row.get('client_loop_lag_ms_p99')}/"
          f"{row.get('client_loop_lag_ms_max')}",
          flush=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from ..config import load_config

    config = load_config(args.config, overrides=args.set)
    ttfb_target = args.ttfb_target_ms or config.active_profile.target_ttfb_ms
    bench = Bench(args, config.active_profile.max_text_chars, max_frames_per_pass=config.codec.max_frames_per_pass)
    results: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%S"), "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                               "environment": environment(), "ttfb_target_ms": ttfb_target}
    modes = {"single", "scaling", "tuning", "sim"} if args.mode == "all" else {args.mode}
    t0 = time.perf_counter()
    batched_top = None
    if args.input_stream:
        modes.add("input-stream")
    if "input-stream" in modes:
        with bench.server("input-stream") as target:
            results["input_stream"] = bench.input_stream(target, ttfb_target)
    if modes & {"single", "scaling"} or args.compare:
        with bench.server("batched") as target:
            if "single" in modes:
                results["single"] = bench.single(target)
            if "scaling" in modes:
                results["scaling"] = bench.scaling(target, ttfb_target, config.active_profile.target_concurrent)
            if "scaling" in modes:
                batched_top = results["scaling"]["rows"][-1]
            elif args.compare:
                batched_top = bench.run_level(target, bench.spec(args.concurrent), "batched")
            results["server_stats"] = target.stats()
    if "tuning" in modes and not args.url:
        results["tuning"] = bench.tuning()
    if "sim" in modes and not args.url:
        if args.sim_card_serve:
            if args.sim_profile is None:
                raise SystemExit("--sim-card-serve replays a profile folder's serve stage: give --sim-profile")
            results["sim_card_serve"] = bench.card_serve()
        else:
            results["sim"] = bench.sim()
    if args.compare and not args.url:
        results["compare"] = bench.compare(batched_top)
    results["wall_seconds"] = round(time.perf_counter() - t0, 1)
    plots = write_results(args.output, results)
    print(f"\nwrote {args.output}" + "".join(f"\nwrote {p}" for p in plots))
    return 0


if __name__ == "__main__":
    sys.exit(main())
