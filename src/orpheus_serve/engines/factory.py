"""`create_engine(config)`: the one place a TokenEngine backend is chosen.

Each backend is imported only when selected: `tensorrt` pulls in TensorRT-LLM
(which needs a CUDA GPU just to import) and `torch` the Llama implementation, so
a server running the `sim` backend, or a CPU machine running `torch`, never
touches TensorRT-LLM. Selecting `tensorrt` where it cannot run raises
`EngineError` at once with one message naming what is missing (CUDA GPU,
TensorRT-LLM 1.2.x) and how to get it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..scheduler.step import EngineError
from .base import TokenEngine

if TYPE_CHECKING:
    from ..config import Config
    from ..replay import ModelledCard


def create_engine(config: Config, *, card: ModelledCard | None = None) -> TokenEngine:
    """`card`: the measured card the sim backend replays (replay/; core/build.py makes it)."""
    backend = config.engine.backend
    if backend == "tensorrt":
        from .trtllm_engine import TrtLlmEngine

        return TrtLlmEngine.from_config(config)
    if backend == "torch":
        from .torch_engine import TorchEngine

        return TorchEngine.from_config(config)
    if backend == "sim":
        from .sim_engine import SimEngine

        return SimEngine.from_config(config, card=card)
    raise EngineError(f"unknown engine.backend {backend!r}; expected torch, tensorrt or sim")


def check_backend(config: Config) -> None:
    """Fail fast, before any model is loaded, when the selected backend cannot run on this machine."""
    if config.engine.backend == "tensorrt":
        from .trtllm_env import check_tensorrt_available

        check_tensorrt_available()
