#!/usr/bin/env python3
"""An environment like the bare GPU box, here: only the box's Python packages, plus the kit's wheels.

    python scripts/gpu/bare_box.py DEST [--wheels DIR]    # prints DEST/bin/python

DEST becomes a virtual environment (no system site-packages) whose site-packages holds links to the
packages of this interpreter's environment that the box's image also has (scripts/gpu/box-packages.txt;
the box's versions may differ, its names do not) and nothing else. With --wheels the wheels are
installed as run.sh installs them on the box: `pip install --no-deps --target SITE`, SITE then put first
on PYTHONPATH (`box_env`). What the kit's stages import and the box lacks must therefore come from the
wheels, as on the box (tests/test_gpu_kit.py).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import sysconfig
from importlib.metadata import distributions
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BOX_PACKAGES = Path(__file__).with_name("box-packages.txt")


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def box_package_names(path: Path = BOX_PACKAGES) -> set[str]:
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return {normalize(line) for line in lines if line}


def link_box_packages(source_site: Path, dest_site: Path, names: set[str]) -> list[str]:
    """Link into `dest_site` every file and folder of `source_site` that belongs to a distribution named in
    `names`: a folder whole where only such distributions own files in it (torch/), else its entries one
    by one (a namespace folder such as google/ that other distributions share). Returns the names linked."""
    owners: dict[tuple[str, ...], set[str]] = {}
    children: dict[tuple[str, ...], set[tuple[str, ...]]] = {}
    linked = set()
    for dist in distributions(path=[str(source_site)]):
        name = normalize(dist.metadata["Name"] or "")
        for file in dist.files or []:
            parts = Path(file).parts
            if not parts or parts[0] == "..":  # scripts in bin/ and the like
                continue
            for depth in range(1, len(parts) + 1):
                owners.setdefault(parts[:depth], set()).add(name)
                children.setdefault(parts[: depth - 1], set()).add(parts[:depth])
        if name in names:
            linked.add(name)

    def place(node: tuple[str, ...]) -> None:
        who = owners[node]
        if not who & names:
            return
        source, dest = source_site.joinpath(*node), dest_site.joinpath(*node)
        if not source.exists():
            return
        if who <= names or source.is_file():
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.symlink_to(source, target_is_directory=source.is_dir())
            return
        for child in children.get(node, ()):
            place(child)

    for top in children.get((), ()):
        place(top)
    return sorted(linked)


def make_bare_box(dest: Path, *, wheels: Path | None = None) -> Path:
    """The venv's python; the wheels (if any) installed into DEST/wheels-site."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(dest)], check=True)
    python = dest / "bin" / "python"
    dest_site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                    check=True, capture_output=True, text=True).stdout.strip())
    linked = link_box_packages(Path(sysconfig.get_paths()["purelib"]), dest_site, box_package_names())
    (dest / "box-packages-linked.txt").write_text("\n".join(linked) + "\n")
    if wheels is not None:
        install_wheels(python, sorted(wheels.glob("*.whl")), dest / "wheels-site")
    return python


def install_wheels(python: Path, wheel_files: list[Path], site: Path) -> None:
    """As run.sh installs them on the box."""
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-index",
                    "--no-deps", "--no-compile", "--no-cache-dir", "--upgrade", "--target", str(site),
                    *map(str, wheel_files)], check=True)


def box_env(site: Path | None) -> dict[str, str]:
    """The environment run.sh gives the stages on the box: the wheels' site first, then src/ and the root."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    parts = [str(ROOT / "src"), str(ROOT)] + ([str(site)] if site is not None else [])
    env["PYTHONPATH"] = os.pathsep.join(parts)
    return env


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dest", type=Path)
    ap.add_argument("--wheels", type=Path, default=None)
    args = ap.parse_args(argv)
    print(make_bare_box(args.dest, wheels=args.wheels))
    return 0


if __name__ == "__main__":
    sys.exit(main())
