"""Engines found by DNS (--engines-dns), without processes: the name's parsing, a real lookup through
the system resolver, and the pool following a changing answer (engines join, leave, a failed lookup
keeps the last answer, a retired engine's client is closed only once its requests ended). The same
over real processes and a real resolver, on two network namespaces: tests/deploy/test_multi_host.py."""

from __future__ import annotations

import asyncio
import socket

import pytest

from services.gateway import discovery
from services.gateway.app import GatewayConfig, build_parser, discovered_client
from services.gateway.discovery import DnsEngines, DnsName
from services.gateway.engines import EngineError, EnginePool


@pytest.mark.parametrize("spec, expected", [
    ("http://tandem-engine.tandem.svc.cluster.local:8001", ("http", "tandem-engine.tandem.svc.cluster.local", 8001)),
    ("engines:9000", ("http", "engines", 9000)),
    ("https://engines:443/", ("https", "engines", 443)),
])
def test_dns_name_parses(spec, expected):
    name = DnsName.parse(spec)
    assert (name.scheme, name.host, name.port) == expected


@pytest.mark.parametrize("spec", ["engines", "http://engines", "ftp://engines:21", "http://engines:8001/v1",
                                  "http://user:pw@engines:8001", "http://engines:notaport"])
def test_bad_dns_name_is_one_line_cli_error(spec, capsys):
    from services.common.settings import config_or_exit

    args = build_parser().parse_args(["--engines-dns", spec])
    with pytest.raises(SystemExit) as exit_:
        config_or_exit("tandem gateway", GatewayConfig, args)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tandem gateway: --engines-dns") and "\n" not in err


def test_help_documents_the_flag_and_its_default(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--engines-dns ENGINES_DNS" in out and "[env TANDEM_ENGINES_DNS] (default: )" in out
    assert "--engines-dns-refresh-s" in out and "(default: 10.0)" in out


def test_static_default_is_left_out_with_a_dns_name():
    assert GatewayConfig().engine_urls == ["http://127.0.0.1:8001"]
    assert GatewayConfig(engines_dns="http://e:8001").engine_urls == []
    both = GatewayConfig(engines="http://a:8001,http://b:8001", engines_dns="http://e:8001")
    assert both.engine_urls == ["http://a:8001", "http://b:8001"]


def test_discovered_engine_id_fits_an_admin_path():
    assert discovered_client("http://10.0.0.7:8001").id == "10.0.0.7:8001"
    assert DnsName.parse("e:8001").url("fd00::7") == "http://[fd00::7]:8001"


def test_real_lookup_of_localhost():
    port = 8123
    urls = asyncio.run(discovery.resolve(DnsName.parse(f"http://localhost:{port}")))
    assert f"http://127.0.0.1:{port}" in urls and len(urls) == len(set(urls))


def test_a_name_that_does_not_resolve_raises():
    with pytest.raises(socket.gaierror):
        asyncio.run(discovery.resolve(DnsName.parse("http://no-such-host.invalid:8001")))


class _Client:
    """An engine that never answers its health check (membership is what is tested here)."""

    def __init__(self, url: str):
        self.url, self.id, self.closed = url, url.split("://")[1], False

    async def health(self) -> dict:
        raise EngineError(503, "down")

    async def close(self) -> None:
        self.closed = True


def test_pool_follows_the_dns_answer(monkeypatch):
    answers: list = [["http://10.0.0.1:8001", "http://10.0.0.2:8001"], socket.gaierror("temporary failure"),
                     ["http://10.0.0.2:8001", "http://10.0.0.3:8001"], ["http://10.0.0.3:8001"]]

    async def fake_resolve(name):
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(discovery, "resolve", fake_resolve)
    static = _Client("http://static:8001")
    pool = EnginePool([static], discovery=DnsEngines(DnsName.parse("e:8001"), 10.0), client_factory=_Client)

    async def scenario():
        ids = lambda: [e.client.id for e in pool.engines]  # noqa: E731
        await pool.discover_once()
        assert ids() == ["static:8001", "10.0.0.1:8001", "10.0.0.2:8001"]
        await pool.discover_once()  # the lookup fails: the last answer stays
        assert ids() == ["static:8001", "10.0.0.1:8001", "10.0.0.2:8001"]
        first, second = pool.engines[1], pool.engines[2]
        second.outstanding = 1  # a request still streams from 10.0.0.2
        await pool.discover_once()
        assert ids() == ["static:8001", "10.0.0.2:8001", "10.0.0.3:8001"]
        assert first.client.closed and not first.healthy
        await pool.discover_once()
        assert ids() == ["static:8001", "10.0.0.3:8001"]
        assert not second.client.closed  # retired, but its request is still running
        second.outstanding = 0
        answers.append(["http://10.0.0.3:8001"])
        await pool.discover_once()
        assert second.client.closed and not static.closed
        await pool.close()

    asyncio.run(scenario())


def test_empty_pool_answers_503_not_404():
    pool = EnginePool([], discovery=DnsEngines(DnsName.parse("e:8001"), 10.0), client_factory=_Client)
    with pytest.raises(EngineError) as err:
        pool.pick("m")
    assert err.value.status == 503
