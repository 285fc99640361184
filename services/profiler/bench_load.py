"""`tandem bench load`: how fast can the expert banks come off disk? (benchmarks guide §3)

    tandem bench load --model DIR                          # serial, parallel, repacked
    tandem bench load --model DIR --modes parallel --threads 16 --json out.json
    tandem bench load --model DIR --keep-bank              # keep the repacked file for the next run

Modes (serial always runs: it is the reference the others must match byte for byte):
    serial    safetensors by tensor name, one expert tensor after another (mmap, page cache)
    parallel  multi-threaded chunked O_DIRECT reads of the original safetensors (buffered, with a
              note, where O_DIRECT is unsupported, e.g. tmpfs)
    repacked  one-time conversion to a bank file (docs/bank-file-format.md; conversion time reported
              on its own row), then contiguous per-layer reads of it with the same chunked reader

Each mode runs in its own subprocess (its banks are freed before the next starts; two full copies
would not fit in RAM on a big model) after evicting the files from the page cache
(posix_fadvise DONTNEED, no root needed) so reads are cold. Peak RSS and the lowest MemAvailable are
sampled. A position-weighted sampled checksum of the banks must match serial's: a mismatch is BAD and
the exit status is 1. Linux only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

from services.common.logging import get_logger, setup_logging
from services.engine.moe.banks import BANK_SCHEMAS, ExpertBanks
from services.profiler import bankfile
from services.profiler.chunked_read import read_jobs
from services.profiler.expert_layout import ExpertLayout, expert_layout

log = get_logger("profiler.bench_load")

MODES = ("serial", "parallel", "repacked")
RESULT_TAG = "@@RESULT@@"
PROGRESS_TAG = "@@PROGRESS@@"
CHECKSUM_SAMPLES = 1 << 20  # ~1M bytes sampled across all banks


# ------------------------------------------------------------------------------------------------ checksum

def checksum(banks: ExpertBanks, samples: int = CHECKSUM_SAMPLES) -> str:
    """Position-weighted sampled hash of every bank's bytes. Offsets run globally across layers and
    banks (schema order), so it does not depend on how the banks are split; each sampled byte is
    weighted by its offset, so moved experts change it (a plain sum is permutation invariant).
    A sample, not a proof: at stride s, damage shorter than s bytes between samples can slip through."""
    regions = [layer.tensors[b.name] for layer in banks.layers for b in BANK_SCHEMAS[layer.format]]
    total = sum(t.numel() * t.element_size() for t in regions)
    stride = max(1, total // samples)
    acc, base, count = np.uint64(0), 0, 0
    for t in regions:
        flat = t.contiguous().view(-1).view(torch.uint8)  # [nbytes], no copy
        start = (-base) % stride
        picked = flat[start::stride].numpy().astype(np.uint64)  # [k], a small strided copy
        pos = np.arange(picked.size, dtype=np.uint64) * np.uint64(stride) + np.uint64(base + start + 1)
        acc += np.sum(pos * (picked + np.uint64(1)), dtype=np.uint64)  # wraps mod 2^64 on purpose
        base += flat.numel()
        count += picked.size
    return f"{int(acc):016x}:{count}"


# ------------------------------------------------------------------------------------------------ memory

class MemSampler:
    """Background sampler of this process's RSS and the system's MemAvailable (bytes)."""

    def __init__(self, period_s: float = 0.02):
        self.period, self.peak_rss, self.min_available = period_s, 0, None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _kb(path: str, key: str) -> int:
        with open(path) as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
        return 0

    def _sample(self) -> None:
        self.peak_rss = max(self.peak_rss, self._kb("/proc/self/status", "VmRSS:"))
        avail = self._kb("/proc/meminfo", "MemAvailable:")
        self.min_available = avail if self.min_available is None else min(self.min_available, avail)

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self._sample()

    def __enter__(self) -> "MemSampler":
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
        self.peak_rss = max(self.peak_rss, self._kb("/proc/self/status", "VmHWM:"))  # the kernel's own peak


# ------------------------------------------------------------------------------------------------ loaders

def evict(files: list[Path]) -> None:
    """Drop ``files`` from the page cache so the next read comes from disk."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _flat_dst(banks: ExpertBanks):
    flat = {(i, name): t.view(-1).view(torch.uint8) for i, layer in enumerate(banks.layers)
            for name, t in layer.tensors.items()}
    return lambda job: flat[(job.layer, job.bank)]


