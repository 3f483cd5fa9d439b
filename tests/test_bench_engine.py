"""scripts/bench_engine.py's engine rows as the GPU kit's engine stage runs them (`--variants`), on the tiny model:
the attention each row ran, the server's default, and a failed variant's memory released before the next."""

from __future__ import annotations

import functools
import json
import os
import weakref
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # the Triton decode attention runs in Triton's interpreter (before its import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from orpheus_serve.engines import decode_attention
from orpheus_serve.engines.llama import Transformer
from orpheus_serve.engines.torch_engine import TorchEngine
from scripts import bench_engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SMALL = ["--presets", "tiny", "--batches", "1,2", "--steps", "1", "--rounds", "1", "--warmup", "1",
         "--prompt-len", "12", "--threads", "1"]


def run_bench(tiny_models: Path, tmp_path: Path, *args: str) -> dict[str, object]:
    out = tmp_path / "engine.json"
    assert bench_engine.main([*SMALL, "--models-dir", str(tiny_models), "--json", str(out), *args]) == 0
    return json.loads(out.read_text())


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's dry run: a CPU's")
def test_triton_rows_say_triton_and_run_the_kernel_in_the_interpreter(tiny_models: Path, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The kit's dry run (`--attention triton`, TRITON_INTERPRET=1, graphs on, which a CPU runs eagerly): every
    variant row that names no attention of its own says triton, and the decode steps launched the Triton
    kernels (counted at their launch); the sdpa variant's rows say sdpa and launched none."""
    launches: list[int] = []
    launch = decode_attention._launch

    def counted(*args: object) -> torch.Tensor:
        launches.append(1)
        return launch(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(decode_attention, "_launch", counted)
    data = run_bench(tiny_models, tmp_path, "--attention", "triton", "--graphs", "on", "--variants", "base")
    rows = data["rows"]
    assert data["complete"] and data["attention"] == "triton" and rows
    assert {r["attention"] for r in rows} == {"triton"} and all(r["variant"] == "base" for r in rows)
    # 1 warm-up + 1 timed step at each of 2 batch sizes, 2 layers each: every decode layer ran the kernel.
    assert len(launches) >= 2 * 4
    launches.clear()
    sdpa_rows = run_bench(tiny_models, tmp_path, "--attention", "triton", "--variants", "sdpa")["rows"]
    assert {r["attention"] for r in sdpa_rows} == {"sdpa"} and not launches


def test_base_is_the_servers_default_attention(tiny_models: Path, tmp_path: Path) -> None:
    """No --attention: auto, resolved as the server resolves engine.attention (SDPA on a CPU, the Triton kernel
    on CUDA), and recorded in each row."""
    data = run_bench(tiny_models, tmp_path, "--variants", "base")
    expected = "triton" if torch.cuda.is_available() else "sdpa"
    assert data["attention"] == expected and {r["attention"] for r in data["rows"]} == {expected}


def test_a_variant_that_fails_to_build_frees_its_kv_cache_before_the_next_builds(
        tiny_models: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A variant whose engine fails part-way through its build (its compile cache folder is a file: the compile
    step, after the KV caches are allocated on the shared weights, cannot create it) is listed as failed, and by
    the time the next variant's engine starts building, no cache tensor of the failed one is alive."""
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setitem(bench_engine.VARIANTS, "unbuildable",
                        {"compile_decode": True, "compile_cache_dir": str(blocker)})
    caches: list[tuple[str, weakref.ref[torch.Tensor]]] = []  # (variant being built, its cache tensors)
    building: list[str] = []
    alive_at_build: dict[str, int] = {}
    allocate, init = Transformer._allocate_caches, TorchEngine.__init__

    def recording_allocate(self: Transformer, *args: object, **kwargs: object) -> None:
        allocate(self, *args, **kwargs)  # type: ignore[arg-type]
        for layer in self.layers:
            caches.append((building[-1], weakref.ref(layer.attention.kv_cache.k_cache)))

    @functools.wraps(init)  # the bench reads the options TorchEngine takes from its signature
    def recording_init(self: TorchEngine, *args: object, **kwargs: object) -> None:
        variant = "unbuildable" if kwargs.get("compile_cache_dir") else "base"
        alive_at_build[variant] = sum(ref() is not None for _, ref in caches)
        building.append(variant)
        init(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Transformer, "_allocate_caches", recording_allocate)
    monkeypatch.setattr(TorchEngine, "__init__", recording_init)
    data = run_bench(tiny_models, tmp_path, "--variants", "unbuildable,base")
    failed = [s for s in data["skipped"] if s["variant"] == "unbuildable"]
    assert failed and failed[0]["failed"] and "FileExistsError" in failed[0]["reason"]
    assert any(v == "unbuildable" for v, _ in caches), "the failed build allocated no cache: nothing was tested"
    assert alive_at_build["base"] == 0, f"{alive_at_build['base']} cache tensors of the failed variant still alive"
    assert {r["variant"] for r in data["rows"]} == {"base"} and not data["complete"]
