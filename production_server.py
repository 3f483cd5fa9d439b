#!/usr/bin/env python3
"""Run orpheus-serve: HTTP + WebSocket (uvicorn) and gRPC (grpc.aio) in one process.

    python production_server.py [--config FILE] [--profile NAME] [--host H] [--port P] [--grpc-port G]
                                [--set section.key=value ...]

Uses models/orpheus + models/snac_24khz when present, otherwise the tiny
random-weight models (and says so loudly). SIGTERM/SIGINT: stop admitting,
let in-flight streams finish within server.shutdown_grace_s, then exit.
"""

from __future__ import annotations

import sys

from orpheus_serve.api.server_cli import main

if __name__ == "__main__":
    sys.exit(main())
