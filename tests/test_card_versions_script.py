"""scripts/gpu/check_card_versions.sh: the kit's tests under the GPU box's torch and triton, here.

Its real run downloads torch 2.11.0's CUDA build (some GB) and runs the gpukit dry run (minutes), so it stays
outside the CI lane. What is checked here is what keeps a run of it honest: it refuses an environment whose
torch or triton is not the card's before any test runs (a pass under the wrong versions would prove nothing),
and it refuses what it cannot use, saying why.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu" / "check_card_versions.sh"
CARD_TORCH, CARD_TRITON = "2.11.0", "3.6.0"


def run_script(*args: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **env})


def test_unknown_arguments_are_refused_with_the_usage() -> None:
    proc = run_script("--bogus", env={})
    assert proc.returncode == 2 and "usage" in proc.stderr


def test_an_offline_run_needs_the_environment(tmp_path: Path) -> None:
    proc = run_script(env={"CARD_OFFLINE": "1", "CARD_VENV": str(tmp_path / "none")})
    assert proc.returncode == 1 and "no environment at" in proc.stderr
    assert not (tmp_path / "none").exists()  # offline: nothing built


def test_a_named_python_that_does_not_run_is_refused(tmp_path: Path) -> None:
    proc = run_script(env={"CARD_PYTHON": str(tmp_path / "python3.12"), "CARD_VENV": str(tmp_path / "venv")})
    assert proc.returncode == 1 and "does not run" in proc.stderr
    assert not (tmp_path / "venv").exists()


def test_other_torch_versions_are_refused_before_any_test_runs(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    triton = pytest.importorskip("triton")
    if torch.__version__.split("+")[0] == CARD_TORCH and triton.__version__ == CARD_TRITON:
        pytest.skip("this environment has the card's versions: nothing to refuse")
    # An environment that sees this interpreter's packages (the CI lane's torch), used as it is.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    Path(site, "lane.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    proc = run_script(env={"CARD_OFFLINE": "1", "CARD_VENV": str(venv)})
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert f"torch {torch.__version__}" in proc.stdout  # the versions it found are printed
    assert f"not the card's {CARD_TORCH} / {CARD_TRITON}" in proc.stderr
    assert "=== gate" not in proc.stdout and "=== gpukit" not in proc.stdout  # no test ran
