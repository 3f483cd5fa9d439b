"""`python -m orpheus_serve.deploy.ray`: a local Ray cluster (or `--address` of one) serving N replicas.

    python -m orpheus_serve.deploy.ray --replicas 2 [--host H] [--port P] [--config FILE] [--profile NAME]
                                       [--set section.key=value ...]
    python -m orpheus_serve.deploy.ray --min-replicas 1 --max-replicas 4 ...   (autoscaling)

The config file and `--set` overrides are production_server.py's; every replica gets the same config.
SIGTERM/SIGINT: Serve stops routing, replicas drain (server.shutdown_grace_s), then the cluster stops.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from typing import Any

from ...config import ConfigError
from .settings import STATS_ROUTE_PREFIX, RaySettings


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m orpheus_serve.deploy.ray",
        description="Serve Orpheus text-to-speech from several replicas behind one endpoint (Ray Serve).")
    parser.add_argument("--replicas", type=int, default=None,
                        help="a fixed number of replicas (default: autoscale between --min/--max-replicas)")
    parser.add_argument("--min-replicas", type=int, default=1)
    parser.add_argument("--max-replicas", type=int, default=2)
    parser.add_argument("--host", default="127.0.0.1", help="address of Serve's HTTP proxy (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port of Serve's HTTP proxy")
    parser.add_argument("--grpc-port", type=int, default=50051,
                        help="port of Serve's gRPC proxy (orpheus.v1.Synthesizer; metadata application=orpheus)")
    parser.add_argument("--config", default=None, help="server YAML config (default: config/model_config.yaml)")
    parser.add_argument("--profile", default=None, help="config profile, e.g. conversational or longform")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override any server config key, e.g. --set engine.backend=sim (repeatable)")
    parser.add_argument("--num-cpus", type=float, default=1.0, help="CPUs per replica")
    parser.add_argument("--num-gpus", type=float, default=None,
                        help="GPUs per replica (default: 1 when the engine runs on CUDA, else 0)")
    parser.add_argument("--address", default=None,
                        help="Ray cluster to join (default: start a local one for this process)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = RaySettings(config=args.config, profile=args.profile, set=list(args.overrides),
                               replicas=args.replicas, min_replicas=args.min_replicas,
                               max_replicas=args.max_replicas, num_cpus=args.num_cpus, num_gpus=args.num_gpus)
        settings.check()
        config = settings.server_config()
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    logging.basicConfig(level=config.server.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import ray
    from ray import serve

    from .app import grpc_options, run_apps

    init: dict[str, Any] = {"address": args.address} if args.address else {
        # Enough logical CPUs for every replica even on a small machine: they share the cores.
        "num_cpus": max(os.cpu_count() or 1, int(settings.num_cpus * (settings.replicas or settings.max_replicas))
                        + 1),
        "include_dashboard": False}
    ray.init(**init)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": args.host, "port": args.port}, grpc_options=grpc_options(args.grpc_port))
        run_apps(settings, config)
        print(f"serving on http://{args.host}:{args.port} (aggregate stats: {STATS_ROUTE_PREFIX}) and gRPC on port "
              f"{args.grpc_port}; Ctrl-C to stop", flush=True)
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
