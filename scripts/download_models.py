#!/usr/bin/env python3
"""Fetch the real checkpoints into models/ (needs internet; gated repos need HF_TOKEN).

    python scripts/download_models.py [--out models] [--model canopylabs/orpheus-3b-0.1-ft]
                                      [--snac hubertsiuzdak/snac_24khz]

Offline, it fails fast and points at `scripts/make_tiny_models.py`, which writes
random-weight stand-ins in the same formats.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path

ORPHEUS_REPO = "canopylabs/orpheus-3b-0.1-ft"
SNAC_REPO = "hubertsiuzdak/snac_24khz"
ORPHEUS_FILES = ["config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
                 "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
SNAC_FILES = ["config.json", "pytorch_model.bin"]
OFFLINE_HINT = ("no connection to the Hugging Face hub. Without internet, write random-weight stand-ins "
                "in the same formats with: python scripts/make_tiny_models.py --out models")


def hub_reachable(host: str = "huggingface.co", timeout_s: float = 3.0) -> bool:
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        return False
    try:
        socket.create_connection((host, 443), timeout=timeout_s).close()
    except OSError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="models")
    ap.add_argument("--model", default=ORPHEUS_REPO)
    ap.add_argument("--snac", default=SNAC_REPO)
    args = ap.parse_args(argv)

    if not hub_reachable():
        print(f"error: {OFFLINE_HINT}", file=sys.stderr)
        return 2
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError

    token = os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN")
    out = Path(args.out)
    for repo, folder, patterns in ((args.model, "orpheus", ORPHEUS_FILES), (args.snac, "snac_24khz", SNAC_FILES)):
        try:
            path = snapshot_download(repo, local_dir=out / folder, allow_patterns=patterns, token=token)
        except GatedRepoError:
            print(f"error: {repo} is gated: accept its licence on the hub and set HF_TOKEN", file=sys.stderr)
            return 2
        except HfHubHTTPError as exc:
            print(f"error: downloading {repo} failed: {exc}", file=sys.stderr)
            return 2
        print(f"{repo} -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
