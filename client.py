#!/usr/bin/env python3
"""Synthesize with a running server over REST, WebSocket or gRPC; prints TTFB, audio seconds and RTF.

    python client.py --text "Hello there." --voice tara --output out.wav --protocol rest|ws|grpc
"""

from __future__ import annotations

import sys

from orpheus_serve.client.protocols import main

if __name__ == "__main__":
    sys.exit(main())
