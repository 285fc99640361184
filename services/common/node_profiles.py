"""The profiles of every node, as their workers report them (torch-free).

On several hosts each node keeps its profiles on its own disk (the engines of a node read them from
there), so no gateway can list them by reading a directory. Each profiler worker therefore reports
what its profiles directory holds to Redis, under its node's name: when it starts and after every
job. ``GET /admin/profiles`` reads the reports back (services/gateway/admin.py).

Redis: hash ``tandem:node-profiles:<node>`` (file name -> JSON of ``profile_view``), replaced as a
whole on each report, with ``reported_at`` in ``tandem:node-profiles-at`` (hash node -> unix time).
"""

from __future__ import annotations

import json
import time
from typing import Any

from services.common.profiles import ProfileEntry, list_profiles

KEY_PREFIX = "tandem:node-profiles:"
REPORTED_AT = "tandem:node-profiles-at"


def profile_view(entry: ProfileEntry) -> dict:
    """One profile file as the admin API shows it: path, file, valid, error, and the profile itself."""
    p = entry.profile
    out: dict[str, Any] = {"path": str(entry.path), "file": entry.path.name, "valid": p is not None,
                           "error": entry.error}
    if p is not None:
        out["profile"] = p.model_dump(mode="json")
    return out


def report(redis, node: str, profiles_dir: str) -> int:
    """Replace ``node``'s report with what ``profiles_dir`` holds now; returns the number of files."""
    views = [profile_view(e) for e in list_profiles(profiles_dir)]
    key = KEY_PREFIX + node
    with redis.pipeline() as pipe:  # MULTI/EXEC: a reader never sees a half-written report
        pipe.delete(key)
        if views:
            pipe.hset(key, mapping={v["file"]: json.dumps(v) for v in views})
        pipe.hset(REPORTED_AT, node, f"{time.time():.3f}")
        pipe.execute()
    return len(views)


def read_reports(redis) -> dict[str, dict]:
    """node -> {"reported_at": unix time, "data": [profile views, by file name]} for every node reported."""
    out = {}
    for node, at in sorted(redis.hgetall(REPORTED_AT).items()):
        node = node.decode()
        files = redis.hgetall(KEY_PREFIX + node)
        out[node] = {"reported_at": float(at), "data": [json.loads(v) for _, v in sorted(files.items())]}
    return out
