"""Typed configuration.

`config/model_config.yaml` holds every tuning parameter. `load_config` reads it,
applies the selected profile's overrides, then environment variables
(`ORPHEUS_SERVE__SECTION__KEY=value`, nested with double underscores), then
`--set section.key=value` overrides from the command line. Everything is
validated by pydantic with unknown keys forbidden; any problem becomes a
`ConfigError` whose message is one line naming the key and what is allowed.

The config object is passed to whoever needs it; nothing reads it globally.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

ENV_PREFIX = "ORPHEUS_SERVE__"
DEFAULT_CONFIG_PATH = Path(__file__).resolve().parents[2] / "config" / "model_config.yaml"
JSON_BYTES_PER_CHAR = 12  # the most one character can take in a JSON string: a surrogate pair, "\\ud83d\\ude00"
WS_MESSAGE_ENVELOPE_BYTES = 4096  # a text message's other fields (context id, voice and output settings)


class ConfigError(ValueError):
    """A config problem, described in one line that names the key."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class SchedulerConfig(_Strict):
    max_concurrent_sessions: int = Field(32, ge=1, le=4096)
    max_batch_size: int = Field(16, ge=1, le=4096)
    ttfb_priority_tokens: int = Field(20, ge=0)
    flush_first_n_tokens: int = Field(7, ge=7)
    flush_every_n_tokens: int = Field(14, ge=7)
    prefill_chunk_tokens: int = Field(256, ge=1)
    session_timeout_s: float = Field(120.0, gt=0)
    queue_timeout_s: float = Field(30.0, gt=0)
    max_queue: int = Field(64, ge=0)
    policy: Literal["fair", "deadline"] = "fair"
    deadline_yield_s: float = Field(1.0, ge=0)
    deadline_stalled_max_wait_s: float = Field(5.0, ge=0)
    # Flow control (ARCHITECTURE §5a): what a session may run ahead of its codec and its client.
    max_undecoded_frames: int = Field(12, ge=2, le=4096)  # generated, not yet decoded: past it, no decode steps
    max_client_buffer_s: float = Field(3.0, gt=0)  # audio the client holds unplayed: past it, the session waits
    max_server_buffer_s: float = Field(2.0, gt=0)  # decoded audio not yet taken by the client's socket
    # Over the measured capacity: wait in the queue, or 503 at once. `slots`: admit whenever a slot is free
    # (no real-time promise: bulk or offline synthesis that wants the biggest batches).
    admission: Literal["queue", "reject", "slots"] = "queue"
    # Admit while every stream runs faster than real time by a margin measured from the spread of loop periods and
    # codec passes (twice their jitter, relative), at least admission_margin_floor (ARCHITECTURE §5a).
    # admission_headroom: a fixed margin instead.
    admission_margin_floor: float = Field(0.05, ge=0, le=4)
    admission_headroom: float | None = Field(None, ge=0, le=4)
    first_chunk_safety: float = Field(1.5, ge=1, le=10)  # first audio covers this many times the next frame's wait
    # A gateway (API process) whose event loop runs this late cannot hand audio out in time: admission closes
    # until it catches up (0: never). Its loop lag is measured every 50 ms and smoothed over a few ticks.
    max_gateway_lag_ms: float = Field(150.0, ge=0)

    @model_validator(mode="after")
    def _whole_frames(self) -> SchedulerConfig:
        for name in ("flush_first_n_tokens", "flush_every_n_tokens"):
            if getattr(self, name) % 7:
                raise ValueError(f"{name} must be a multiple of 7 (one audio frame is 7 tokens)")
        if self.flush_every_n_tokens // 7 > self.max_undecoded_frames:
            raise ValueError("flush_every_n_tokens must fit within max_undecoded_frames frames")
        return self


class SimCodecConfig(_Strict):
    base_ms: float = Field(1.5, ge=0)  # per batched forward pass
    per_frame_ms: float = Field(0.25, ge=0)
    realtime: bool = True


