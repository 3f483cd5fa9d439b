#!/usr/bin/env python3
"""Benchmark a running server, or servers started here: see `python benchmark.py --help`."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "src"))

from orpheus_serve.benchmarking.cli import main

if __name__ == "__main__":
    sys.exit(main())
