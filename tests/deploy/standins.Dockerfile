# Stand-ins for docker-compose.yml's registry-only images, for the CI test (tests/deploy/compose_e2e.py),
# where no container registry is reachable: Debian packages behind the same commands, ports, volumes and
# healthchecks the compose file gives the real images. One target per service.
ARG BASE_IMAGE

# redis:7.4.1-alpine -> Debian's redis-server; compose runs `redis-server --appendonly yes ...`,
# healthcheck `redis-cli ping`. The official image serves other containers with no password (protected mode off by
# default); Debian's binary refuses them unless told, so `redis-server` on PATH says so first.
FROM ${BASE_IMAGE} AS redis
RUN apt-get update \
    && apt-get install -y --no-install-recommends redis-server \
    && rm -rf /var/lib/apt/lists/* \
    && printf '#!/bin/sh\nexec /usr/bin/redis-server --protected-mode no "$@"\n' > /usr/local/bin/redis-server \
    && chmod 755 /usr/local/bin/redis-server \
    && mkdir /data \
    && chown redis:redis /data
# Like the official image: the append-only file goes to /data (compose mounts a volume there).
WORKDIR /data
USER redis
EXPOSE 6379
CMD ["redis-server"]

# prom/prometheus -> Debian's prometheus (2.42, the one the local stack and promtool tests use), entry
# point and user like the official image: compose passes only flags, healthcheck uses wget.
FROM ${BASE_IMAGE} AS prometheus
RUN apt-get update \
    && apt-get install -y --no-install-recommends prometheus wget \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir /prometheus \
    && chown nobody:nogroup /prometheus
USER nobody
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus"]

# grafana/grafana has no Debian package. The stand-in serves, on :3000, /api/health and the directories
# compose mounts (/dashboards, /provisioning), so the mounts, the port, the healthcheck and depends_on are
# checked; the dashboard's queries are checked against a real Prometheus by tests/deploy/test_stack_e2e.py.
FROM ${BASE_IMAGE} AS grafana
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 wget \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /srv/grafana/api \
    && echo '{"database": "ok", "standin": true}' > /srv/grafana/api/health \
    && ln -s /var/lib/grafana/dashboards /srv/grafana/dashboards \
    && ln -s /etc/grafana/provisioning /srv/grafana/provisioning
USER nobody
EXPOSE 3000
CMD ["python3", "-m", "http.server", "3000", "--directory", "/srv/grafana"]
