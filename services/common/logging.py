"""One log format for every service: time, level, service name, message."""

from __future__ import annotations

import logging

from services.common.settings import env

_FORMAT = "%(asctime)s %(levelname)s [%(name)s] %(message)s"


def setup_logging(level: str | None = None) -> None:
    """Configure the root logger once (idempotent); level from TANDEM_LOG_LEVEL by default."""
    root = logging.getLogger()
    if getattr(root, "_tandem_configured", False):
        return
    logging.basicConfig(level=(level or env("TANDEM_LOG_LEVEL")).upper(), format=_FORMAT, datefmt="%H:%M:%S")
    root._tandem_configured = True  # type: ignore[attr-defined]


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger(f"tandem.{name}")