class CodecConfig(_Strict):
    path: str = "models/snac_24khz"
    # stateful: exact, each frame decoded once; windowed: overlapping windows (fallback);
    # reference: the reference implementation's 4-frame window per frame (baseline mode);
    # sim: no SNAC, exact-length tone with a modelled GPU cost (capacity simulation only)
    decoder: Literal["stateful", "windowed", "reference", "sim"] = "stateful"
    left_context_frames: int = Field(3, ge=0, le=16)
    lookahead_frames: int = Field(2, ge=0, le=16)
    dtype: Literal["auto", "fp32", "fp16", "bf16"] = "auto"
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$")
    noise: bool = True
    seed: int | None = None
    compile: bool = False
    max_batch: int = Field(64, ge=1)
    # Stateful decoder on CUDA: steps padded to batch buckets and replayed as CUDA graphs captured at load, so a
    # pass costs the host a copy, a gather, a replay and a scatter per step (ARCHITECTURE §4). No effect on a CPU.
    cuda_graphs: bool = True
    # Stateful decoder: a pass's pushes of unequal lengths (first pushes, streaming ones, final flushes) share one
    # forward step, each row advancing by what it has, instead of a step per distinct length (ARCHITECTURE §4).
    # It computes the shorter rows' padding: auto turns it on where a step is launch-bound (CUDA, and the replay
    # of a card), off on a CPU; true or false (YAML's on or off) forces it.
    ragged_steps: Literal["auto"] | bool = "auto"
    max_frames_per_pass: int = Field(64, ge=1)  # frames one worker pass may decode, across all sessions
    max_frames_per_session: int = Field(4, ge=1)  # frames one session may contribute to a pass (round-robin)
    max_pass_ms: float = Field(100.0, gt=0)  # and fewer frames when the measured pass would take longer (CPU)
    # A pass waits up to max_pass_wait_ms for min_pass_frames to be pending, unless a client is short of audio or
    # waits for its first: launch-bound passes (a GPU's stateful decoder) cost the same for 2 frames as for 32,
    # and back-to-back small ones hold the interpreter the engine loop needs. 0 ms: never wait.
    min_pass_frames: int = Field(32, ge=1)
    max_pass_wait_ms: float = Field(20.0, ge=0)
    sim: SimCodecConfig = SimCodecConfig()

    @model_validator(mode="after")
    def _compile_needs_a_module_decoder(self) -> CodecConfig:
        # torch.compile wraps SNAC's own decoder layers, which the windowed and reference decoders
        # run; the stateful decoder runs its own streaming ops and would silently ignore it.
        if self.compile and self.decoder not in ("windowed", "reference"):
            raise ValueError(f"compile applies to the windowed and reference decoders, not {self.decoder!r}")
        return self


class TensorRTConfig(_Strict):
    engine_dir: str = "engines/orpheus-fp8"
    kv_cache_free_gpu_memory_fraction: float = Field(0.85, gt=0, le=1)
    max_num_tokens: int = Field(8192, ge=1)


class SimConfig(_Strict):
    step_base_ms: float = Field(9.0, ge=0)
    step_per_seq_ms: float = Field(0.12, ge=0)
    step_per_ctx_token_ms: float = Field(0.00004, ge=0)  # 112 KiB of KV per token at ~2.8 TB/s
    prefill_per_token_ms: float = Field(0.02, ge=0)
    end_after_frames: int | None = Field(None, ge=1)
    realtime: bool = True
    # A GPU kit result folder (scripts/gpu) to replay instead of the formula above: the measured card's step,
    # prefill and codec-pass times, its launch time on the interpreter and its contention (replay/, with
    # `codec.decoder: sim`). profile_variant: the engine rows replayed (default: triton where measured).
    profile: str | None = None
    profile_variant: str | None = None


