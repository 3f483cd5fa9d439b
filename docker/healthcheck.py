#!/usr/bin/env python3
"""The image's HEALTHCHECK: exit 0 while the server's /ready says it serves, 1 otherwise.

Standard library only, so it runs on any base image. The port is the server's own setting,
ORPHEUS_SERVE__SERVER__HTTP_PORT (default 8000); ORPHEUS_HEALTHCHECK_URL replaces the whole URL.

/ready answers 503 for four reasons (ARCHITECTURE §9). Three make the container unhealthy:
`warming_up` (the HEALTHCHECK's start period covers it), `shutting_down` and `engine_failed`.
`saturated` does not: it is a load signal that clears by itself within seconds, and an
orchestrator that replaces unhealthy containers would otherwise cut every stream of a busy server.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request

HEALTHY = ("ready", "saturated")


def ready_url(env: dict[str, str]) -> str:
    if env.get("ORPHEUS_HEALTHCHECK_URL"):
        return env["ORPHEUS_HEALTHCHECK_URL"]
    return f"http://127.0.0.1:{env.get('ORPHEUS_SERVE__SERVER__HTTP_PORT', '8000')}/ready"


def check(url: str, timeout_s: float = 4.0) -> tuple[bool, str]:
    """(healthy, what /ready said)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            body = response.read()
    except urllib.error.HTTPError as exc:  # 503 and its body: why the server does not serve
        body = exc.read()
    except (urllib.error.URLError, OSError) as exc:
        return False, f"{url}: {exc}"
    try:
        status = json.loads(body)["status"]
    except (ValueError, KeyError, TypeError):
        return False, f"{url}: unexpected answer {body[:200]!r}"
    return status in HEALTHY, f"{url}: {status}"


def main() -> int:
    healthy, said = check(ready_url(dict(os.environ)))
    print(said)
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
