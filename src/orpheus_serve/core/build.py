"""Core-side construction: the model paths resolved from config, and the engine and decoder built from them.

Runs where the engine core runs (the API process with an in-process core, or the engine-core process);
the API side (service.build) calls `resolve_models` too, for the tokenizer path and the model info.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ..codec.base import StreamingDecoder
from ..config import Config
from ..engines.base import TokenEngine
from ..request.types import ModelInfo

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ResolvedModels:
    """The config with its model paths resolved (tiny fallback applied), and what is served."""

    config: Config
    info: ModelInfo
    tokenizer_path: str


def resolve_models(config: Config) -> ResolvedModels:
    """Engine mode applied, backend checked, model paths resolved (the tiny models if the real ones are
    missing, said loudly). Cheap: loads nothing."""
    from ..config import apply_engine_mode
    from ..engines.factory import check_backend
    from ..weights.paths import resolve_model_paths

    config = apply_engine_mode(config)
    check_backend(config)
    paths = resolve_model_paths(config)
    if paths.warning:
        log.warning("!" * 72)
        log.warning(paths.warning)
        log.warning("!" * 72)
    engine_cfg = config.engine.model_copy(update={"model_path": str(paths.model_path)})
    codec_cfg = config.codec.model_copy(update={"path": str(paths.codec_path)})
    config = config.model_copy(update={"engine": engine_cfg, "codec": codec_cfg})
    info = ModelInfo(
        id="orpheus-tiny" if paths.tiny else Path(paths.model_path).name,
        backend=config.engine.backend,
        model_path=str(paths.model_path),
        codec_path=str(paths.codec_path),
        tiny=paths.tiny,
        warning=paths.warning,
    )
    return ResolvedModels(config=config, info=info, tokenizer_path=str(paths.tokenizer_path))


def cpu_threads(config: Config, *, environ: Mapping[str, str] = os.environ, cores: int | None = None) -> int | None:
    """Torch intra-op threads for the process the engine core runs in (`engine.cpu_threads`), or None for torch's
    own choice. auto, in batched mode with the engine or the codec on the CPU: half the cores this process may
    run on. The engine's steps and the codec's passes run side by side on two threads, each fanning its ops out
    to a team of intra-op threads; with a team as wide as the machine, two teams spin against each other (on 2
    cores the codec's passes ran 20-30% longer and the core burned a third more CPU a token:
    docs/PERFORMANCE.md). Baseline mode keeps torch's default, as the reference implementation does; so does a
    pipeline wholly on a GPU, and an OMP_NUM_THREADS the operator set."""
    from ..config import resolve_device

    wanted = config.engine.cpu_threads
    if wanted != "auto":
        return wanted
    if config.engine.mode != "batched" or "OMP_NUM_THREADS" in environ:
        return None
    on_cpu = config.engine.backend != "sim" and resolve_device(config.engine.device) == "cpu"
    on_cpu = on_cpu or (config.codec.decoder != "sim" and resolve_device(config.codec.device) == "cpu")
    if not on_cpu:
        return None
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // 2)


def build_engine_and_decoder(config: Config) -> tuple[TokenEngine, StreamingDecoder, str]:
    """Engine, decoder and the codec's device from a config whose model paths are resolved
    (`resolve_models`). Runs where the engine core runs: this process, or the engine-core process."""
    import torch

    from ..codec import build_decoder, load_snac
    from ..codec.sim import SimDecoder
    from ..config import resolve_device, resolve_dtype
    from ..engines.factory import create_engine

    threads = cpu_threads(config)
    if threads is not None:
        torch.set_num_threads(threads)
        log.info("torch intra-op threads: %d (engine.cpu_threads=%s)", threads, config.engine.cpu_threads)
    card = None
    if config.engine.backend == "sim" and config.engine.sim.profile:
        from ..replay import ModelledCard, load_profile

        # One card for the engine and the codec: they share its device and this process's interpreter.
        card = ModelledCard(load_profile(config.engine.sim.profile, variant=config.engine.sim.profile_variant))
        log.info("replaying the card measured in %s (%s, %s steps)", config.engine.sim.profile,
                 card.profile.card, card.profile.variant)
    engine = create_engine(config, card=card)
    codec_device = resolve_device(config.codec.device)
    if config.codec.decoder == "sim":
        sim = config.codec.sim
        decoder: StreamingDecoder = SimDecoder(base_ms=sim.base_ms, per_frame_ms=sim.per_frame_ms,
                                               realtime=sim.realtime, card=card, max_batch=config.codec.max_batch,
                                               ragged=config.codec.ragged_steps is not False)
    else:
        snac = load_snac(
            config.codec.path,
            device=codec_device,
            dtype=resolve_dtype(config.codec.dtype, codec_device, cuda_default="fp16"),
            noise=config.codec.noise,
            seed=config.codec.seed,
            compile=config.codec.compile,
        )
        decoder = build_decoder(config.codec, snac)
    return engine, decoder, codec_device
