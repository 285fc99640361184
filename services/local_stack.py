"""`make run`: the docker-compose topology as local processes, for machines without Docker.

    redis-server ─ worker (celery, --pool solo) ─ engine(s) (tandem engine) ─ gateway (tandem gateway)
    └─ Prometheus (when installed) scraping engines, gateway and worker

``--engines N`` starts N engines behind the one gateway (docs/operating.md "Several GPUs"): on CUDA one
per GPU (engine i sees only GPU i through CUDA_VISIBLE_DEVICES and is pinned to that GPU's local CPU
cores, split between GPUs sharing a NUMA node); on the CPU, N engines each pinned to an equal share of
the cores. Engine i listens on --engine-port + i and is named ``engine`` (i = 0) or ``engine-<i>``.

Each service logs to ``runs/stack-<time>/<service>.log``; a port already in use is named before anything
starts; Ctrl-C (or SIGTERM) stops every process. A service that dies after it was ready (an engine
killed by the OOM killer, ``kill -9``) is restarted and waited for, up to --max-restarts times; one
that cannot start, or dies once more than that, stops the stack with its log's last line. Flags after the
stack's own go to the engine (``python -m services.local_stack --moe-backend hybrid``).

The Prometheus config is the compose one (deploy/prometheus/prometheus.yml) with this stack's targets
written to targets.json beside it: one source, no near-duplicate config (``write_prometheus_config``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from services.common.logging import get_logger, setup_logging
from services.common.settings import add_dataclass_arguments, dataclass_from_args, env_list, field
from services.common.topology import Gpu, cpu_engine_cpusets, engine_cpusets, format_cpulist, list_gpus

log = get_logger("local_stack")
REPO = Path(__file__).resolve().parents[1]
PROMETHEUS_SOURCE = REPO / "deploy" / "prometheus"
SERVICES = ("redis", "worker", "engine", "gateway", "prometheus")  # start order; stop is the reverse


@dataclass
class StackConfig:
    model: str = field(env="TANDEM_MODEL", help="what the engine serves (checkpoint dir, 'demo', 'synthetic:NAME')")
    device: str = field("cpu", help="engine compute device (cpu or cuda)")
    port: int = field(8000, help="gateway port (the OpenAI API)")
    engine_port: int = field(8001, help="engine port (internal API); engine i of --engines listens on this + i")
    engines: int = field(1, help="engines behind the gateway. cuda: one per GPU, engine i on GPU i alone "
                         "(CUDA_VISIBLE_DEVICES) pinned to the GPU's local CPU cores; 0 = one per visible GPU. "
                         "cpu: N engines, each pinned to 1/N of the cores (whole physical cores). "
                         "1 = one engine, not pinned")
    redis_port: int = field(6379, help="redis-server port (Celery broker and backend)")
    worker_metrics_port: int = field(9101, help="profiling worker's Prometheus port")
    prometheus_port: int = field(9090, help="Prometheus port (skipped when prometheus is not installed)")
    scrape_interval: str = field("5s", help="Prometheus scrape and rule interval")
    services: str = field(",".join(SERVICES), help="comma-separated subset of the services to start")
    runs_dir: str = field("runs", help="where the per-run log directory is made")
    ready_timeout: float = field(900.0, help="seconds each service may take to become ready")
    max_restarts: int = field(5, help="times each service that dies after it was ready is restarted before "
                              "the stack gives up and stops (0 = any death stops the stack)")


@dataclass(frozen=True)
class EnginePlacement:
    """One engine of the stack: where it listens, what it may see and run on, how Prometheus labels it."""

    name: str  # service name: "engine" (engine 0), "engine-1", ...
    port: int
    cpus: list[int]  # CPU affinity; [] = not pinned
    env: dict[str, str]  # added to the stack's environment (CUDA_VISIBLE_DEVICES)
    labels: dict[str, str]  # Prometheus target labels: engine (the gateway's engine id), gpu


def engine_name(i: int) -> str:
    """Engine i's service (and log file) name: the first keeps the single-engine stack's name."""
    return "engine" if i == 0 else f"engine-{i}"


def visible_gpus(environ: dict) -> list[Gpu]:
    """nvidia-smi's GPUs, narrowed to CUDA_VISIBLE_DEVICES (indices or UUIDs) when it is set."""
    gpus = list_gpus()
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return gpus
    by_key = {**{str(g.index): g for g in gpus}, **{g.uuid: g for g in gpus}}
    return [by_key[v.strip()] for v in visible.split(",") if v.strip() in by_key]