class EngineConfig(_Strict):
    backend: Literal["torch", "tensorrt", "sim"] = "torch"
    mode: Literal["batched", "baseline"] = "batched"
    model_path: str = "models/orpheus"
    tokenizer_path: str | None = None
    dtype: Literal["auto", "fp32", "fp16", "bf16"] = "auto"
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$")
    max_seq_len: int = Field(4096, ge=64)
    cuda_graphs: bool = True
    # Launch step N+1 before reading step N back, so planning and bookkeeping overlap the running step (engines
    # with launch/collect: torch, sim; ARCHITECTURE §4). false: one step at a time.
    overlap: bool = True
    # Attention kernels PyTorch may choose from on CUDA (torch backend; engines/sdpa.py: cuDNN's rebuilds per shape).
    sdpa_backends: list[Literal["efficient", "math", "flash", "cudnn"]] = Field(["efficient", "math"], min_length=1)
    memory_fraction: float = Field(0.9, gt=0, le=1)
    # Torch backend (docs/ATTENTION.md). Decode attention: the Triton kernel over the slot cache or SDPA over a
    # gathered copy (auto: triton on CUDA); the KV cache's dtype (auto: the model's; fp8: e4m3, per-head scales);
    # fp8: the decoder layers' GEMMs in e4m3 through torch._scaled_mm.
    attention: Literal["auto", "sdpa", "triton"] = "auto"
    kv_cache_dtype: Literal["auto", "fp32", "fp16", "bf16", "fp8"] = "auto"
    quantization: Literal["none", "fp8"] = "none"
    # Torch backend: the decode pass under torch.compile (inductor) with a dynamic batch, then captured in CUDA
    # graphs as without it (engines/compiled.py). Compiled code is cached in compile_cache_dir (null:
    # ~/.cache/orpheus-serve/torch-compile), so a restart does not compile again.
    compile: bool = False
    compile_cache_dir: str | None = None
    # Fused Triton kernels in the decoder layers (residual add + RMSNorm, with fp8 the activations' quantisation,
    # SiLU x up, rotary + KV cache write; engines/fused.py). Off until a card's measurement says it wins.
    fused: bool = False
    # A folder where the engine core takes profiling requests: write a step count into DIR/arm and the next that
    # many engine-core steps are profiled into DIR/profile.json (engines/profiling.py; the GPU kit's serve stage).
    profile_dir: str | None = None
    # Torch's intra-op threads where the engine core runs (core/build.py: cpu_threads). auto: with the engine or
    # the codec on the CPU in batched mode, half the cores this process may use, since the engine's steps and the
    # codec's passes run side by side on threads of their own (each with its own team of intra-op threads, which
    # otherwise spin against each other); baseline mode, a GPU-only pipeline, or OMP_NUM_THREADS set: torch's own.
    cpu_threads: int | Literal["auto"] = Field("auto")
    tensorrt: TensorRTConfig = TensorRTConfig()
    sim: SimConfig = SimConfig()

    @model_validator(mode="after")
    def _threads(self) -> EngineConfig:
        if self.cpu_threads != "auto" and self.cpu_threads < 1:
            raise ValueError("engine.cpu_threads must be auto or at least 1")
        return self


