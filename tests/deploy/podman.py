"""Docker's stand-in for the compose test: Debian's podman, as root, behind Debian's docker-compose v1.

Settings that work on the CI machines (no systemd, cgroup v1 mounts, limits set by the sandbox), written
to a private containers.conf / storage.conf so nothing system-wide changes:
  runtime runc        crun fails on this cgroup layout
  cgroupfs, file      no systemd for cgroups or the events log
  default_ulimits     podman raises nofile/nproc above the hard limits for root, which runc may not set;
                      nproc above kernel.pid_max is refused too
  images              built by docker-compose through `podman system service` (Docker format: HEALTHCHECK
                      kept); `podman build --format docker` for the stand-ins
  healthchecks        without systemd nothing runs them: HealthLoop calls `podman healthcheck run`
A base image comes from debootstrap + `podman import`, since no registry is reachable.
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path


class Podman:
    """podman with a private configuration and storage under ``state``, and its Docker API socket."""

    def __init__(self, state: Path):
        self.state = state
        self.socket = state / "podman.sock"
        self.service: subprocess.Popen | None = None
        state.mkdir(parents=True, exist_ok=True)
        (state / "tmp").mkdir(exist_ok=True)
        nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        nproc = min(resource.getrlimit(resource.RLIMIT_NPROC)[1],
                    int(Path("/proc/sys/kernel/pid_max").read_text()))
        (state / "containers.conf").write_text(
            "[containers]\n"
            f'default_ulimits = ["nofile={nofile}:{nofile}", "nproc={nproc}:{nproc}"]\n'
            "[engine]\n"
            'runtime = "runc"\ncgroup_manager = "cgroupfs"\nevents_logger = "file"\n'
            f'tmp_dir = "{state / "tmp"}"\n'
            "[network]\n"
            'network_backend = "netavark"\n')
        (state / "storage.conf").write_text(
            f'[storage]\ndriver = "overlay"\ngraphroot = "{state / "storage"}"\nrunroot = "{state / "run"}"\n')

    @property
    def env(self) -> dict[str, str]:
        """The environment for podman and for docker-compose (DOCKER_HOST: the podman service)."""
        return {**os.environ, "CONTAINERS_CONF": str(self.state / "containers.conf"),
                "CONTAINERS_STORAGE_CONF": str(self.state / "storage.conf"),
                "DOCKER_HOST": f"unix://{self.socket}"}

    def run(self, *args: str, check: bool = True, timeout: float = 600, **kw) -> subprocess.CompletedProcess:
        result = subprocess.run(["podman", *args], env=self.env, capture_output=True, text=True,
                                timeout=timeout, **kw)
        if check and result.returncode != 0:
            raise AssertionError(f"podman {' '.join(args)}: exit {result.returncode}\n{result.stderr[-3000:]}")
        return result

    def start_service(self) -> None:
        """`podman system service` on the private socket, until stop_service()."""
        self.socket.unlink(missing_ok=True)
        log = open(self.state / "service.log", "w")
        self.service = subprocess.Popen(["podman", "system", "service", "--time=0", f"unix://{self.socket}"],
                                        env=self.env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while not self.socket.exists():
            log_text = (self.state / "service.log").read_text()
            assert self.service.poll() is None, f"podman system service exited: {log_text}"
            assert time.monotonic() < deadline, "podman system service: no socket after 30 s"
            time.sleep(0.2)

    def stop_service(self) -> None:
        if self.service is not None and self.service.poll() is None:
            self.service.terminate()
            try:
                self.service.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.service.kill()
                self.service.wait()

    def image_exists(self, name: str) -> bool:
        return self.run("image", "exists", name, check=False).returncode == 0

    def image_size(self, name: str) -> int:
        return int(self.run("image", "inspect", "--format", "{{.Size}}", name).stdout.strip())

    def debootstrap_image(self, name: str, suite: str, packages: list[str], mirror: str) -> None:
        """Import a minimal Debian ``suite`` with ``packages`` as image ``name`` (kept once made)."""
        if self.image_exists(name):
            return
        assert shutil.which("debootstrap"), "debootstrap missing: scripts/setup-system.sh installs it"
        with tempfile.TemporaryDirectory(dir=self.state) as tmp:
            root = Path(tmp) / "rootfs"
            subprocess.run(["debootstrap", "--variant=minbase", f"--include={','.join(packages)}", suite,
                            str(root), mirror], check=True, capture_output=True, timeout=1200)
            # The package lists and .debs are stale in an image: every Dockerfile runs apt-get update.
            for junk in ("var/lib/apt/lists", "var/cache/apt"):
                for path in (root / junk).glob("*"):
                    shutil.rmtree(path) if path.is_dir() else path.unlink()
            tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
            self.run("import", "-", name, stdin=tar.stdout)
            assert tar.wait() == 0


class HealthLoop:
    """Runs every healthcheck of a compose project's containers every ``period`` s, as Docker's daemon
    would (podman leaves that to systemd timers, absent here), so `depends_on: service_healthy` and
    `docker-compose ps` see real health states."""

    def __init__(self, podman: Podman, project: str, period: float = 3.0):
        self.podman, self.project, self.period = podman, project, period
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="healthchecks", daemon=True)

    def __enter__(self) -> "HealthLoop":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            ids = self.podman.run("ps", "-q", "--filter", f"label=com.docker.compose.project={self.project}",
                                  check=False).stdout.split()
            for cid in ids:
                # exit status 1 = unhealthy (or still starting): the state is what matters, read elsewhere
                self.podman.run("healthcheck", "run", cid, check=False, timeout=60)

    def states(self) -> dict[str, str]:
        """Compose service name -> its container's health ("healthy", "starting", "unhealthy")."""
        out = self.podman.run("ps", "-a", "--filter", f"label=com.docker.compose.project={self.project}",
                              "--format", '{{index .Labels "com.docker.compose.service"}} {{.Status}}').stdout
        states = {}
        for line in out.splitlines():
            service, _, status = line.partition(" ")
            states[service] = next((s for s in ("unhealthy", "healthy", "starting") if f"({s})" in status),
                                   status)
        return states