def engine_placements(config: StackConfig, environ: dict) -> list[EnginePlacement]:
    """The engines ``config`` asks for (docs/operating.md "Several GPUs"); ValueError naming a bad
    --engines. One engine keeps the single-engine behaviour: no pinning, every GPU visible."""
    n, device = config.engines, config.device
    if n < 0:
        raise ValueError(f"--engines must be 0 (one per GPU) or positive, got {n}")
    if not device.startswith("cuda"):
        if n == 0:
            raise ValueError("--engines 0 means one engine per GPU: it needs --device cuda")
        cpusets = cpu_engine_cpusets(n) if n > 1 else [[]]
        return [EnginePlacement(engine_name(i), config.engine_port + i, cpusets[i], {}, {"engine": str(i), "gpu": "cpu"})
                for i in range(n)]
    gpus = visible_gpus(environ)
    if n == 1:
        return [EnginePlacement("engine", config.engine_port, [], {},
                                {"engine": "0", **({"gpu": gpus[0].uuid} if gpus and device == "cuda" else {})})]
    if device != "cuda":
        raise ValueError(f"--engines {n} gives each engine its own GPU: use --device cuda, not {device}")
    if not gpus:
        raise ValueError(f"--engines {n}: nvidia-smi lists no GPU (is the driver installed?)")
    n = n or len(gpus)
    if n > len(gpus):
        raise ValueError(f"--engines {n}: only {len(gpus)} GPU(s) visible ({', '.join(g.uuid for g in gpus)})")
    cpusets = engine_cpusets(gpus[:n])
    return [EnginePlacement(engine_name(i), config.engine_port + i, cpusets[i], {"CUDA_VISIBLE_DEVICES": g.uuid},
                            {"engine": str(i), "gpu": g.uuid}) for i, g in enumerate(gpus[:n])]


def write_prometheus_config(dst: Path, ports: dict[str, int], scrape_interval: str = "15s",
                            host: str = "127.0.0.1", engines: list[tuple[int, dict]] | None = None) -> Path:
    """Copy deploy/prometheus's config and rules into ``dst`` with targets.json for ``ports`` (job name
    -> port on ``host``) and ``engines`` (job engine: port and target labels, one group each) and the
    given scrape/evaluation interval. Returns the config path."""
    dst.mkdir(parents=True, exist_ok=True)
    text = (PROMETHEUS_SOURCE / "prometheus.yml").read_text()
    for key in ("scrape_interval", "evaluation_interval"):
        text, count = re.subn(rf"(?m)^(\s+{key}:\s*)\S+", rf"\g<1>{scrape_interval}", text)
        if count != 1:
            raise ValueError(f"{PROMETHEUS_SOURCE / 'prometheus.yml'}: expected one global {key}, found {count}")
    (dst / "prometheus.yml").write_text(text)
    shutil.copy(PROMETHEUS_SOURCE / "rules.yml", dst / "rules.yml")
    groups = [{"targets": [f"{host}:{port}"], "labels": {"job": "engine", **labels}} for port, labels in engines or []]
    groups += [{"targets": [f"{host}:{port}"], "labels": {"job": job}} for job, port in ports.items()]
    (dst / "targets.json").write_text(json.dumps(groups, indent=2) + "\n")
    return dst / "prometheus.yml"


