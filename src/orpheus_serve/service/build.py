"""Wiring: a `TTSService` from config (tokenizer, engine, codec, and the engine-core client: in-process,
or `MPClient` with the engine core in a process of its own when `server.engine_process` is set).

`build_service(config)` is what the server and the tools call; `assemble_service`
takes an engine and decoder already built (tests, tools with their own engine).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..codec.base import StreamingDecoder
from ..config import Config
from ..core.client import InprocClient
from ..engines.base import TokenEngine
from ..request.types import ModelInfo
from ..scheduler import FramesReady, SchedulerEvent, SessionFinished
from .service import TTSService

log = logging.getLogger(__name__)


class TokenLog(dict[str, dict[str, Any]]):
    """session id -> text, prompt ids, frames and finish reason of every session (tooling: --tokens-out,
    and tests that compare streamed audio with an offline decode of the same frames)."""

    def record(self, session_id: str, text: str, prompt_ids: tuple[int, ...]) -> None:
        self[session_id] = {"text": text, "prompt_ids": list(prompt_ids), "frames": [], "finish_reason": None}

    def on_frames(self, event: FramesReady) -> None:
        """Engine core thread."""
        entry = self.get(event.request_id)
        if entry is not None:
            entry["frames"].extend(event.frames.tolist())

    def on_event(self, event: SchedulerEvent) -> None:
        """Engine core thread."""
        if isinstance(event, SessionFinished) and event.request_id in self:
            self[event.request_id]["finish_reason"] = event.reason


def assemble_service(config: Config, *, engine: TokenEngine, decoder: StreamingDecoder, tokenizer: Any,
                     model_info: ModelInfo, codec_device: str = "cpu", record_tokens: bool = False) -> TTSService:
    token_log = TokenLog() if record_tokens else None
    client = InprocClient(config, engine, decoder, codec_device=codec_device,
                          on_frames=token_log.on_frames if token_log is not None else None,
                          on_event=token_log.on_event if token_log is not None else None)
    return TTSService(config, client=client, tokenizer=tokenizer, model_info=model_info,
                      max_seq_len=engine.max_seq_len, token_log=token_log)


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


def build_engine_and_decoder(config: Config) -> tuple[TokenEngine, StreamingDecoder, str]:
    """Engine, decoder and the codec's device from a config whose model paths are resolved
    (`resolve_models`). Runs where the engine core runs: this process, or the engine-core process."""
    from ..codec import build_decoder, load_snac
    from ..codec.sim import SimDecoder
    from ..config import resolve_device, resolve_dtype
    from ..engines.factory import create_engine

    engine = create_engine(config)
    codec_device = resolve_device(config.codec.device)
    if config.codec.decoder == "sim":
        sim = config.codec.sim
        decoder: StreamingDecoder = SimDecoder(base_ms=sim.base_ms, per_frame_ms=sim.per_frame_ms,
                                               realtime=sim.realtime)
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


def build_service(config: Config, *, record_tokens: bool = False) -> TTSService:
    """Build tokenizer, engine and codec from config, falling back to the tiny models if needed.

    With `server.engine_process` the engine and codec are built in the engine-core process
    (`MPClient` starts it and waits until it is built); this process loads only the tokenizer."""
    resolved = resolve_models(config)
    config = resolved.config
    tokenizer = load_tokenizer(resolved.tokenizer_path)
    if config.server.engine_process and record_tokens:
        # The token log taps the engine core's threads; tooling that asks for it gets them in this process.
        log.info("recording tokens: the engine core runs in this process (server.engine_process ignored)")
    elif config.server.engine_process:
        from ..core.mp_client import MPClient

        client = MPClient(config)
        core = client.launch()
        return TTSService(config, client=client, tokenizer=tokenizer, model_info=resolved.info,
                          max_seq_len=core.max_seq_len)
    engine, decoder, codec_device = build_engine_and_decoder(config)
    return assemble_service(config, engine=engine, decoder=decoder, tokenizer=tokenizer, model_info=resolved.info,
                            codec_device=codec_device, record_tokens=record_tokens)


def load_tokenizer(path: str | Path) -> Any:
    """A `tokenizers.Tokenizer` from a Hugging Face folder (tokenizer.json)."""
    from tokenizers import Tokenizer

    file = Path(path) / "tokenizer.json"
    if not file.exists():
        raise FileNotFoundError(f"no tokenizer.json in {path}")
    return Tokenizer.from_file(str(file))
