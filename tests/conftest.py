"""Shared fixtures: the tiny random-weight models, built once per test run in the real on-disk formats."""

from __future__ import annotations

import importlib.util
import os
import statistics
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.pace import MachinePace

ROOT = Path(__file__).resolve().parents[1]

# One intra-op thread for every torch in the run: this process and the servers and engine cores it starts (they
# inherit the environment). The tiny models' ops are too small to split, and on two shared cores a second OpenMP
# thread spins waiting for the first. A pace calibration round (tests/pace.py, a fixed matmul-and-softmax loop the
# size of the tiny model's decode) on the 2-core machine with other work on its cores: 34-40 ms of wall and CPU
# time with one thread; with two, 90-105 ms at best, a median of 150-930 ms, and 240-690 ms of CPU. The pace
# calibrates with one thread whatever this says. Set before anything here imports torch.
os.environ.setdefault("OMP_NUM_THREADS", "1")
PACE_SAMPLES = pytest.StashKey[list["MachinePace"]]()


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--shard", default=None, metavar="I/N",
                     help="run only the I-th of N shards of the test files, dealt by weight (scripts/test.sh runs "
                          "the CI lane's shards side by side: most tests wait on audio paced in real time)")


# Seconds each of the heaviest test files took in the CI lane on the 2-core machine (--durations, loaded; each
# shard prints its slowest 15 tests): only
# to deal the files into shards of about equal length. A file not named here counts half a second a test.
SHARD_WEIGHTS_S = {
    "test_engine_process.py": 300, "test_decode_attention.py": 160, "test_gpu_kit.py": 135,
    "test_flow_control.py": 125, "test_elevenlabs_hostile.py": 125, "test_elevenlabs_clients.py": 110,
    "test_gateway_limits.py": 110, "test_observability.py": 85, "test_fuzz.py": 80, "test_crash_loop.py": 80,
    "test_cartesia.py": 80, "test_riva.py": 80, "test_gateway_e2e.py": 80, "test_codec_stateful.py": 60,
    "test_cartesia_clients.py": 60, "test_lora.py": 55, "test_slow_readers.py": 65, "test_cartesia_http.py": 50,
    "test_custom_voices.py": 50, "test_llama.py": 50, "test_api_processes.py": 45, "test_service.py": 45,
    "test_openai_clients.py": 40, "test_ws_contexts.py": 40, "test_gateway_load.py": 35, "test_soak.py": 35,
    "test_container_files.py": 30, "test_playground.py": 25, "test_telephony.py": 25, "test_submit_burst.py": 20,
    "test_hostile_input.py": 20, "test_contexts.py": 20, "test_split_parity.py": 15, "test_trtllm_engine.py": 15,
    "test_container_drain.py": 15, "test_compiled.py": 140, "test_core_host.py": 20, "test_replay.py": 15,
}
# The last shard also runs scripts/test.sh's in-process pass afterwards: it starts this much behind.
IN_PROCESS_PASS_S = 110