def load_serial(layout: ExpertLayout) -> tuple[ExpertBanks, list[str]]:
    """Tensor by tensor through the safetensors library (the straightforward loader)."""
    from safetensors import safe_open

    banks = layout.allocate()
    dst = _flat_dst(banks)
    by_file: dict[Path, list] = {}
    for j in layout.jobs:
        by_file.setdefault(j.file, []).append(j)
    for file, jobs in by_file.items():
        with safe_open(str(file), framework="pt") as f:
            for j in jobs:
                t = f.get_tensor(j.name).contiguous().view(-1).view(torch.uint8)  # [nbytes]
                dst(j)[j.dst_offset: j.dst_offset + j.nbytes].copy_(t)
    return banks, []


def load_parallel(layout: ExpertLayout, threads: int, chunk_mib: int, direct: bool = True) -> tuple[ExpertBanks, list[str]]:
    banks = layout.allocate()
    stats = read_jobs(layout.jobs, _flat_dst(banks), threads=threads, chunk_bytes=chunk_mib << 20, direct=direct)
    return banks, stats.notes + (["O_DIRECT"] if stats.direct else ["buffered reads (no O_DIRECT)"])


def load_repacked(path: Path, layout: ExpertLayout, threads: int, chunk_mib: int) -> tuple[ExpertBanks, list[str]]:
    header, jobs = bankfile.bank_file_jobs(path)
    if (header["num_experts"], header["hidden_size"], header["moe_intermediate_size"]) != (
            layout.spec.num_experts, layout.spec.hidden_size, layout.spec.moe_intermediate_size):
        raise ValueError(f"{path}: bank file geometry does not match the checkpoint; delete it to reconvert")
    banks = layout.allocate()
    stats = read_jobs(jobs, _flat_dst(banks), threads=threads, chunk_bytes=chunk_mib << 20)
    return banks, stats.notes + (["O_DIRECT"] if stats.direct else ["buffered reads (no O_DIRECT)"])


def _worker(args: argparse.Namespace) -> int:
    """One mode in this (sub)process; prints one RESULT_TAG JSON line on stdout."""
    layout = expert_layout(args.model)
    bank_path = Path(args.bank_dir) / bankfile.FILENAME
    files = [bank_path] if args.worker == "repacked" else layout.files
    if args.drop_cache:
        evict(files)
    with MemSampler() as mem:
        t0 = time.perf_counter()
        if args.worker == "serial":
            banks, notes = load_serial(layout)
        elif args.worker in ("parallel", "convert"):
            banks, notes = load_parallel(layout, args.threads, args.chunk_mib)
        else:
            banks, notes = load_repacked(bank_path, layout, args.threads, args.chunk_mib)
        load_s = time.perf_counter() - t0
        if args.worker == "convert":
            bankfile.write_bank_file(bank_path, banks, layout)
            load_s = time.perf_counter() - t0
    result = {"mode": args.worker, "load_s": load_s, "bytes": banks.total_nbytes(), "checksum": checksum(banks),
              "peak_rss": mem.peak_rss, "min_available": mem.min_available, "notes": notes}
    print(f"{RESULT_TAG} {json.dumps(result)}", flush=True)
    return 0


# ------------------------------------------------------------------------------------------------ CLI

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem bench load", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="checkpoint directory (Hugging Face layout, safetensors)")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated modes (serial always runs) (default: %(default)s)")
    p.add_argument("--threads", type=int, default=min(16, os.cpu_count() or 1), help="reader threads (default: %(default)s)")
    p.add_argument("--chunk-mib", type=int, default=16, help="read chunk size per thread, MiB (default: %(default)s)")
    p.add_argument("--bank-dir", default=None,
                   help="where the repacked bank file goes (default: /var/tmp/tandem_banks_<model dir name>)")
    p.add_argument("--keep-bank", action="store_true", help="keep (and reuse) the repacked bank file after the run")
    p.add_argument("--no-drop-cache", dest="drop_cache", action="store_false",
                   help="do not evict the files from the page cache before each mode (warm reads)")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.add_argument("--progress-lines", action="store_true",
                   help="also print @@PROGRESS@@/@@RESULT@@ JSON lines on stdout (used by the worker)")
    p.add_argument("--worker", choices=(*MODES, "convert"), help=argparse.SUPPRESS)  # internal: one mode
    return p


