"""API-side wiring: a `TTSService` from config (tokenizer, and the engine-core client: in-process, or
`MPClient` with the engine core in a process of its own when `server.engine_process` is set). What the
engine core itself is built from (engine, codec) is core.build, used by either.

`build_service(config)` is what the server and the tools call; `assemble_service`
takes an engine and decoder already built (tests, tools with their own engine).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ..codec.base import StreamingDecoder
from ..config import Config
from ..core.build import build_engine_and_decoder, resolve_models
from ..core.client import InprocClient
from ..engines.base import TokenEngine
from ..request.types import ModelInfo
from .service import TTSService
from .token_log import TokenLog

log = logging.getLogger(__name__)


def assemble_service(config: Config, *, engine: TokenEngine, decoder: StreamingDecoder, tokenizer: Any,
                     model_info: ModelInfo, codec_device: str = "cpu", record_tokens: bool = False) -> TTSService:
    token_log = TokenLog() if record_tokens else None
    client = InprocClient(config, engine, decoder, codec_device=codec_device,
                          on_frames=token_log.on_frames if token_log is not None else None,
                          on_event=token_log.on_event if token_log is not None else None)
    return TTSService(config, client=client, tokenizer=tokenizer, model_info=model_info,
                      max_seq_len=engine.max_seq_len, token_log=token_log)


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
