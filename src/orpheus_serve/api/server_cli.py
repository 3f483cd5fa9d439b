"""Command line of production_server.py: config file, profile, ports, `--set` overrides."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from ..config import ConfigError, load_config, parse_overrides


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="production_server.py",
        description="Serve Orpheus text-to-speech over HTTP (OpenAI-compatible), WebSocket and gRPC. "
                    "SIGTERM/SIGINT shut down gracefully.")
    parser.add_argument("--config", default=None, help="YAML config (default: config/model_config.yaml)")
    parser.add_argument("--profile", default=None, help="config profile, e.g. conversational or longform")
    parser.add_argument("--host", default=None, help="bind address (server.host)")
    parser.add_argument("--port", type=int, default=None, help="HTTP + WebSocket port (server.http_port)")
    parser.add_argument("--grpc-port", type=int, default=None, help="gRPC port (server.grpc_port)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override any config key, e.g. --set engine.backend=sim (repeatable)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        overrides: dict[str, Any] = parse_overrides(args.overrides)
        for key, value in (("server.host", args.host), ("server.http_port", args.port),
                           ("server.grpc_port", args.grpc_port)):
            if value is not None:
                overrides[key] = value
        config = load_config(args.config, profile=args.profile, overrides=overrides)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    logging.basicConfig(level=config.server.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from ..scheduler.step import EngineError
    from .launch import run_server

    try:
        return run_server(config)
    except EngineError as exc:  # a backend that cannot start here (no GPU, no TensorRT-LLM, bad checkpoint)
        print(f"error: {exc}", file=sys.stderr)
        return 2