def _run_mode(mode: str, argv: list[str]) -> dict:
    argv = [a for a in argv if a != "--progress-lines"]  # the worker's RESULT line is for us only
    cmd = [sys.executable, "-m", "services.profiler.bench_load", *argv, "--worker", mode]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=None, text=True)  # stderr: logs stay live
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_TAG)]
    if proc.returncode != 0 or not lines:
        return {"mode": mode, "error": f"subprocess exited {proc.returncode} without a result"}
    return json.loads(lines[-1][len(RESULT_TAG):])


def _table(rows: list[dict]) -> str:
    gib = lambda n: f"{n / 2**30:8.2f}" if n is not None else "       -"  # noqa: E731
    out = [f"{'mode':<18}{'load_s':>9}{'GiB/s':>8}{'peakRSS':>9}{'minAvail':>9}{'speedup':>8}{'GiB':>8}"
           f"  {'checksum':<26}status"]
    for r in rows:
        if "error" in r:
            out.append(f"{r['mode']:<18}{'-':>9}  {r['error']}  FAILED")
            continue
        gbps = r["bytes"] / r["load_s"] / 2**30 if r["load_s"] > 0 else 0.0
        speed = f"{r['speedup']:7.2f}x" if r.get("speedup") else "       -"
        note = ("  (" + "; ".join(r["notes"]) + ")") if r.get("notes") else ""
        out.append(f"{r['mode']:<18}{r['load_s']:9.3f}{gbps:8.2f}{gib(r['peak_rss'])}{gib(r['min_available'])}{speed}"
                   f"{gib(r['bytes'])}  {r['checksum']:<26}{r.get('status', '')}{note}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    setup_logging()
    if args.bank_dir is None:
        args.bank_dir = str(Path("/var/tmp") / f"tandem_banks_{Path(args.model).resolve().name}")
        argv += ["--bank-dir", args.bank_dir]
    if args.worker:
        return _worker(args)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad:
        print(f"tandem bench load: --modes: unknown mode(s) {bad}; choose from {', '.join(MODES)}", file=sys.stderr)
        return 2
    try:
        layout = expert_layout(args.model)  # fail here, once, on a bad checkpoint
    except (OSError, ValueError) as ex:
        print(f"tandem bench load: {ex}", file=sys.stderr)
        return 2
    modes = ["serial"] + [m for m in MODES[1:] if m in modes]
    rows: list[dict] = []
    bank_path = Path(args.bank_dir) / bankfile.FILENAME
    for i, mode in enumerate(modes):
        if args.progress_lines:
            print(f"{PROGRESS_TAG} {json.dumps({'step': i, 'total': len(modes), 'stage': mode})}", flush=True)
        if mode == "repacked":
            if bankfile.is_current(bank_path, layout):
                log.info("reusing the bank file %s (same source files)", bank_path)
            else:
                rows.append(dict(_run_mode("convert", argv), mode="convert (one-time)"))
        rows.append(_run_mode(mode, argv))
    ref = rows[0]
    failed = False
    for r in rows:
        if "error" in r:
            failed = True
            continue
        r["speedup"] = ref["load_s"] / r["load_s"] if "error" not in ref and r["load_s"] > 0 else None
        ok = "error" not in ref and r["checksum"] == ref["checksum"]
        r["status"] = "ok" if r is ref or ok else "BAD"
        failed |= r["status"] == "BAD"
    print(_table(rows))
    if not args.keep_bank and bank_path.exists():
        bank_path.unlink()
        if not any(bank_path.parent.iterdir()):
            bank_path.parent.rmdir()
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "rows": rows}, indent=2) + "\n")
    if args.progress_lines:
        print(f"{RESULT_TAG} {json.dumps({'ok': not failed, 'rows': rows})}", flush=True)
    if failed:
        print("tandem bench load: BAD — a mode's bytes differ from serial (or a mode failed)", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
