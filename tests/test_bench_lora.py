"""scripts/bench_lora.py: the LoRA rows (lora0, lora8, lora32 in the GPU kit) measured with the kernel the server
would use, on one engine."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from orpheus_serve.engines.torch_engine import TorchEngine
from scripts import bench_lora

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_auto_is_the_servers_lora_kernel_alone() -> None:
    """auto resolves as the engine resolves voices.lora_kernel: auto (the segmented Triton kernels on CUDA, the
    torch path elsewhere), one kernel, so one engine; a list still measures each."""
    pytest.importorskip("triton")
    assert bench_lora._kernels("auto", "cuda") == ["triton"]
    assert bench_lora._kernels("auto", "cpu") == ["torch"]
    assert bench_lora._kernels("triton,torch", "cuda") == ["triton", "torch"]


def test_rows_come_from_one_engine_with_its_kernel_named(tiny_models: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    builds: list[str] = []
    init = TorchEngine.__init__

    @functools.wraps(init)
    def counted_init(self: TorchEngine, *args: object, **kwargs: object) -> None:
        init(self, *args, **kwargs)  # type: ignore[arg-type]
        builds.append(self.lora_kernel)

    monkeypatch.setattr(TorchEngine, "__init__", counted_init)
    out = tmp_path / "lora.json"
    assert bench_lora.main(["--presets", "tiny", "--models-dir", str(tiny_models), "--batch", "2",
                            "--adapters", "0,1", "--rank", "4", "--steps", "1", "--rounds", "1", "--threads", "1",
                            "--device", "cpu", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert builds == ["torch"], builds  # one engine, the server's kernel on a CPU
    assert data["kernels"] == ["torch"] and data["lora_kernel"] == "torch"
    assert [r["adapters"] for r in data["rows"]] == [0, 1]
    for row in data["rows"]:
        assert row["kernel"] == "torch" and row["tokens_per_s"] > 0
        assert set(row) >= {"model", "batch", "adapters", "rank", "graphs", "step_ms", "tokens_per_s", "vs_base"}