def redis_command(port: int, data_dir: Path) -> list[str]:
    """redis-server as the stack runs it: loopback only, every write in an append-only file in
    ``data_dir`` (fsynced each second), so queued and finished jobs survive a restart."""
    return ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data_dir),
            "--appendonly", "yes", "--appendfsync", "everysec", "--save", ""]


class PortTaken(RuntimeError):
    pass


def check_ports(ports: dict[str, int]) -> None:
    """Raise ``PortTaken`` naming every service whose port is already bound on this host."""
    taken = []
    for service, port in ports.items():
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                taken.append(f"port {port} ({service}) is taken")
    if taken:
        flags = "--port, --engine-port, --redis-port, --worker-metrics-port, --prometheus-port"
        raise PortTaken("; ".join(taken) + f". Stop what uses it (`ss -ltnp`) or pick another port ({flags}).")


class Stack:
    """Start, watch and stop the services of one ``StackConfig``; a context manager."""

    def __init__(self, config: StackConfig, engine_args: list[str] | None = None, env: dict | None = None):
        self.config = config
        self.engine_args = list(engine_args or [])
        wanted = [s.strip() for s in config.services.split(",") if s.strip()]
        unknown = set(wanted) - set(SERVICES)
        if unknown:
            raise ValueError(f"--services: unknown {sorted(unknown)}; choose from {', '.join(SERVICES)}")
        self.env = dict(os.environ if env is None else env)
        self.placements = engine_placements(config, self.env) if "engine" in wanted or "gateway" in wanted else []
        # "engine" stands for every engine: engine, engine-1, ... in start order
        self.wanted = [name for s in wanted for name in ([p.name for p in self.placements] if s == "engine" else [s])]
        if "prometheus" in self.wanted and shutil.which("prometheus") is None:
            log.warning("prometheus is not installed: starting the stack without it (apt-get install prometheus)")
            self.wanted.remove("prometheus")
        self.run_dir = Path(config.runs_dir) / time.strftime("stack-%Y%m%d-%H%M%S")
        self.env.update({
            "TANDEM_REDIS_URL": f"redis://127.0.0.1:{config.redis_port}/0",
            "TANDEM_ENGINES": ",".join(f"http://127.0.0.1:{p.port}" for p in self.placements),
            "TANDEM_WORKER_METRICS_PORT": str(config.worker_metrics_port),
            "PYTHONUNBUFFERED": "1",
        })
        self.procs: dict[str, subprocess.Popen] = {}
        self.restarts: dict[str, int] = {s: 0 for s in self.wanted}

    def ports(self) -> dict[str, int]:
        c = self.config
        every = {"redis": c.redis_port, "worker": c.worker_metrics_port, "gateway": c.port,
                 "prometheus": c.prometheus_port, **{p.name: p.port for p in self.placements}}
        return {s: every[s] for s in self.wanted}

    def placement(self, service: str) -> "EnginePlacement | None":
        return next((p for p in self.placements if p.name == service), None)

    def command(self, service: str) -> list[str]:
        c, py = self.config, sys.executable
        if service == "redis":  # one data dir for every run: jobs outlive a stack restart
            data_dir = Path(c.runs_dir) / "redis"
            data_dir.mkdir(parents=True, exist_ok=True)
            return redis_command(c.redis_port, data_dir.resolve())
        if service == "worker":  # --pool solo: job metrics live in the process serving /metrics
            return [py, "-m", "celery", "-A", "services.profiler.app", "worker", "--pool", "solo",
                    "--loglevel", "INFO", "--hostname", f"tandem-local-{c.worker_metrics_port}@%h"]
        if (engine := self.placement(service)) is not None:
            return [py, "-m", "services.cli", "engine", "--model", c.model, "--device", c.device,
                    "--host", "127.0.0.1", "--port", str(engine.port), *self.engine_args]
        if service == "gateway":  # engine URLs via TANDEM_ENGINES
            return [py, "-m", "services.cli", "gateway", "--host", "127.0.0.1", "--port", str(c.port)]
        ports = self.ports()
        scrape = {job: ports[job] for job in ("gateway", "worker") if job in ports}
        engines = [(p.port, p.labels) for p in self.placements if p.name in ports]
        config = write_prometheus_config(self.run_dir / "prometheus", scrape, c.scrape_interval, engines=engines)
        return ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={self.run_dir / 'prometheus' / 'data'}",
                f"--web.listen-address=127.0.0.1:{c.prometheus_port}"]

    def ready(self, service: str) -> bool:
        """One readiness probe: redis PONG, engine/gateway /health status ok, worker/prometheus answering."""
        port = self.ports()[service]
        try:
            if service == "redis":
                with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
                    sock.sendall(b"PING\r\n")
                    return sock.recv(16).startswith(b"+PONG")
            path = {"worker": "/metrics", "prometheus": "/-/ready"}.get(service, "/health")
            resp = httpx.get(f"http://127.0.0.1:{port}{path}", timeout=5)
            if resp.status_code != 200:
                return False
            return path != "/health" or resp.json().get("status") == "ok"
        except (OSError, httpx.HTTPError, ValueError):
            return False

    def start(self) -> None:
        """Start every wanted service in order, each ready before the next; raises on any failure."""
        check_ports(self.ports())
        if "redis" in self.wanted and shutil.which("redis-server") is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server), or leave it out "
                               "with --services")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        log.info("logs in %s", self.run_dir)
        for service in self.wanted:
            self._spawn(service)
            self._wait_ready(service)
            log.info("%-10s ready on port %d (log %s)", service, self.ports()[service],
                     self.run_dir / f"{service}.log")

    def _spawn(self, service: str, append: bool = False) -> None:
        logfile = open(self.run_dir / f"{service}.log", "ab" if append else "wb")
        engine = self.placement(service)
        env = {**self.env, **(engine.env if engine else {})}
        cpus = set(engine.cpus) if engine and engine.cpus else None
        # New session: Ctrl-C in the terminal reaches only this process, which then stops the
        # services in reverse order (the gateway before the engine it talks to). An engine's CPU
        # affinity is set in the child before exec: its threads (CPU executor workers) inherit it.
        self.procs[service] = subprocess.Popen(self.command(service), stdout=logfile, stderr=subprocess.STDOUT,
                                               env=env, cwd=REPO, start_new_session=True,
                                               preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
        logfile.close()
        if engine is not None and not append:
            log.info("%s: port %d, %s%s", service, engine.port, engine.labels.get("gpu", self.config.device),
                     f", CPUs {format_cpulist(engine.cpus)}" if engine.cpus else "")

    def restart_exited(self) -> None:
        """Supervise: start again each service that exited (its log appended) and wait until it is ready,
        up to --max-restarts times per service; past that, or when it cannot get ready again, raise
        naming it (the stack stops)."""
        for service, proc in list(self.procs.items()):
            if proc.poll() is None:
                continue
            if self.restarts[service] >= self.config.max_restarts:
                self.check_alive()  # raises naming it, with its log's last line
            self.restarts[service] += 1
            _signal_group(proc, signal.SIGKILL)  # leftovers of its process group (a worker's children)
            log.warning("%s exited with code %d: %s; restarting it (restart %d of at most %d)", service,
                        proc.returncode, self.log_tail(service, lines=1) or "(empty log)", self.restarts[service],
                        self.config.max_restarts)
            self._spawn(service, append=True)
            self._wait_ready(service)
            log.info("%s ready again on port %d", service, self.ports()[service])

    def _wait_ready(self, service: str) -> None:
        deadline = time.monotonic() + self.config.ready_timeout
        while not self.ready(service):
            self.check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"{service} not ready after {self.config.ready_timeout:.0f} s; "
                                   f"see {self.run_dir / (service + '.log')}\n{self.log_tail(service)}")
            time.sleep(0.5)

    def check_alive(self) -> None:
        """Raise naming the first service that exited, with its log's last line: the reason, when the
        service says why it stops (`tandem engine: cannot serve ...`) or dies on an exception."""
        for service, proc in self.procs.items():
            if proc.poll() is not None:
                last = self.log_tail(service, lines=1) or "(empty log)"
                raise RuntimeError(f"{service} exited with code {proc.returncode}: {last} "
                                   f"(log: {self.run_dir / (service + '.log')})")

    def log_tail(self, service: str, lines: int = 30) -> str:
        """The last ``lines`` non-empty lines of ``service``'s log."""
        path = self.run_dir / f"{service}.log"
        text = path.read_text(errors="replace").splitlines() if path.exists() else []
        return "\n".join([line for line in text if line.strip()][-lines:])

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM each service's process group in reverse start order; SIGKILL what outlives ``grace``."""
        for service in reversed(list(self.procs)):
            proc = self.procs[service]
            if proc.poll() is None:
                _signal_group(proc, signal.SIGTERM)
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                log.warning("%s ignored SIGTERM for %.0f s; killing it", service, grace)
                _signal_group(proc, signal.SIGKILL)
                proc.wait()
            _signal_group(proc, signal.SIGKILL)  # leftovers of the group (worker children, ...)
        self.procs.clear()

    def __enter__(self) -> "Stack":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class _Stop(BaseException):  # not Exception: no `except Exception` on the way may swallow it
    pass


