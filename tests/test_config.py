from __future__ import annotations

from pathlib import Path

import pytest

from orpheus_serve.config import DEFAULT_CONFIG_PATH, ConfigError, load_config


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_repo_config_loads_with_documented_defaults() -> None:
    cfg = load_config(DEFAULT_CONFIG_PATH, env={})
    assert cfg.scheduler.max_concurrent_sessions == 32
    assert cfg.scheduler.max_batch_size == 16
    assert cfg.scheduler.ttfb_priority_tokens == 20
    assert (cfg.scheduler.flush_first_n_tokens, cfg.scheduler.flush_every_n_tokens) == (7, 14)
    assert cfg.scheduler.policy == "fair"
    assert cfg.engine.backend == "torch"
    assert cfg.profiles["conversational"].max_text_chars == 4096  # OpenAI's limit
    assert cfg.profiles["conversational"].target_concurrent == 24
    assert cfg.profiles["longform"].max_text_chars == 5000
    assert cfg.profiles["longform"].target_ttfb_ms == 300
    assert cfg.active_profile.max_text_chars == 4096


def test_profile_selects_preset_and_its_overrides(tmp_path: Path) -> None:
    p = write(tmp_path, """
profiles:
  conversational: {max_text_chars: 250, target_concurrent: 24, target_ttfb_ms: 100}
  longform:
    max_text_chars: 5000
    target_concurrent: 16
    target_ttfb_ms: 300
    overrides: {scheduler.max_concurrent_sessions: 16}
""")
    cfg = load_config(p, profile="longform", env={})
    assert cfg.active_profile.max_text_chars == 5000
    assert cfg.scheduler.max_concurrent_sessions == 16
    assert load_config(p, env={}).scheduler.max_concurrent_sessions == 32


def test_env_then_cli_override(tmp_path: Path) -> None:
    p = write(tmp_path, "scheduler: {max_batch_size: 8}\n")
    env = {"ORPHEUS_SERVE__SCHEDULER__MAX_BATCH_SIZE": "4", "ORPHEUS_SERVE__ENGINE__BACKEND": "sim"}
    cfg = load_config(p, env=env)
    assert cfg.scheduler.max_batch_size == 4
    assert cfg.engine.backend == "sim"
    cfg = load_config(p, env=env, overrides=["scheduler.max_batch_size=2", "codec.noise=false"])
    assert cfg.scheduler.max_batch_size == 2
    assert cfg.codec.noise is False


@pytest.mark.parametrize(
    ("text", "overrides", "needle"),
    [
        ("scheduler: {max_batch_sise: 8}\n", [], "scheduler.max_batch_sise: unknown key"),
        ("scheduler: {policy: fastest}\n", [], "scheduler.policy: must be one of 'fair' or 'deadline'"),
        ("engine: {backend: onnx}\n", [], "engine.backend"),
        ("scheduler: {max_batch_size: -1}\n", [], "scheduler.max_batch_size"),
        ("scheduler: {flush_every_n_tokens: 10}\n", [], "multiple of 7"),
        ("", ["codec.lookahead_frames=lots"], "codec.lookahead_frames"),
        ("", ["nosuch.key=1"], "nosuch: unknown key"),
        ("profile: studio\n", [], "profile 'studio' is not defined"),
        ("scheduler: {max_concurrent_sessions: 4, max_batch_size: 8}\n", [], "max_batch_size must not exceed"),
    ],
)
def test_bad_config_is_one_line_naming_the_key(tmp_path: Path, text: str, overrides: list[str], needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text), overrides=overrides, env={})
    msg = str(info.value)
    assert "\n" not in msg
    assert needle in msg, msg


def test_missing_explicit_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "absent.yaml", env={})


def test_max_tokens_scale_with_text_and_are_whole_frames() -> None:
    s = load_config(env={}).sampling
    short, long_ = s.max_tokens_for("Hi."), s.max_tokens_for("word " * 200)
    assert short % 7 == 0 and long_ % 7 == 0
    assert short == s.min_tokens - s.min_tokens % 7
    assert long_ > short


def test_codec_compile_is_refused_where_it_would_do_nothing() -> None:
    # The stateful decoder runs its own streaming ops, not SNAC's modules that torch.compile wraps.
    with pytest.raises(ConfigError, match="compile applies to the windowed and reference decoders"):
        load_config(overrides=["codec.compile=true"])
    assert load_config(overrides=["codec.compile=true", "codec.decoder=windowed"]).codec.compile


def test_cpu_threads_auto_splits_the_cores_between_the_engine_and_the_codec() -> None:
    """engine.cpu_threads (core/build.py): batched on a CPU, half the cores each for the engine's and the codec's
    threads; baseline mode, an operator's OMP_NUM_THREADS, or a pipeline off the CPU keep torch's own."""
    from orpheus_serve.config import load_config
    from orpheus_serve.core.build import cpu_threads

    cpu = load_config(None, overrides=["engine.device=cpu", "codec.device=cpu"])
    assert cpu_threads(cpu, environ={}, cores=8) == 4
    assert cpu_threads(cpu, environ={}, cores=1) == 1
    assert cpu_threads(cpu, environ={"OMP_NUM_THREADS": "3"}, cores=8) is None
    baseline = load_config(None, overrides=["engine.device=cpu", "engine.mode=baseline"])
    assert cpu_threads(baseline, environ={}, cores=8) is None
    gpu = load_config(None, overrides=["engine.device=cuda", "codec.device=cuda"])
    assert cpu_threads(gpu, environ={}, cores=8) is None
    fixed = load_config(None, overrides=["engine.cpu_threads=3"])
    assert cpu_threads(fixed, environ={"OMP_NUM_THREADS": "1"}, cores=8) == 3
    with pytest.raises(ConfigError):
        load_config(None, overrides=["engine.cpu_threads=0"])
