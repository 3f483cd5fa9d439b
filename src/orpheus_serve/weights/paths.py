"""Where the weights come from: the configured checkpoints, or the tiny stand-ins.

The server prefers the real checkpoints (`engine.model_path`, `codec.path`:
local Hugging Face folders, or hub ids for users with internet and a
populated cache). When a configured local folder is missing it falls back to
the seeded random-weight models under `models/` (building them if needed) and
says so loudly: such a server produces noise, not speech.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from ..config import Config

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[3]
TINY_LLAMA = "tiny-orpheus"
TINY_SNAC = "tiny-snac"


@dataclass(frozen=True, slots=True)
class ModelPaths:
    model_path: Path
    tokenizer_path: Path
    codec_path: Path
    tiny: bool
    warning: str | None


def _local(path: str) -> Path:
    p = Path(path)
    return p if p.is_absolute() else (Path.cwd() / p if (Path.cwd() / p).exists() else REPO_ROOT / p)


def _is_checkpoint(folder: Path) -> bool:
    return (folder / "config.json").exists()


def ensure_tiny_models(models_dir: Path) -> tuple[Path, Path]:
    """models_dir/tiny-orpheus and models_dir/tiny-snac, written once if absent."""
    llama, snac = models_dir / TINY_LLAMA, models_dir / TINY_SNAC
    if not (_is_checkpoint(llama) and _is_checkpoint(snac)):
        from .tiny import write_tiny_models

        log.warning("writing the tiny random-weight models to %s", models_dir)
        write_tiny_models(models_dir, seed=0)
    return llama, snac


def resolve_model_paths(config: Config, *, models_dir: Path | None = None) -> ModelPaths:
    models_dir = models_dir or REPO_ROOT / "models"
    model = _local(config.engine.model_path)
    codec = _local(config.codec.path)
    tokenizer = _local(config.engine.tokenizer_path) if config.engine.tokenizer_path else model
    missing = [str(p) for p in (model, codec) if not _is_checkpoint(p)]
    if not missing:
        return ModelPaths(model, tokenizer, codec, tiny=False, warning=None)
    tiny_llama, tiny_snac = ensure_tiny_models(models_dir)
    real_model = _is_checkpoint(model)
    warning = (
        f"USING TINY RANDOM-WEIGHT MODELS: {', '.join(missing)} not found. The server runs but produces noise, "
        "not speech. Fetch the real weights with: python scripts/download_models.py"
    )
    return ModelPaths(
        model_path=model if real_model else tiny_llama,
        tokenizer_path=tokenizer if real_model else tiny_llama,
        codec_path=codec if _is_checkpoint(codec) else tiny_snac,
        tiny=True,
        warning=warning,
    )