def _keep_shard(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Whole files (a module's shared server stays in one shard), heaviest first, each to the shard with the
    least so far: the same deal in every shard, which keeps only its own."""
    index, count = (int(part) for part in config.getoption("shard").split("/"))
    assert 1 <= index <= count, f"--shard {index}/{count}"
    tests_in: dict[Path, int] = {}
    for item in items:
        tests_in[item.path] = tests_in.get(item.path, 0) + 1
    weight = {path: SHARD_WEIGHTS_S.get(path.name, 0.5 * n) for path, n in tests_in.items()}
    loads = [0.0] * count
    loads[-1] = IN_PROCESS_PASS_S
    shard_of: dict[Path, int] = {}
    for path in sorted(weight, key=lambda p: (-weight[p], p.name)):
        shard_of[path] = min(range(count), key=lambda shard: (loads[shard], shard))
        loads[shard_of[path]] += weight[path]
    config.hook.pytest_deselected(items=[item for item in items if shard_of[item.path] != index - 1])
    items[:] = [item for item in items if shard_of[item.path] == index - 1]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("shard"):
        _keep_shard(config, items)
    # The GPU kit's full dry run takes minutes: only when asked for, by marker expression or environment.
    if "gpukit" not in (config.option.markexpr or "") and not os.environ.get("ORPHEUS_GPUKIT"):
        skip_kit = pytest.mark.skip(reason="the GPU kit's full dry run: pytest -m gpukit (or ORPHEUS_GPUKIT=1)")
        for item in items:
            if item.get_closest_marker("gpukit") is not None:
                item.add_marker(skip_kit)
    if importlib.util.find_spec("tensorrt_llm") is None:
        skip_trt = pytest.mark.skip(reason="needs TensorRT-LLM 1.2.x (see docs/TENSORRT.md)")
        for item in items:
            if "tensorrt" in item.keywords:
                item.add_marker(skip_trt)
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Folder holding tiny-orpheus/ and tiny-snac/ (seed 0). Reuses ORPHEUS_TINY_MODELS if set."""
    preset = os.environ.get("ORPHEUS_TINY_MODELS")
    if preset and (Path(preset) / "tiny-orpheus" / "config.json").exists():
        return Path(preset)
    from scripts.make_tiny_models import main as make_tiny_models

    out = tmp_path_factory.mktemp("models")
    assert make_tiny_models(["--out", str(out), "--seed", "0"]) == 0
    return out


@pytest.fixture(scope="session")
def tiny_orpheus(tiny_models: Path) -> Path:
    return tiny_models / "tiny-orpheus"


@pytest.fixture(scope="session")
def tiny_snac(tiny_models: Path) -> Path:
    return tiny_models / "tiny-snac"


@pytest.fixture(scope="module")
def pace(request: pytest.FixtureRequest, pytestconfig: pytest.Config,
         record_testsuite_property: Callable[[str, object], None]) -> MachinePace:
    """How much slower than the reference machine this one runs a fixed piece of torch work now (tests/pace.py):
    tests that wait on time stretch their windows by it, and fail their timing checks above its cap. Measured
    afresh for each module that asks (about a quarter of a second), so load that comes and goes is seen."""
    from tests.pace import measure

    measured = measure()
    pytestconfig.stash.setdefault(PACE_SAMPLES, []).append(measured)
    record_testsuite_property("machine_pace", f"{request.module.__name__}: {measured.slowness:.2f}x "
                                              f"({measured.measured_round_s * 1000:.0f} ms)")
    return measured


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item: pytest.Item) -> None:
    # Each test that waits on time carries the pace its windows were stretched by into the JUnit report.
    measured = getattr(item, "funcargs", {}).get("pace")
    if measured is not None:
        item.user_properties.append(("machine_pace", f"{measured.slowness:.2f}"))
        item.user_properties.append(("machine_pace_round_ms", f"{measured.measured_round_s * 1000:.1f}"))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    samples = config.stash.get(PACE_SAMPLES, [])
    if not samples:  # only runs with a test that waits on time measure it
        return
    from tests.pace import MAX_SLOWNESS, REFERENCE_ROUND_S

    paces = sorted(sample.slowness for sample in samples)
    rounds_ms = sorted(sample.measured_round_s * 1000 for sample in samples)
    over = sum(pace > MAX_SLOWNESS for pace in paces)
    terminalreporter.write_line(
        f"machine pace, {len(samples)} sample(s) (one per module that waits on time): min/median/max "
        f"{paces[0]:.2f}x/{statistics.median(paces):.2f}x/{paces[-1]:.2f}x the reference (rounds "
        f"{rounds_ms[0]:.0f}/{statistics.median(rounds_ms):.0f}/{rounds_ms[-1]:.0f} ms, reference "
        f"{REFERENCE_ROUND_S * 1000:.0f} ms; cap {MAX_SLOWNESS:g}x" + (f", {over} over it" if over else "") + ")")


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """One intra-op thread for torch-heavy modules: on the test machine's two shared cores, two
    threads spend most of their time waiting on each other."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
