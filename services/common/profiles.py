"""Bandwidth profiles (torch-free): the schema, the store, the reader and the offload/hybrid decision.

A profile is what `tandem bench bw` measured on one GPU host, one JSON file per GPU UUID in the
profiles directory (env TANDEM_PROFILES_DIR, default ``$XDG_CACHE_HOME/tandem/profiles``). The engine
reads it at start and on `/engine/v1/reload-profile`; the decision below is the prior for
``--moe-backend auto`` (the engine corrects it online, docs/design.md §1).

Units: bandwidths in GB/s (1e9 bytes per second), times in seconds, sizes in bytes.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from services.common.atomic_file import atomic_write
from services.common.logging import get_logger
from services.common.settings import env

log = get_logger("profiles")

SCHEMA_VERSION = 1
DEFAULT_THRESHOLD = 1.1  # hybrid must be predicted >= 10% faster than offload (measurement noise margin)
HOW_TO_PROFILE = "run `tandem bench bw` on this GPU host (or POST /admin/profiles on the gateway) to make one"
CPU_UUID_PREFIX = "cpu-"  # uuid of a profile measured without a GPU: "cpu-<hostname>"


# ------------------------------------------------------------------------------------------------
# Schema
# ------------------------------------------------------------------------------------------------


class _Model(BaseModel):
    # Unknown keys are ignored so a newer writer with extra fields stays readable within a version.
    # No inf/NaN: JSON's Infinity / 1e999 would pass gt=0 and turn the decision's times into 0 or NaN.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class GpuInfo(_Model):
    uuid: str  # "GPU-<hex...>" from NVML, or "cpu-<hostname>" when measured without a GPU
    name: str | None = None
    index: int | None = None


class HostInfo(_Model):
    hostname: str = ""
    cpu_model: str = ""
    physical_cores: int = Field(ge=1)
    numa_nodes: int = Field(1, ge=1)


class Ceilings(_Model):
    """Hardware ceilings, model-independent (GB/s). h2d/d2h are None without a GPU."""

    cpu_read: float = Field(gt=0)  # STREAM-style read, one thread per physical core
    h2d: float | None = Field(None, gt=0)  # linear pinned host -> device
    d2h: float | None = Field(None, gt=0)  # linear device -> pinned host
    cpu_read_kernel: str = ""  # which implementation measured cpu_read (e.g. "cpu_executor", "numpy")


class KernelBandwidths(_Model):
    """Real kernels for one expert format, measured alone (GB/s of expert bytes)."""

    cpu_executor_bs1: float = Field(gt=0)  # CPU expert GEMV at batch 1 (what hybrid runs on the CPU)
    pcie_gather: float | None = Field(None, gt=0)  # copy_missing of expert-sized jobs (what offload moves)
    cpu_kernel: str = ""  # which implementation measured cpu_executor_bs1 (e.g. "cpu_executor", "torch")
    gather_kernel: str = ""  # which implementation measured pcie_gather


class Concurrent(_Model):
    """Both paths at once, competing for host DRAM (GB/s): these set the split (docs/design.md §1)."""

    pcie_ov: float = Field(gt=0)
    cpu_ov: float = Field(gt=0)


class P2PLink(_Model):
    """One ordered GPU pair's device-to-device copy rate (GB/s), src's memory into dst's: the peer tier's
    fetch path (docs/multi-gpu.md)."""

    src: str  # GPU uuid
    dst: str
    gbps: float = Field(gt=0)


class Geometry(_Model):
    model: str
    num_layers: int = Field(ge=1)
    num_experts: int = Field(ge=1)
    top_k: int = Field(ge=1)
    hidden_size: int = Field(ge=1)
    moe_intermediate_size: int = Field(ge=1)


class Profile(_Model):
    schema_version: int
    gpu: GpuInfo
    host: HostInfo
    created_at: str
    tandem_version: str
    ceilings: Ceilings
    kernels: dict[str, KernelBandwidths]  # expert format key (format_key: "bfloat16", "fp8_block") -> bandwidths
    concurrent: dict[str, Concurrent] = {}  # expert format key -> concurrent bandwidths (GPU only)
    c_sync_s: float = Field(ge=0)  # per-layer CPU submit + sync cost of the hybrid path
    geometry: Geometry
    threshold: float = Field(DEFAULT_THRESHOLD, gt=0)  # required predicted speedup of hybrid over offload
    p2p: list[P2PLink] = []  # every ordered pair of this host's GPUs (none with one GPU)

    @property
    def has_gpu(self) -> bool:
        return not self.gpu.uuid.startswith(CPU_UUID_PREFIX) and self.ceilings.h2d is not None


UNQUANTIZED = "unquantized"  # services.engine.moe.banks.ExpertFormat.UNQUANTIZED (this module is torch-free)


def format_key(expert_format: str, dtype: str) -> str:
    """The key of an expert format's entries in ``kernels`` / ``concurrent``: the dtype name for unquantized
    experts ("bfloat16", "float32": what every profile written before quantized formats holds, so old
    files read as they are), else the format's own name ("fp8_block", "mxfp4"), whatever the model
    dtype. Why per format: the CPU executor's rate differs per format (FP8 widens codes in registers,
    it is not a pure stream); PCIe moves bytes alike, but is measured per format too (more banks per
    expert: more, smaller copies)."""
    return dtype if expert_format == UNQUANTIZED else expert_format


def resolve_format(profile: "Profile", key: str, fallback: str | None = None) -> tuple[str | None, str]:
    """The entry to use for format ``key``: (key, "") when the profile has it; else (``fallback``, why)
    when it has that one (an FP8 model's experts fall back to the model dtype's entry: bytes per second
    carry over for PCIe, the CPU rate is the other format's); else (None, why)."""
    if key in profile.kernels and (key in profile.concurrent or not profile.has_gpu):
        return key, ""
    has = sorted(profile.kernels)
    if fallback is not None and fallback != key and fallback in profile.kernels:
        return fallback, (f"profile of {profile.gpu.uuid} has no {key!r} entry (has {has}): using its {fallback!r} "
                          f"rates instead (the CPU rate of {key!r} differs); run `tandem bench bw --dtype {key}`")
    return None, f"profile of {profile.gpu.uuid} has no {key!r} entry (has {has}); run `tandem bench bw --dtype {key}`"


def now_iso() -> str:
    return datetime.now(timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def cpu_uuid(hostname: str | None = None) -> str:
    """The profile identity of a host measured without a GPU."""
    return CPU_UUID_PREFIX + (hostname or socket.gethostname())


def normalize_uuid(uuid: str) -> str:
    """NVML says "GPU-3f2a...", torch says "3f2a..." (no prefix): compare in one canonical form."""
    u = uuid.strip()
    if u.lower().startswith(CPU_UUID_PREFIX):
        return u
    u = u.lower()
    if u.startswith("gpu-"):
        u = u[4:]
    return "GPU-" + u


def profile_filename(uuid: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", normalize_uuid(uuid)) + ".json"


# ------------------------------------------------------------------------------------------------
# Store
# ------------------------------------------------------------------------------------------------


def profiles_dir(path: str | os.PathLike | None = None) -> Path:
    """The profiles directory: ``path`` if given, else env TANDEM_PROFILES_DIR (default under XDG cache)."""
    return Path(path) if path else Path(env("TANDEM_PROFILES_DIR"))


def write_profile(profile: Profile, directory: str | os.PathLike | None = None, *,
                  path: str | os.PathLike | None = None) -> Path:
    """Write ``profile`` as ``<dir>/<gpu uuid>.json`` (or to ``path``) atomically: temp file in the
    same dir, fsync, os.replace; a reader sees the old file or the new one, never half of one, and a
    failure leaves no temp file. Returns the path written."""
    target = Path(path) if path else profiles_dir(directory) / profile_filename(profile.gpu.uuid)
    target.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(profile.model_dump(mode="json"), indent=2) + "\n"
    with atomic_write(target, "w", perms=0o644) as f:  # 0644: the engine may read the shared volume as another user
        f.write(text)
    dir_fd = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)
    return target


class ProfileError(ValueError):
    """A profile file that cannot be used (corrupt, old schema, foreign GPU); the message names it."""


def read_profile(path: str | os.PathLike, expect_uuid: str | None = None) -> Profile:
    """Parse and validate one profile file; raises ProfileError naming the file and the problem."""
    p = Path(path)
    try:
        raw = json.loads(p.read_text())
    # ValueError: not JSON, not UTF-8, or an integer over Python's 4300 digits; RecursionError: nesting
    # deeper than the parser's stack. Any of them is one bad file, never an error of the caller.
    except (OSError, ValueError, RecursionError) as ex:
        raise ProfileError(f"profile {p}: unreadable or not JSON ({type(ex).__name__}: {str(ex)[:200]})") from ex
    if not isinstance(raw, dict):
        raise ProfileError(f"profile {p}: top level is {type(raw).__name__}, expected an object")
    version = raw.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ProfileError(f"profile {p}: schema_version {version!r}, this Tandem reads {SCHEMA_VERSION}; "
                           f"re-run `tandem bench bw`")
    try:
        profile = Profile.model_validate(raw)
    except RecursionError as ex:
        raise ProfileError(f"profile {p}: nested too deeply to validate") from ex
    except ValidationError as ex:
        first = ex.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise ProfileError(f"profile {p}: invalid field {where!r}: {first['msg']}") from ex
    if expect_uuid is not None and normalize_uuid(profile.gpu.uuid) != normalize_uuid(expect_uuid):
        raise ProfileError(f"profile {p}: measured on {profile.gpu.uuid}, not this GPU {expect_uuid}")
    return profile


def find_profile(gpu_uuid: str, directory: str | os.PathLike | None = None) -> tuple[Profile, Path] | None:
    """The profile of GPU ``gpu_uuid`` (or a ``cpu-<host>`` identity) in the profiles dir, with its path.
    A missing file gives None; a corrupt, foreign-GPU or old-schema file is ignored with a warning
    naming the file (and None)."""
    path = profiles_dir(directory) / profile_filename(gpu_uuid)
    if not path.exists():
        return None
    try:
        return read_profile(path, expect_uuid=gpu_uuid), path
    except ProfileError as ex:
        log.warning("ignoring %s", ex)
        return None


@dataclass(frozen=True)
class ProfileEntry:
    path: Path
    profile: Profile | None  # None when the file is unusable
    error: str | None = None


def list_profiles(directory: str | os.PathLike | None = None) -> list[ProfileEntry]:
    """Every ``*.json`` in the profiles dir (temp files skipped), valid or not, sorted by name."""
    d = profiles_dir(directory)
    if not d.is_dir():
        return []
    out = []
    for path in sorted(d.glob("*.json")):
        if path.name.startswith("."):
            continue
        try:
            profile = read_profile(path)
            if profile_filename(profile.gpu.uuid) != path.name:
                raise ProfileError(f"profile {path}: holds GPU {profile.gpu.uuid}, file name says another")
            out.append(ProfileEntry(path, profile))
        except ProfileError as ex:
            out.append(ProfileEntry(path, None, str(ex)))
    return out


# ------------------------------------------------------------------------------------------------
# Decision (docs/design.md §1)
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Decision:
    """What ``--moe-backend auto`` runs. Times are predicted seconds per token (all layers' misses)."""

    backend: str  # "offload" | "hybrid"
    fetch_fraction: float  # f: share of misses fetched over PCIe (1.0 under offload)
    f_q16: int  # round(f * 65536), what the on-device split reads
    t_offload_s: float | None
    t_hybrid_s: float | None
    reason: str


def fetch_count(misses: int, f: float) -> int:
    """F of M misses to fetch (docs/design.md §1): floor(M*f) or one more, whichever has the smaller
    max(F*(1-f), (M-F)*f). The device does the same in Q16 fixed point."""
    lo = math.floor(misses * f)
    hi = min(lo + 1, misses)
    cost = lambda F: max(F * (1.0 - f), (misses - F) * f)  # noqa: E731
    return lo if cost(lo) <= cost(hi) else hi


def hybrid_layer_time(misses: int, expert_bytes: int, f: float, pcie_ov: float, cpu_ov: float,
                      c_sync_s: float) -> float:
    """Predicted seconds of one layer's misses under hybrid with fraction ``f`` (bandwidths GB/s)."""
    F = fetch_count(misses, f)
    t_fetch = F * expert_bytes / (pcie_ov * 1e9)
    t_cpu = (misses - F) * expert_bytes / (cpu_ov * 1e9) + (c_sync_s if misses - F > 0 else 0.0)
    return max(t_fetch, t_cpu)


def _interp(fn, m: float) -> float:
    """``fn`` on integer miss counts, linearly interpolated at a fractional expected count ``m``."""
    lo = math.floor(m)
    if lo == m:
        return fn(int(m))
    w = m - lo
    return (1 - w) * fn(lo) + w * fn(lo + 1)


def _no_decision(reason: str) -> Decision:
    return Decision("offload", 1.0, 1 << 16, None, None, reason)


def decide(profile: Profile | None, expert_bytes: int, misses_per_layer: float, num_layers: int, *,
           fmt: str | None = None, fallback_fmt: str | None = None, threshold: float | None = None) -> Decision:
    """Offload or hybrid, and the fetch fraction, from a profile.

    expert_bytes: bytes of one expert across its banks · misses_per_layer: expected cache misses per
    MoE layer per token (may be fractional) · num_layers: MoE layers · fmt: expert format key in the
    profile (format_key; default: the only/first one) · fallback_fmt: the entry to use when ``fmt`` has
    none (resolve_format; logged) · threshold: required predicted speedup (default: the profile's). Offload time uses the PCIe gather alone; hybrid uses the concurrent bandwidths plus
    c_sync for each layer with CPU work. Hybrid wins only if strictly faster and t_offload / t_hybrid >= threshold.
    """
    if profile is None:
        return _no_decision(f"no bandwidth profile for this GPU: using offload; {HOW_TO_PROFILE}")
    if not profile.has_gpu:
        return _no_decision(f"profile of {profile.gpu.uuid} was measured without a GPU: using offload; {HOW_TO_PROFILE}")
    if not profile.kernels:
        return _no_decision(f"profile of {profile.gpu.uuid} has no kernel measurements: using offload")
    key, why = resolve_format(profile, fmt if fmt is not None else next(iter(profile.kernels)), fallback_fmt)
    if key is None:
        return _no_decision(f"{why}: using offload")
    if why:
        log.warning("%s", why)
    kern, conc = profile.kernels[key], profile.concurrent[key]
    pcie_alone = kern.pcie_gather or profile.ceilings.h2d
    f = conc.pcie_ov / (conc.pcie_ov + conc.cpu_ov)
    f_q16 = round(f * 65536)
    t_off = num_layers * misses_per_layer * expert_bytes / (pcie_alone * 1e9)
    t_hyb = num_layers * _interp(
        lambda m: hybrid_layer_time(m, expert_bytes, f, conc.pcie_ov, conc.cpu_ov, profile.c_sync_s),
        misses_per_layer)
    thr = profile.threshold if threshold is None else threshold
    numbers = (f"offload {t_off * 1e3:.3f} ms/token vs hybrid {t_hyb * 1e3:.3f} ms/token "
               f"(pcie {pcie_alone:.1f}, concurrent pcie {conc.pcie_ov:.1f} + cpu {conc.cpu_ov:.1f} GB/s, "
               f"c_sync {profile.c_sync_s * 1e6:.1f} us x {num_layers} layers, f={f:.3f})")
    if t_hyb > 0 and t_off / t_hyb > 1.0 + 1e-9 and t_off / t_hyb >= thr:  # ties (fp noise) -> offload
        return Decision("hybrid", f, f_q16, t_off, t_hyb, f"hybrid predicted {t_off / t_hyb:.2f}x faster: {numbers}")
    return Decision("offload", f, f_q16, t_off, t_hyb,
                    f"hybrid not predicted >= {thr:.2f}x faster: {numbers}")


def expected_misses_per_layer(top_k: int, cache_rate: float) -> float:
    """A routing-agnostic prior for misses per layer per token: top_k * (1 - share of experts cached)."""
    return top_k * max(0.0, 1.0 - min(1.0, cache_rate))


def auto_backend(gpu_uuid: str | None, expert_bytes: int, misses_per_layer: float, num_layers: int, *,
                 fmt: str | None = None, fallback_fmt: str | None = None,
                 directory: str | os.PathLike | None = None) -> tuple[Decision, Path | None]:
    """Engine hook for ``--moe-backend auto``: find this GPU's profile and decide; logs the reason.
    ``gpu_uuid`` None (no GPU) gives offload. Returns (decision, profile path or None)."""
    found = find_profile(gpu_uuid, directory) if gpu_uuid else None
    profile, path = found if found else (None, None)
    decision = decide(profile, expert_bytes, misses_per_layer, num_layers, fmt=fmt, fallback_fmt=fallback_fmt)
    log.info("moe-backend auto -> %s (f=%.3f)%s: %s", decision.backend, decision.fetch_fraction,
             f" from {path}" if path else "", decision.reason)
    return decision, path
