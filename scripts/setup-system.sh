#!/usr/bin/env bash
# System packages the tests and the local stack need. Installs only what is missing;
# without root (or apt) it names what to install and goes on.
#   scripts/setup-system.sh          what `make setup` needs
#   scripts/setup-system.sh images   also what `make test-images` needs to build and run the images
set -euo pipefail
declare -A wanted=(
    [redis-server]=redis-server      # Celery broker/backend for the profiling worker
    [prometheus]=prometheus          # scrapes the local stack; promtool checks deploy/prometheus
    [docker-compose]=docker-compose  # `config -q` validates docker-compose.yml (no engine needed)
    [kubectl]=kubernetes-client      # `kubectl kustomize` renders deploy/k8s (tests/deploy/test_k8s.py; no cluster)
    [ip]=iproute2                    # network namespaces of tests/deploy/test_multi_host.py
)
if [ "${1:-}" = images ]; then
    # tests/deploy/compose_e2e.py: podman (with runc, netavark + aardvark-dns for service names,
    # iptables for netavark) serves docker-compose; debootstrap makes the base image.
    wanted+=(
        [podman]=podman
        [runc]=runc
        [/usr/lib/podman/netavark]=netavark
        [/usr/lib/podman/aardvark-dns]=aardvark-dns
        [iptables]=iptables
        [debootstrap]=debootstrap
    )
fi
missing=()
for cmd in "${!wanted[@]}"; do
    if [[ $cmd == /* ]]; then [ -x "$cmd" ] && continue; else command -v "$cmd" >/dev/null 2>&1 && continue; fi
    missing+=("${wanted[$cmd]}")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing ${missing[*]} (apt)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    # Debian starts the services on install; the stack and the tests start their own.
    for svc in redis-server prometheus; do service "$svc" stop >/dev/null 2>&1 || true; done
else
    echo "setup: please install ${missing[*]} (e.g. sudo apt-get install ${missing[*]})" >&2
fi
