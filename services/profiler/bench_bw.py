"""`tandem bench bw`: measure this host's bandwidths and write the GPU's profile (docs/design.md §1, §4).

    tandem bench bw                                   # first GPU, bf16, Qwen3-30B-A3B geometry
    tandem bench bw --dtype bfloat16,float32 --model mixtral-8x7b --gpu GPU-3f2a... --seconds 2
    tandem bench bw --dtype bfloat16,fp8_block                 # also FP8 experts' rates (the engine reads the entry of its format)
    tandem bench bw --model synthetic:gpt-oss-120b --dtype bfloat16,mxfp4   # gpt-oss's MXFP4 experts
    tandem bench bw --dtype bfloat16,q4_K,q4_K+q6_K,q8_0     # GGUF experts (a Q4_K_M file's layers: q4_K, q4_K+q6_K)
    tandem bench bw --profiles-dir /profiles          # the shared volume (default env TANDEM_PROFILES_DIR)
    tandem bench bw -o /tmp/p.json                    # this file instead of the profiles dir

Without a CUDA GPU it measures the CPU side only, says so, and writes a profile named
``cpu-<hostname>`` that ``--moe-backend auto`` treats as "no GPU" (offload).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
import time
from dataclasses import dataclass
from typing import Callable

from services.common import profiles as P
from services.common.logging import get_logger, setup_logging
from services.profiler import hostinfo

log = get_logger("profiler.bench_bw")

PROGRESS_TAG = "@@PROGRESS@@"  # machine-readable lines on stdout (the Celery task parses them)
RESULT_TAG = "@@RESULT@@"


@dataclass(frozen=True)
class Geometry:
    num_layers: int  # L MoE layers
    num_experts: int  # E
    top_k: int  # A
    hidden_size: int  # D
    moe_intermediate_size: int  # I


def geometry(model: str) -> Geometry:
    """The geometry of a preset of the model helper's synthetic table (services/engine/models/synthetic.py):
    'NAME' or 'synthetic:NAME[?layers=N]'. Raises ValueError naming the presets."""
    from services.engine.models.spec import ModelSpec
    from services.engine.models.synthetic import PREFIX, PRESETS, parse_name

    name, overrides = parse_name(model if model.startswith(PREFIX) else PREFIX + model)
    if name not in PRESETS:
        raise ValueError(f"--model {model!r}: no such preset; choose from {', '.join(sorted(PRESETS))}")
    cfg = {**PRESETS[name], **overrides}
    cfg["vocab_size"] = cfg.get("vocab_size") or 1  # the vocabulary does not matter here
    spec = ModelSpec.from_hf_config(cfg, source=f"synthetic preset {name}")
    return Geometry(spec.num_moe_layers, spec.num_experts, spec.top_k, spec.hidden_size, spec.moe_intermediate_size)


# expert formats by their profile key (services/common/profiles.format_key): unquantized experts in a dtype,
# fp8_block (FP8 experts of a bf16 model: the CPU executor's dpbf16 kernel, 4 banks per expert to copy) or
# mxfp4 (gpt-oss's experts of a bf16 model: e2m1 + E8M0 per 32, biases, clamped SwiGLU; 6 banks to copy), or a
# GGUF format (q4_K, ..., q4_K+q6_K: the file's blocks, 2 banks; a Q4_K_M model's engine reads the entry of its
# most common layer format, services/engine/moe/hybrid_split.profile_format)
GGUF_FORMATS = ("q4_K", "q5_K", "q6_K", "q8_0", "mxfp4_gguf", "q4_K+q6_K", "q5_K+q6_K")  # probes.GGUF_FORMATS (torch-free)
DTYPES = ("bfloat16", "float32", "fp8_block", "mxfp4", *GGUF_FORMATS)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem bench bw", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16",
                   help=f"comma-separated expert formats to measure, from {', '.join(DTYPES)} (bfloat16/float32: "
                        "unquantized experts in that dtype; fp8_block: FP8 experts of a bf16 model; mxfp4: gpt-oss's "
                        "MXFP4 experts of a bf16 model, with their biases and clamped SwiGLU, which needs a --model "
                        "whose hidden and expert intermediate sizes are multiples of 32; q4_K, q5_K, q6_K, q8_0, "
                        "mxfp4_gguf, q4_K+q6_K, q5_K+q6_K: GGUF experts of a bf16 model, gate_up+down types, "
                        "sizes whole blocks); each is one entry of the "
                        "profile, which the engine picks by its expert format (default: %(default)s)")
    p.add_argument("--model", default="synthetic:qwen3-30b-a3b",
                   help="geometry: a synthetic preset, 'synthetic:NAME[?layers=N]' or 'NAME' (default: %(default)s)")
    p.add_argument("--threshold", type=float, default=P.DEFAULT_THRESHOLD,
                   help="predicted speedup hybrid needs over offload to be chosen (default: %(default)s)")
    p.add_argument("--gpu", default=None, help="GPU to measure: UUID or nvidia-smi index (default: first visible)")
    p.add_argument("-o", "--output", default=None, help="write the profile to this file instead of the profiles dir")
    p.add_argument("--profiles-dir", default=None, help="profiles directory (default: env TANDEM_PROFILES_DIR)")
    p.add_argument("--seconds", type=float, default=2.0, help="wall time per measurement (default: %(default)s)")
    p.add_argument("--buffer-mib", type=int, default=1024,
                   help="buffer for the ceilings (CPU read, linear copies), MiB (default: %(default)s)")
    p.add_argument("--cpu-kernel", default="auto", choices=("auto", "executor", "torch"),
                   help="CPU expert kernel: the C++ executor, torch GEMVs, or auto = executor if it builds (default: %(default)s)")
    p.add_argument("--progress-lines", action="store_true",
                   help=f"also print {PROGRESS_TAG}/{RESULT_TAG} JSON lines on stdout (used by the worker)")
    return p


def _emit(args: argparse.Namespace, tag: str, obj: dict) -> None:
    if args.progress_lines:
        print(f"{tag} {json.dumps(obj)}", flush=True)


def _version() -> str:
    try:
        return importlib.metadata.version("tandem")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def measure(args: argparse.Namespace, geo: Geometry, dtypes: list[str], gpu: hostinfo.GpuTarget | None,
            host: P.HostInfo, cpus: list[int]) -> tuple[P.Profile, int]:
    """Run every measurement (tqdm progress) and assemble the profile."""
    import torch
    from tqdm import tqdm

    from services.profiler import probes

    dev = gpu.torch_index if gpu else None
    if dev is not None:
        torch.cuda.set_device(dev)
    secs, buf = args.seconds, args.buffer_mib << 20
    # with a GPU, one core is left to the thread that enqueues copies and waits on the GPU (as hybrid
    # does: services.engine.moe.cpu_executor.default_num_threads); pinned spinning workers on every
    # core would time-slice with it and the concurrent numbers would measure the contention
    cores = host.physical_cores
    threads = cores - 1 if dev is not None and cores > 2 else cores
    steps: list[tuple[str, Callable[[], None]]] = []
    results: dict = {"kernels": {}, "concurrent": {}}

    def ceilings_cpu() -> None:
        results["cpu_read"], results["cpu_read_kernel"] = probes.cpu_read(buf, cpus, secs), "numpy"

    def ceilings_gpu() -> None:
        results["h2d"], results["d2h"] = probes.linear_copy(buf, dev, secs)

    def p2p() -> None:  # every ordered pair of this host's GPUs: the peer tier's rates
        n = torch.cuda.device_count()
        uuids = [P.normalize_uuid(str(torch.cuda.get_device_properties(i).uuid)) for i in range(n)]
        links = probes.p2p_links([torch.device("cuda", i) for i in range(n)], min(buf, 256 << 20))
        results["p2p"] = [P.P2PLink(src=uuids[i], dst=uuids[j], gbps=g) for i, j, g in links]

    steps.append(("cpu read", ceilings_cpu))
    if dev is not None:
        steps.append(("linear H2D/D2H", ceilings_gpu))
        if torch.cuda.device_count() > 1:
            steps.append(("P2P pairs", p2p))
        else:
            log.info("one GPU: no P2P pair to measure (the profile's p2p stays empty)")
    for name in dtypes:
        def kernels(name: str = name) -> None:
            fmt = name if name in probes.QUANTIZED else "unquantized"
            dtype = torch.bfloat16 if fmt != "unquantized" else getattr(torch, name)  # quantized: a bf16 model
            bank = probes.make_bank(geo.num_experts, geo.hidden_size, geo.moe_intermediate_size, dtype,
                                    pin=dev is not None, fmt=fmt)
            kern = probes.CpuKernel(bank, geo.top_k, threads, args.cpu_kernel)
            try:
                ceiling = kern.read_ceiling(buf)  # the executor's own pool: one pinned thread per core
                if ceiling is not None and ceiling > results["cpu_read"]:
                    results["cpu_read"], results["cpu_read_kernel"] = ceiling, "cpu_executor"
                k = {"cpu_executor_bs1": probes.cpu_kernel_bw(kern, secs), "cpu_kernel": kern.name}
                if dev is not None:
                    gather = probes.Gather(bank, geo.top_k, dev)
                    k["pcie_gather"], k["gather_kernel"] = probes.gather_bw(gather, secs), gather.name
                    pcie_ov, cpu_ov = probes.concurrent(kern, gather, secs)
                    results["concurrent"][name] = P.Concurrent(pcie_ov=pcie_ov, cpu_ov=cpu_ov)
                results["kernels"][name] = P.KernelBandwidths(**k)
                results.setdefault("expert_bytes", bank.expert_bytes)
                if "c_sync_s" not in results:  # per-layer handoff of the first format's kernel
                    results["c_sync_s"] = probes.c_sync(kern, geo.hidden_size, dev, min(secs, 1.0))
            finally:
                kern.close()
        steps.append((f"kernels {name}", kernels))

    bar = tqdm(total=len(steps), desc="bench bw", unit="step", file=sys.stderr)
    for i, (label, fn) in enumerate(steps):
        bar.set_postfix_str(label)
        _emit(args, PROGRESS_TAG, {"step": i, "total": len(steps), "stage": label})
        fn()
        bar.update(1)
    bar.close()
    _emit(args, PROGRESS_TAG, {"step": len(steps), "total": len(steps), "stage": "done"})
    return P.Profile(
        schema_version=P.SCHEMA_VERSION,
        gpu=gpu.info if gpu else hostinfo.cpu_only_gpu_info(),
        host=host, created_at=P.now_iso(), tandem_version=_version(),
        ceilings=P.Ceilings(cpu_read=results["cpu_read"], h2d=results.get("h2d"), d2h=results.get("d2h"),
                            cpu_read_kernel=results["cpu_read_kernel"]),
        kernels=results["kernels"], concurrent=results["concurrent"], c_sync_s=results["c_sync_s"],
        geometry=P.Geometry(model=args.model, num_layers=geo.num_layers, num_experts=geo.num_experts,
                            top_k=geo.top_k, hidden_size=geo.hidden_size,
                            moe_intermediate_size=geo.moe_intermediate_size),
        threshold=args.threshold, p2p=results.get("p2p", []),
    ), results["expert_bytes"]


def format_table(profile: P.Profile, expert_bytes: int) -> str:
    """The human-readable result: ceilings, kernels per format, and the decision at a few miss rates."""
    g = lambda v: "-" if v is None else f"{v:8.1f}" if v >= 10 else f"{v:8.3f}"  # noqa: E731
    c = profile.ceilings
    rows = [f"GPU {profile.gpu.uuid} ({profile.gpu.name or 'none'}) · {profile.host.cpu_model} · "
            f"{profile.host.physical_cores} cores",
            f"{'ceiling':<28}{'GB/s':>9}",
            f"{'cpu read (STREAM)':<28}{g(c.cpu_read):>9}  {c.cpu_read_kernel}", f"{'H2D linear pinned':<28}{g(c.h2d):>9}",
            f"{'D2H linear pinned':<28}{g(c.d2h):>9}",
            f"{'format':<12}{'cpu bs1':>9}{'pcie gather':>12}{'pcie_ov':>9}{'cpu_ov':>9}  kernels"]
    for name, k in profile.kernels.items():
        ov = profile.concurrent.get(name)
        rows.append(f"{name:<12}{g(k.cpu_executor_bs1):>9}{g(k.pcie_gather):>12}{g(ov and ov.pcie_ov):>9}"
                    f"{g(ov and ov.cpu_ov):>9}  {k.cpu_kernel}/{k.gather_kernel or '-'}")
    rows.append(f"c_sync {profile.c_sync_s * 1e6:.1f} us per layer")
    for link in profile.p2p:
        rows.append(f"P2P {link.src} -> {link.dst}: {link.gbps:.1f} GB/s")
    geo = profile.geometry
    for rate in (0.25, 0.5, 0.75):
        m = P.expected_misses_per_layer(geo.top_k, rate)
        d = P.decide(profile, expert_bytes, m, geo.num_layers)
        rows.append(f"cache rate {rate:.2f} ({m:.1f} misses/layer): {d.backend:<8} {d.reason}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    setup_logging()
    try:
        geo = geometry(args.model)
    except ValueError as ex:
        print(f"tandem bench bw: {ex}", file=sys.stderr)
        return 2
    dtypes = [d.strip() for d in args.dtype.split(",") if d.strip()]
    bad = [d for d in dtypes if d not in DTYPES]
    if bad or not dtypes:
        print(f"tandem bench bw: --dtype {args.dtype!r}: unknown format(s) {bad}; choose from {', '.join(DTYPES)}",
              file=sys.stderr)
        return 2
    from services.engine.moe.banks import ExpertFormat, check_geometry

    for name in (d for d in dtypes if d not in ("bfloat16", "float32")):
        try:
            check_geometry(ExpertFormat(name), geo.hidden_size, geo.moe_intermediate_size)
        except ValueError as ex:
            print(f"tandem bench bw: --dtype {name} with --model {args.model!r}: {ex}", file=sys.stderr)
            return 2
    if args.seconds <= 0 or args.buffer_mib <= 0:
        print("tandem bench bw: --seconds and --buffer-mib must be positive", file=sys.stderr)
        return 2
    try:
        gpu = hostinfo.resolve_gpu(args.gpu)
    except ValueError as ex:
        print(f"tandem bench bw: {ex}", file=sys.stderr)
        return 2
    if gpu is None:
        log.warning("no CUDA GPU visible: measuring the CPU side only; the profile (%s) makes "
                    "--moe-backend auto choose offload", P.cpu_uuid())
    topo = hostinfo.cpu_topology()
    host = hostinfo.host_info()
    t0 = time.perf_counter()
    profile, expert_bytes = measure(args, geo, dtypes, gpu, host, [cpu for cpu, _, _ in topo])
    path = P.write_profile(profile, args.profiles_dir, path=args.output)
    print(format_table(profile, expert_bytes))
    print(f"profile written: {path}" + ("" if gpu else "  (CPU only: no GPU was measured)"))
    _emit(args, RESULT_TAG, {"profile_path": str(path), "gpu_uuid": profile.gpu.uuid, "has_gpu": profile.has_gpu,
                             "elapsed_s": round(time.perf_counter() - t0, 3),
                             "summary": profile.model_dump(mode="json", include={"ceilings", "kernels", "concurrent",
                                                                                 "c_sync_s"})})
    return 0


if __name__ == "__main__":
    sys.exit(main())
