"""Write the compose override that runs one engine per GPU behind the one gateway (docs/operating.md).

    python3 scripts/compose_engines.py                  # one engine per GPU nvidia-smi lists
    python3 scripts/compose_engines.py --gpus 0,1       # those GPUs only (nvidia-smi indices or UUIDs)
    python3 scripts/compose_engines.py --cpu-engines 2  # no GPU: 2 CPU engines, each on half the cores
    docker compose -f docker-compose.yml -f docker-compose.engines.yml up -d --build

Compose has no loops, so N engines are N services, written here from what the host has (stdlib only:
run it with the host's python3, like scripts/wheelhouse.py). The override (docker-compose.engines.yml):
  engine, engine-1 ... engine-<N-1>   engine i on GPU i alone (device_ids: its UUID) and pinned to the
                                      GPU's local cores (cpuset, from sysfs local_cpulist; GPUs of one
                                      NUMA node split it); engine-i `extends` the compose file's engine,
                                      so it runs the same image, command and settings (port 8001 each)
  worker                              reserves every engine's GPU: a profile job with {"gpu": "all"}
                                      writes one profile per GPU UUID
  gateway                             TANDEM_ENGINES lists every engine (least-outstanding routing)
  prometheus                          scrapes every engine, labelled engine="i" and gpu="<uuid>"
                                      (or "cpu"), from the targets file written beside the override
It replaces docker-compose.override.yml (the single-GPU reservation): name the files with -f, or set
COMPOSE_FILE=docker-compose.yml:docker-compose.engines.yml in .env. Run it again after changing GPUs.
engine-i extends docker-compose.yml's engine only: an override file of yours that changes `engine` (build
args, volumes) must say the same for engine-1... after this one (as tests/deploy/compose.ci-engines.yml does).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from services.common.topology import (Gpu, cpu_engine_cpusets, engine_cpusets, format_cpulist,  # noqa: E402
                                      list_gpus)

ENGINE_PORT = 8001  # the engine's port in docker-compose.yml (every engine container has its own network name)


def engine_name(i: int) -> str:
    return "engine" if i == 0 else f"engine-{i}"


def choose_gpus(selector: str, gpus: list[Gpu]) -> list[Gpu]:
    """``all`` or comma-separated nvidia-smi indices / UUIDs -> those GPUs, in the order given."""
    if not gpus:
        raise ValueError("nvidia-smi lists no GPU (driver missing?); without a GPU use --cpu-engines N")
    if selector == "all":
        return gpus
    by_key = {**{str(g.index): g for g in gpus}, **{g.uuid: g for g in gpus}}
    chosen = []
    for key in (k.strip() for k in selector.split(",") if k.strip()):
        if key not in by_key:
            raise ValueError(f"--gpus: no GPU {key!r} (have {', '.join(f'{g.index} {g.uuid}' for g in gpus)})")
        if by_key[key] in chosen:
            raise ValueError(f"--gpus: GPU {key!r} named twice (one engine per GPU)")
        chosen.append(by_key[key])
    if not chosen:
        raise ValueError("--gpus: name at least one GPU, or 'all'")
    return chosen


def gpu_reservation(uuids: list[str]) -> dict:
    return {"resources": {"reservations": {"devices": [{"driver": "nvidia", "device_ids": uuids,
                                                        "capabilities": ["gpu"]}]}}}


def override(engines: list[dict], targets: str) -> dict:
    """The compose override for ``engines`` (each: gpu uuid or None, cpus list)."""
    services: dict[str, dict] = {}
    for i, e in enumerate(engines):
        svc: dict = {} if i == 0 else {"extends": {"file": "docker-compose.yml", "service": "engine"}}
        if e["gpu"]:
            svc["deploy"] = gpu_reservation([e["gpu"]])
        if e["cpus"]:
            svc["cpuset"] = format_cpulist(e["cpus"])
        services[engine_name(i)] = svc
    gpus = [e["gpu"] for e in engines if e["gpu"]]
    if gpus:
        services["worker"] = {"deploy": gpu_reservation(gpus)}
    services["gateway"] = {
        "depends_on": {engine_name(i): {"condition": "service_healthy"} for i in range(1, len(engines))},
        "environment": {"TANDEM_ENGINES": ",".join(f"http://{engine_name(i)}:{ENGINE_PORT}"
                                                   for i in range(len(engines)))}}
    # the same container path as docker-compose.yml's mount: compose replaces that mount with this one
    services["prometheus"] = {"volumes": [f"./{targets}:/etc/prometheus/targets.json:ro"]}
    return {"services": services}


def prometheus_targets(engines: list[dict]) -> list[dict]:
    """deploy/prometheus/targets/compose.json with one group per engine, labelled engine and gpu."""
    groups = [{"targets": [f"{engine_name(i)}:{ENGINE_PORT}"],
               "labels": {"job": "engine", "engine": str(i), "gpu": e["gpu"] or "cpu"}} for i, e in enumerate(engines)]
    return groups + [{"targets": ["gateway:8000"], "labels": {"job": "gateway"}},
                     {"targets": ["worker:9101"], "labels": {"job": "worker"}}]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/compose_engines.py", description=__doc__.split("\n\n")[0],
                                     epilog="docs/operating.md, 'Several GPUs', says what the files do.")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--gpus", default="all", help="GPUs to run an engine on: 'all' (every GPU nvidia-smi lists) "
                       "or comma-separated nvidia-smi indices or UUIDs (default: all)")
    which.add_argument("--cpu-engines", type=int, metavar="N",
                       help="no GPU: N CPU engines, each pinned to 1/N of this host's cores (whole physical cores); "
                       "run with TANDEM_DEVICE=cpu TANDEM_DTYPE=float32")
    parser.add_argument("--no-pin", action="store_true", help="leave the engines' CPUs unpinned (no cpuset)")
    parser.add_argument("--output", default="docker-compose.engines.yml",
                        help="the override to write, relative to the repository (default: %(default)s)")
    parser.add_argument("--targets", default="deploy/prometheus/targets/engines.json",
                        help="Prometheus' targets file to write, relative to the repository (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        if args.cpu_engines is not None:
            if args.cpu_engines < 1:
                raise ValueError(f"--cpu-engines must be at least 1, got {args.cpu_engines}")
            cpusets = cpu_engine_cpusets(args.cpu_engines) if args.cpu_engines > 1 else [[]]
            engines = [{"gpu": None, "cpus": cpus} for cpus in cpusets]
        else:
            gpus = choose_gpus(args.gpus, list_gpus())
            engines = [{"gpu": g.uuid, "cpus": cpus} for g, cpus in zip(gpus, engine_cpusets(gpus))]
    except ValueError as exc:
        print(f"scripts/compose_engines.py: {exc}", file=sys.stderr)
        return 2
    if args.no_pin:
        engines = [{**e, "cpus": []} for e in engines]
    # compose resolves an override's paths from the project directory, the first file's (the repository)
    output, targets = REPO / args.output, REPO / args.targets
    mount = os.path.relpath(targets.resolve(), REPO)
    output.parent.mkdir(parents=True, exist_ok=True)
    targets.parent.mkdir(parents=True, exist_ok=True)
    what = "CPU engines" if args.cpu_engines is not None else "engines, one per GPU"
    header = (f"# Written by scripts/compose_engines.py on {socket.gethostname()} at "
              f"{time.strftime('%Y-%m-%d %H:%M:%S')}: {len(engines)} {what}.\n"
              "# Regenerate it rather than editing it; docs/operating.md ('Several GPUs') explains it. JSON is YAML.\n")
    output.write_text(header + json.dumps(override(engines, mount), indent=2) + "\n")
    targets.write_text(json.dumps(prometheus_targets(engines), indent=2) + "\n")
    for i, e in enumerate(engines):
        print(f"{engine_name(i)}: {e['gpu'] or 'CPU'}" + (f", CPUs {format_cpulist(e['cpus'])}" if e["cpus"] else ""))
    files = f"-f docker-compose.yml -f {args.output}"
    print(f"wrote {args.output} and {args.targets}; start: docker compose {files} up -d --build")
    return 0


if __name__ == "__main__":
    sys.exit(main())
