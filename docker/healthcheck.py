"""Container HEALTHCHECK: exit 0 when URL answers 200 (and, for a JSON body with "status", status "ok").

The engine's /health answers 200 with {"status": "loading"} while the checkpoint loads; compose's
`depends_on: condition: service_healthy` must wait for "ok", so the status field is checked too.
Standard library only: the gateway image has no curl.
"""

import json
import sys
import urllib.request


def main(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            body = resp.read()
    except OSError as exc:
        print(f"healthcheck {url}: {exc}", file=sys.stderr)
        return 1
    try:
        data = json.loads(body)
    except ValueError:
        return 0  # not JSON (e.g. /metrics text): answering is healthy
    status = data.get("status", "ok") if isinstance(data, dict) else "ok"
    if status != "ok":
        print(f"healthcheck {url}: status {status!r}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
