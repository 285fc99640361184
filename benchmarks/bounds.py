"""Bandwidth bounds of an expert backend's decode, from a ceilings file (python -m benchmarks.ceilings).

Dimension legend: L MoE layers.

The bound of a row is the bytes its missed experts move per token over the ceiling of the path that moves
them: offload the PCIe gather, cpu the CPU's DRAM read, hybrid PCIe and the CPU at once (the two concurrent
rates summed). With the per-layer serial part measured (hybrid/cpu: the CPU's result in -> the next layer's
job out, when neither PCIe nor the CPU has work), the *serial-aware* bound adds L x serial to the bytes'
time: how fast the token could go if only the moving of bytes overlapped and it ran at the ceilings.
"""

from __future__ import annotations

import json
from pathlib import Path

# Ceilings (benchmarks/ceilings.py keys) of the bandwidth each backend's misses move at, GB/s. A backend's
# bound sums its paths (hybrid's two run concurrently); each path takes the first key the file has (the
# older rows under docs/results also carry a C stream read, a tighter CPU ceiling than torch's sum).
BOUND_CEILINGS = {"offload": (("h2d_gather_8x9.4MB_GBs",),),
                  "cpu": (("c_avx512_stream_read_GBs", "cpu_read_sum_fp32_GBs"),),
                  "hybrid": (("overlap_pcie_GBs",), ("overlap_cpu_read_GBs",))}


def _positive(ceilings: dict, key: str) -> bool:
    return isinstance(ceilings.get(key), (int, float)) and ceilings[key] > 0


def bound_keys(backend: str, ceilings: dict) -> list[str] | None:
    """The ceilings ``backend``'s bound uses (one key per path), or None when the file lacks a path."""
    keys = [next((k for k in path if _positive(ceilings, k)), None) for path in BOUND_CEILINGS[backend]]
    return None if None in keys else keys


def load_ceilings(path: Path) -> dict:
    """A ceilings JSON; SystemExit naming the file when it cannot be read or bounds no backend (a CPU-only
    host's file bounds cpu alone: the other rows then go without a bound)."""
    try:
        ceilings = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"--ceilings {path}: cannot read a ceilings JSON ({exc})") from None
    if not isinstance(ceilings, dict) or not any(bound_keys(b, ceilings) for b in BOUND_CEILINGS):
        wanted = sorted({k for paths in BOUND_CEILINGS.values() for path in paths for k in path})
        raise SystemExit(f"--ceilings {path}: no positive value for any of {', '.join(wanted)} "
                         "(write one with python -m benchmarks.ceilings)")
    return ceilings


def missed_bytes_bound(backend: str, bytes_per_token: float, tok_s: float, ceilings: dict,
                       serial_s_per_token: float | None = None) -> dict:
    """bytes_per_token, bound_tok_s, bound_ratio and the ceilings used (plus serial_aware_bound_tok_s and
    serial_aware_ratio when ``serial_s_per_token`` is given); {} for a backend without a bound (resident) or
    a ceilings file that lacks its path."""
    keys = bound_keys(backend, ceilings) if backend in BOUND_CEILINGS else None
    if keys is None or bytes_per_token <= 0:
        return {}
    used = {k: ceilings[k] for k in keys}
    seconds = bytes_per_token / (sum(used.values()) * 1e9)  # the bytes' time per token at the ceilings
    out = {"bytes_per_token": bytes_per_token, "bound_tok_s": 1 / seconds, "bound_ratio": tok_s * seconds,
           "bound_ceilings_GBs": used}
    if serial_s_per_token is not None:
        out["serial_aware_bound_tok_s"] = 1 / (seconds + serial_s_per_token)
        out["serial_aware_ratio"] = tok_s * (seconds + serial_s_per_token)
    return out