def _raise_stop(signum, frame) -> None:
    raise _Stop()


def _curl_for_gateway(port: int) -> str:
    """The same ready-to-paste request `tandem serve` prints, for the model the gateway lists."""
    from services.serve import curl_example

    keys = env_list("TANDEM_API_KEYS")
    headers = {"Authorization": f"Bearer {keys[0]}"} if keys else {}
    model_id = httpx.get(f"http://127.0.0.1:{port}/v1/models", headers=headers, timeout=10).json()["data"][0]["id"]
    return curl_example("127.0.0.1", port, model_id, bool(keys))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.local_stack", description=__doc__.split("\n\n")[0],
                                     epilog="Other flags are passed to `tandem engine` (e.g. --moe-backend hybrid).")
    add_dataclass_arguments(parser, StackConfig)
    args, engine_args = parser.parse_known_args(argv)
    setup_logging()
    config = dataclass_from_args(StackConfig, args)
    # Explicit handlers: a shell starting us in the background leaves SIGINT ignored, which would
    # make Ctrl-C / `kill -INT` a no-op.
    signal.signal(signal.SIGTERM, _raise_stop)
    signal.signal(signal.SIGINT, _raise_stop)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per readiness probe otherwise
    try:
        stack = Stack(config, engine_args)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    try:
        stack.start()
        urls = {"gateway": f"http://127.0.0.1:{config.port}/v1", "prometheus": f"http://127.0.0.1:{config.prometheus_port}"}
        shown = ", ".join(f"{s} {u}" for s, u in urls.items() if s in stack.wanted)
        log.info("stack ready: %s; Ctrl-C stops everything", shown or ", ".join(stack.wanted))
        if "gateway" in stack.wanted:
            print(f"\nTry it:\n{_curl_for_gateway(config.port)}\n", flush=True)
        while True:
            stack.restart_exited()
            time.sleep(0.5)
    except PortTaken as exc:
        log.error("%s", exc)
        return 2
    except (KeyboardInterrupt, _Stop):  # Ctrl-C, kill -INT, kill -TERM
        log.info("stopping %s", ", ".join(reversed(list(stack.procs))))
        return 0
    except RuntimeError as exc:
        log.error("%s", exc)
        return 1
    finally:
        stack.stop()


if __name__ == "__main__":
    sys.exit(main())
