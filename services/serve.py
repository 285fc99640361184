"""`tandem serve`: the gateway and the engine in one process (the single-machine default).

The gateway reaches the engine through the in-process client (no HTTP hop); flags are EngineConfig's
plus the gateway's (--host/--port are the gateway's, default 8000; --api-key). The model loads in the
background: /health says "loading" with progress until it serves, then a ready-to-paste curl is printed.
"""

from __future__ import annotations

import argparse
import json
import shlex

from services.common.logging import get_logger, setup_logging
from services.common.settings import add_dataclass_arguments, config_or_exit, env
from services.engine.config import EngineConfig
from services.gateway.app import GatewayConfig, create_app
from services.gateway.shutdown import gateway_server

log = get_logger("serve")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem serve", description="Serve a MoE model with the OpenAI API: "
                                     "gateway + engine in one process.")
    add_dataclass_arguments(parser, EngineConfig, skip=("host", "port"))
    add_dataclass_arguments(parser, GatewayConfig, skip=("engines", "engines_dns", "engines_dns_refresh_s"))
    parser.add_argument("--log-level", default=None,
                        help="DEBUG logs each request's summary (default: TANDEM_LOG_LEVEL)")
    return parser


def curl_example(host: str, port: int, model_id: str, needs_key: bool) -> str:
    """A ready-to-paste chat request against this server. The API key is never printed (terminals and
    logs are kept and shared): with keys, the request reads it from $OPENAI_API_KEY, which OpenAI's
    clients read too."""
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    body = json.dumps({"model": model_id, "messages": [{"role": "user", "content": "Hello! Who are you?"}],
                       "max_tokens": 32})
    auth = ' \\\n  -H "Authorization: Bearer $OPENAI_API_KEY"' if needs_key else ""
    note = "# export OPENAI_API_KEY=<one of the gateway's API keys> first\n" if needs_key else ""
    return (f"{note}curl http://{shown}:{port}/v1/chat/completions \\\n  -H 'Content-Type: application/json'{auth} \\\n"
            f"  -d {shlex.quote(body)}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    engine_cfg = config_or_exit("tandem serve", EngineConfig, args)
    gateway_cfg = config_or_exit("tandem serve", GatewayConfig, args, engines="in-process")
    from fastapi import Depends

    from services.engine.api import create_control_router, create_router, run_until_stopped
    from services.engine.guard import ENGINE_TOKEN_ENV, engine_token_guard
    from services.engine.engine import Engine
    from services.engine.preflight import check_model_or_exit
    from services.gateway.engines import InProcessEngineClient

    check_model_or_exit("tandem serve", engine_cfg)
    keys = gateway_cfg.api_key_list

    def ready() -> None:
        model_id = engine.info()["model_id"]  # the first --served-model-name, if any
        print(f"\nTandem is serving {model_id} (backend {engine_cfg.moe_backend.value}) on "
              f"http://{gateway_cfg.host}:{gateway_cfg.port}. Try:\n\n"
              f"{curl_example(gateway_cfg.host, gateway_cfg.port, model_id, bool(keys))}\n", flush=True)

    engine = Engine(engine_cfg, on_ready=ready)
    app = create_app(gateway_cfg, [InProcessEngineClient(engine)], before_metrics=engine.refresh_metrics)
    # The engine's read-only API (/engine/v1/info, /stats) on the same port, behind the same API keys:
    # benchmarks and operators read engine stats from a single-process server too. Its control routes
    # (generate, abort, reload-profile) are no client's business: only with the engine token, if any.
    app.include_router(create_router(engine, dependencies=[Depends(app.state.api_key_guard)]))
    if engine_token := env(ENGINE_TOKEN_ENV):
        app.include_router(create_control_router(engine, dependencies=[Depends(engine_token_guard(engine_token))]))
    log.info("gateway on http://%s:%d; loading %s in the background (GET /health for progress)",
             gateway_cfg.host, gateway_cfg.port, engine_cfg.model)
    # the gateway's server: its limits, and on SIGTERM --shutdown-grace-s for requests in flight
    return run_until_stopped("tandem serve", app, engine, gateway_cfg.host, gateway_cfg.port,
                             server=gateway_server(app, gateway_cfg))
