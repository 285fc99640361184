"""Routing traces: which experts every MoE layer used for every token the engine computed (``--record-routing
DIR``), so a user with real weights can measure their own model's locality and replay it through the cache
simulator (benchmarks/sim_expert_cache.py), or fit a routing preset to it (``--fit``).

One file per engine start, ``DIR/routing-<UTC time>-<pid>.trace``, written as the engine steps:

    b"TANDEMRT1\\n" · one JSON line (model, layers, experts, top_k, id_bytes) · steps
    step:     b"S" · u32 number of sequences · per sequence: u16 id length, request id (utf-8), u32 start
              position, u32 tokens · then the step's expert ids, uint8 (E <= 256) or uint16 little-endian,
              [L, T, A] (T = the step's tokens, sequences in order)

A step is one call of each layer's expert backend, in the engine's order, so a replay through a cache sees
what the engine's cache saw (prompt chunks, decode batches, recomputed preemptions). The file stops growing at
``max_bytes`` (a warning says so once); a step is written whole or not at all.

Recording reads each step's ids back to the host: the runner turns CUDA graphs off while it records.
"""

from __future__ import annotations

import json
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from services.common.logging import get_logger

log = get_logger("routing_trace")

MAGIC = b"TANDEMRT1\n"
_SEQ = struct.Struct("<II")  # start position, tokens


class RoutingRecorder:
    """MoE blocks hand it each layer's ids (``record``); the runner brackets each forward with
    ``begin_step``/``end_step``, which appends the step to the file."""

    def __init__(self, directory: Path, model: str, num_layers: int, num_experts: int, top_k: int, max_bytes: int):
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        self.path = directory / f"routing-{stamp}-{os.getpid()}.trace"
        self.layers, self.top_k, self.max_bytes = num_layers, top_k, max_bytes
        self.dtype = np.uint8 if num_experts <= 256 else np.dtype("<u2")
        header = {"model": model, "layers": num_layers, "experts": num_experts, "top_k": top_k,
                  "id_bytes": np.dtype(self.dtype).itemsize}
        self._file = open(self.path, "wb")
        self._file.write(MAGIC + json.dumps(header).encode() + b"\n")
        self._file.flush()
        self.size = self._file.tell()
        self.full = False
        self._step: list[tuple[str, int, int]] | None = None
        self._ids: list[torch.Tensor | None] = []
        log.info("recording routing to %s (at most %.2f GB)", self.path, max_bytes / 1e9)

    def begin_step(self, request_ids: list[str], start_pos: list[int], query_lens: list[int]) -> None:
        self._step = None if self.full else list(zip(request_ids, start_pos, query_lens))
        self._ids = [None] * self.layers

    def record(self, moe_layer: int, topk_ids: torch.Tensor) -> None:
        if self._step is not None:
            self._ids[moe_layer] = topk_ids

    def end_step(self) -> None:
        if self._step is None or any(t is None for t in self._ids):
            return
        ids = torch.stack(self._ids).to("cpu", torch.int64).numpy().astype(self.dtype)  # [L, T, A]
        parts = [b"S", struct.pack("<I", len(self._step))]
        for rid, start, n in self._step:
            name = rid.encode()[:65535]
            parts += [struct.pack("<H", len(name)), name, _SEQ.pack(start, n)]
        parts.append(ids.tobytes())
        record = b"".join(parts)
        self._step, self._ids = None, []
        if self.size + len(record) > self.max_bytes:
            self.full = True
            log.warning("routing trace %s reached its %.2f GB bound: recording stopped", self.path, self.max_bytes / 1e9)
            return
        self._file.write(record)
        self._file.flush()
        self.size += len(record)

    def close(self) -> None:
        self._file.close()


@dataclass
class RoutingTrace:
    """A trace read back: ``steps`` of (sequences [(request id, start, tokens)], ids [L, T, A] int64)."""

    header: dict
    steps: list[tuple[list[tuple[str, int, int]], np.ndarray]]

    @property
    def layers(self) -> int:
        return self.header["layers"]

    @property
    def experts(self) -> int:
        return self.header["experts"]

    @property
    def top_k(self) -> int:
        return self.header["top_k"]

    def calls(self) -> list[list[int]]:
        """The engine's backend calls in order: per step and layer ``[layer, *ids of all the step's tokens]``."""
        return [[layer, *ids[layer].reshape(-1).tolist()] for _, ids in self.steps for layer in range(self.layers)]

    def sequences(self) -> dict[str, np.ndarray]:
        """Per request its ids by position, [L, N, A] (a recomputed position keeps its last routing)."""
        per: dict[str, dict[int, np.ndarray]] = {}
        for seqs, ids in self.steps:
            col = 0
            for rid, start, n in seqs:
                rows = per.setdefault(rid, {})
                for i in range(n):
                    rows[start + i] = ids[:, col + i, :]
                col += n
        out = {}
        for rid, rows in per.items():
            positions = sorted(rows)
            if positions == list(range(positions[-1] + 1)):  # prefix-cache hits skip positions: not a sequence
                out[rid] = np.stack([rows[p] for p in positions], axis=1)
        return out


def read_trace(path: Path) -> RoutingTrace:
    data = Path(path).read_bytes()
    if not data.startswith(MAGIC):
        raise ValueError(f"{path}: not a routing trace (written by tandem serve --record-routing)")
    end = data.index(b"\n", len(MAGIC))
    header = json.loads(data[len(MAGIC):end])
    dtype = np.uint8 if header["id_bytes"] == 1 else np.dtype("<u2")
    L, A, at, steps = header["layers"], header["top_k"], end + 1, []
    try:
        while at < len(data):
            if data[at:at + 1] != b"S":
                raise ValueError(f"bad step marker at byte {at}")
            (n_seqs,), at = struct.unpack_from("<I", data, at + 1), at + 5
            seqs = []
            for _ in range(n_seqs):
                (size,) = struct.unpack_from("<H", data, at)
                rid = data[at + 2:at + 2 + size].decode()
                start, n = _SEQ.unpack_from(data, at + 2 + size)
                seqs.append((rid, start, n))
                at += 2 + size + _SEQ.size
            T = sum(n for _, _, n in seqs)
            count = L * T * A
            ids = np.frombuffer(data, dtype=dtype, count=count, offset=at).astype(np.int64).reshape(L, T, A)
            at += count * np.dtype(dtype).itemsize
            steps.append((seqs, ids))
    except (struct.error, ValueError) as e:
        raise ValueError(f"{path}: truncated or corrupt routing trace ({e})") from None
    return RoutingTrace(header, steps)
