"""Atomic file replacement: write a temp file beside the target, fsync it, ``os.replace`` it over the
target. A reader sees the old file or the new one, never half of one; a failure leaves no temp file."""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Iterator


@contextmanager
def atomic_write(target: Path, mode: str = "w", perms: int | None = None) -> Iterator[IO]:
    """Yield a file opened with ``mode`` ("w" or "wb") that replaces ``target`` when the block exits
    cleanly (flushed and fsynced first). ``perms``: chmod of the new file (mkstemp creates it 0600).
    The parent directory must exist."""
    fd, tmp = tempfile.mkstemp(prefix=".tmp-" + target.name + ".", dir=target.parent)
    try:
        if perms is not None:
            os.fchmod(fd, perms)
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