class SamplingConfig(_Strict):
    temperature: float = Field(0.6, ge=0, le=5)
    top_p: float = Field(0.8, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    repetition_penalty: float = Field(1.1, ge=1.0, le=3.0)
    constrained: bool = True
    tokens_per_char: float = Field(12.0, gt=0)
    min_tokens: int = Field(280, ge=7)
    max_tokens: int = Field(3500, ge=7)

    @model_validator(mode="after")
    def _bounds(self) -> SamplingConfig:
        if self.min_tokens > self.max_tokens:
            raise ValueError("min_tokens must not exceed max_tokens")
        return self

    def max_tokens_for(self, text: str) -> int:
        """Token budget for one text chunk: proportional to its length, whole frames."""
        budget = int(len(text) * self.tokens_per_char)
        budget = max(self.min_tokens, min(self.max_tokens, budget))
        return max(7, budget - budget % 7)


class ServerConfig(_Strict):
    host: str = "0.0.0.0"
    http_port: int = Field(8000, ge=0, le=65535)
    grpc_port: int = Field(50051, ge=0, le=65535)
    api_keys: list[str] = []
    max_body_bytes: int = Field(65536, ge=1024)
    # The largest WebSocket message read (Config.ws_message_bytes: never less than the longest allowed text needs).
    # A message over it closes its socket with 1009, every context on it too; text over a character limit in a
    # smaller message is refused for its own context only.
    max_ws_message_bytes: int = Field(262144, ge=1024)
    max_connections: int = Field(256, ge=1)
    max_ws_requests_per_connection: int = Field(1000, ge=1)
    max_ws_contexts_per_connection: int = Field(16, ge=1)  # contexts open (running or queued) on one WebSocket
    shutdown_grace_s: float = Field(10.0, ge=0)
    stalled_client_timeout_s: float = Field(10.0, gt=0)  # a client that takes no audio this long is cut off
    socket_send_buffer_bytes: int | None = Field(65536, ge=4096)  # kernel send buffer per HTTP/WS connection
    ready_max_backlog_s: float = Field(2.0, gt=0)  # /ready says saturated when the oldest undecoded frame is older
    switch_interval_ms: float = Field(1.0, gt=0, le=100)  # interpreter-lock hand-off between server threads
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    playground: bool = True  # the web page at / and /playground (static files, no internet needed)
    # The engine core (scheduler, engine, codec worker) in a process of its own, fed over ZeroMQ
    # (core/mp_client.py): the production default. false: threads of this process (core.client.InprocClient), for
    # embedding a service in a program of one's own and for tools that want one process.
    engine_process: bool = True
    # API processes (HTTP/WebSocket + gRPC, sharing the ports with SO_REUSEPORT) in front of the one engine
    # core (api/process_group.py); more than 1 needs engine_process.
    api_processes: int = Field(1, ge=1, le=64)
    restart_core: bool = True  # start a dead engine-core process again; false: the server exits non-zero
    restart_api_processes: bool = True  # start a dead API process (1..N-1) again; false: the server exits non-zero
    core_call_timeout_s: float = Field(5.0, gt=0)  # longest wait for the engine core's answer to a submit

    @model_validator(mode="after")
    def _api_processes_need_the_core_process(self) -> ServerConfig:
        if self.api_processes > 1 and not self.engine_process:
            raise ValueError("server.api_processes > 1 needs server.engine_process: true "
                             "(the API processes share one engine core in a process of its own)")
        return self


class StreamInputConfig(_Strict):
    """Incremental text (contexts, ARCHITECTURE §5b): when text that arrives in pieces becomes a generation chunk."""

    # A clause boundary (, ; : or a dash) cuts a chunk once this much text precedes it; a sentence end always does.
    min_chunk_chars: int = Field(24, ge=1, le=200)
    # Complete words buffered this long without a boundary are cut anyway, so speech starts while text trickles in.
    max_buffer_delay_ms: float = Field(400.0, ge=0, le=10_000)
    max_buffered_chars: int = Field(4096, ge=200)  # text pushed and not yet generated; past it a push is refused
    idle_timeout_s: float = Field(30.0, gt=0)  # a context with nothing buffered and no text for this long ends


class VoicesConfig(_Strict):
    """Custom voices: LoRA adapters served beside the base model in the same batch (engines/lora.py)."""

    # A folder of PEFT LoRA adapters, one sub-folder per voice (adapter_config.json, adapter_model.safetensors,
    # optional voice.json); None: no custom voices (and no adapter pool).
    adapters_dir: str | None = None
    max_loras: int = Field(8, ge=1, le=1024)  # adapters in the device pool at once (LRU over the folder)
    max_lora_rank: int = Field(64, ge=1, le=1024)  # the pool's rank; an adapter of a higher rank is refused
    # Longest wait for an adapter's files to be read and checked (an admin load, a voice's first session since
    # it left the pool); past it that call fails with 503 and the engine core goes on (its other calls are
    # answered meanwhile: the files are read on a thread of their own).
    read_timeout_s: float = Field(60.0, gt=0)
    # How decode steps add the rows' adapters (torch backend): triton, the segmented kernels that read each adapter
    # once per step (engines/lora_kernels.py); torch, a gather of every row's adapter (CUDA graphs) or the host's
    # grouping (eager); auto: triton on CUDA.
    lora_kernel: Literal["auto", "torch", "triton"] = "auto"


class ProfileConfig(_Strict):
    max_text_chars: int = Field(ge=1)  # counted after normalisation (request/text.py)
    # Tokens of the normalised text, all chunks together; None: 2 x max_text_chars (a character limit alone
    # lets token-dense text through: 250 emoji were about 1,000 prompt tokens).
    max_prompt_tokens: int | None = Field(None, ge=1)
    target_concurrent: int = Field(ge=1)
    target_ttfb_ms: float = Field(gt=0)
    overrides: dict[str, Any] = {}

    @property
    def prompt_token_limit(self) -> int:
        return self.max_prompt_tokens if self.max_prompt_tokens is not None else 2 * self.max_text_chars


DEFAULT_PROFILES = {
    "conversational": ProfileConfig(max_text_chars=4096, target_concurrent=24, target_ttfb_ms=100),
    "longform": ProfileConfig(max_text_chars=5000, target_concurrent=16, target_ttfb_ms=300),
}


class Config(_Strict):
    profile: str = "conversational"
    scheduler: SchedulerConfig = SchedulerConfig()
    codec: CodecConfig = CodecConfig()
    engine: EngineConfig = EngineConfig()
    sampling: SamplingConfig = SamplingConfig()
    server: ServerConfig = ServerConfig()
    stream_input: StreamInputConfig = StreamInputConfig()
    voices: VoicesConfig = VoicesConfig()
    profiles: dict[str, ProfileConfig] = dict(DEFAULT_PROFILES)

    @model_validator(mode="after")
    def _check(self) -> Config:
        if self.profile not in self.profiles:
            allowed = ", ".join(sorted(self.profiles))
            raise ValueError(f"profile {self.profile!r} is not defined; allowed: {allowed}")
        if self.scheduler.max_batch_size > self.scheduler.max_concurrent_sessions:
            raise ValueError("scheduler.max_batch_size must not exceed scheduler.max_concurrent_sessions")
        return self

    @property
    def active_profile(self) -> ProfileConfig:
        return self.profiles[self.profile]

    @property
    def ws_message_bytes(self) -> int:
        """The WebSocket message limit: server.max_ws_message_bytes, raised where needed to fit a message carrying
        the longest text a request or a context's buffer may hold with every character escaped as a JSON
        surrogate pair (12 bytes), plus the message's other fields."""
        longest = max(self.active_profile.max_text_chars, self.stream_input.max_buffered_chars)
        return max(self.server.max_ws_message_bytes, JSON_BYTES_PER_CHAR * longest + WS_MESSAGE_ENVELOPE_BYTES)


def _format_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    key = ".".join(str(p) for p in err["loc"]) or "config"
    msg = err["msg"]
    if err["type"] == "extra_forbidden":
        msg = "unknown key"
    elif err["type"] == "literal_error":
        msg = f"must be one of {err['ctx']['expected']}"
    elif msg.startswith("Value error, "):
        msg = msg.removeprefix("Value error, ")
    got = err.get("input")
    got_s = "" if isinstance(got, dict | list) or got is None else f" (got {got!r})"
    return f"config error: {key}: {msg}{got_s}"


def _set_path(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"config error: {dotted}: {part} is not a section")
        node = child
    node[parts[-1]] = value


def _parse_scalar(text: str) -> Any:
    """Values from env vars and --set are YAML scalars: 8, 0.5, true, null, [a, b]."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    """`["scheduler.max_batch_size=8", ...]` -> `{"scheduler.max_batch_size": 8}`."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"config error: override {item!r} must look like section.key=value")
        out[key.strip()] = _parse_scalar(value.strip())
    return out


def env_overrides(env: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in env.items():
        if name.startswith(ENV_PREFIX):
            dotted = name[len(ENV_PREFIX) :].lower().replace("__", ".")
            out[dotted] = _parse_scalar(value)
    return out


def load_config(
    path: str | Path | None = None,
    *,
    profile: str | None = None,
    overrides: Mapping[str, Any] | Sequence[str] | None = None,
    env: Mapping[str, str] | None = None,
) -> Config:
    """Load, merge and validate the config; raise ConfigError with a one-line message."""
    path = Path(path) if path is not None else DEFAULT_CONFIG_PATH
    raw: dict[str, Any] = {}
    if path.exists():
        try:
            loaded = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"config error: {path}: not valid YAML ({exc.__class__.__name__})") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config error: {path}: the top level must be a mapping")
        raw = loaded
    elif path != DEFAULT_CONFIG_PATH:
        raise ConfigError(f"config error: {path}: no such file")

    env_items = env_overrides(os.environ if env is None else env)
    cli_items = dict(overrides) if isinstance(overrides, Mapping) else parse_overrides(overrides or [])

    if profile is not None:
        raw["profile"] = profile
    elif "profile" in env_items:
        raw["profile"] = env_items.pop("profile")
    elif "profile" in cli_items:
        raw["profile"] = cli_items.pop("profile")

    try:
        base = Config.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(_format_error(exc)) from None

    merged = base.model_dump()
    for key, value in {**base.active_profile.overrides, **env_items, **cli_items}.items():
        _set_path(merged, key, value)
    try:
        return Config.model_validate(merged)
    except ValidationError as exc:
        raise ConfigError(_format_error(exc)) from None


def resolve_device(device: str) -> str:
    """`auto` -> `cuda` when a GPU is visible, else `cpu`."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(dtype: str, device: str, *, cuda_default: str = "bf16") -> str:
    """`auto` -> `cuda_default` on CUDA, fp32 on CPU."""
    if dtype != "auto":
        return dtype
    return cuda_default if device.startswith("cuda") else "fp32"


def apply_engine_mode(config: Config) -> Config:
    """`engine.mode: baseline` serves the way the reference implementation does, for side-by-side
    benchmarks: one request at a time (one slot, batch 1, the rest queue), a 4-frame SNAC window
    decoded every 7 tokens (`codec.decoder: reference`). `batched` returns the config unchanged."""
    if config.engine.mode == "batched":
        return config
    scheduler = config.scheduler.model_copy(update={
        "max_concurrent_sessions": 1,
        "max_batch_size": 1,
        "flush_first_n_tokens": 7,
        "flush_every_n_tokens": 7,
        "queue_timeout_s": max(config.scheduler.queue_timeout_s, 600.0),
    })
    codec = config.codec.model_copy(update={"decoder": "reference"})
    return config.model_copy(update={"scheduler": scheduler, "codec": codec})
