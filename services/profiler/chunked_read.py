"""Multi-threaded chunked reads of byte-range copy jobs, with O_DIRECT where the filesystem allows it.

Why O_DIRECT: a cold checkpoint read through the page cache costs a second copy and leaves GBs of
cache behind; direct reads go disk -> our buffer. Each thread owns one page-aligned bounce buffer of
``chunk_bytes`` (O_DIRECT needs aligned offsets, lengths and addresses; the banks are not aligned), so
the extra memory is threads x chunk, never a whole shard. Chunks are cut from merged job ranges, so
one chunk serves many small expert tensors.
"""

from __future__ import annotations

import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from services.profiler.expert_layout import CopyJob

ALIGN = 4096  # O_DIRECT alignment (logical block size is 512 or 4096 on everything we run on)
MERGE_GAP = 1 << 20  # read through gaps smaller than this (non-expert tensors between experts)


@dataclass
class _Chunk:
    file: Path
    start: int  # aligned file offset
    length: int  # aligned length
    jobs: list[CopyJob] = field(default_factory=list)


@dataclass
class ReadStats:
    bytes_read: int  # bytes read from disk (chunks, including alignment and merged gaps)
    direct: bool  # whether every file was read with O_DIRECT
    notes: list[str]


def _plan(jobs: list[CopyJob], chunk_bytes: int) -> list[_Chunk]:
    chunks: list[_Chunk] = []
    by_file: dict[Path, list[CopyJob]] = {}
    for j in jobs:
        by_file.setdefault(j.file, []).append(j)
    for file, fjobs in by_file.items():
        fjobs.sort(key=lambda j: j.src_offset)
        ranges: list[list] = []  # [start, end, jobs]
        for j in fjobs:
            if ranges and j.src_offset - ranges[-1][1] <= MERGE_GAP:
                ranges[-1][1] = max(ranges[-1][1], j.src_offset + j.nbytes)
                ranges[-1][2].append(j)
            else:
                ranges.append([j.src_offset, j.src_offset + j.nbytes, [j]])
        for start, end, rjobs in ranges:
            pos = start // ALIGN * ALIGN
            while pos < end:
                length = min(chunk_bytes, -(-(end - pos) // ALIGN) * ALIGN)
                c = _Chunk(file, pos, length, [j for j in rjobs
                                               if j.src_offset < pos + length and j.src_offset + j.nbytes > pos])
                chunks.append(c)
                pos += length
    return chunks


def _open(file: Path, direct: bool, notes: list[str]) -> tuple[int, bool]:
    if direct and hasattr(os, "O_DIRECT"):
        try:
            fd = os.open(file, os.O_RDONLY | os.O_DIRECT)
            probe = mmap.mmap(-1, ALIGN)
            try:
                os.preadv(fd, [probe], 0)  # some filesystems accept the flag and fail the read
                return fd, True
            except OSError as ex:
                os.close(fd)
                notes.append(f"{file}: O_DIRECT read failed ({ex.strerror}); buffered reads instead")
            finally:
                probe.close()
        except OSError as ex:
            notes.append(f"{file}: O_DIRECT unsupported here ({ex.strerror}, e.g. tmpfs); buffered reads instead")
    return os.open(file, os.O_RDONLY), False


def read_jobs(jobs: list[CopyJob], dst: Callable[[CopyJob], torch.Tensor], *, threads: int = 8,
              chunk_bytes: int = 16 << 20, direct: bool = True) -> ReadStats:
    """Execute ``jobs``: read their byte ranges in aligned chunks on ``threads`` threads and copy each
    job's bytes into ``dst(job)`` (a flat uint8 tensor) at ``job.dst_offset``."""
    chunk_bytes = max(ALIGN, chunk_bytes // ALIGN * ALIGN)
    chunks = _plan(jobs, chunk_bytes)
    notes: list[str] = []
    fds: dict[Path, tuple[int, bool]] = {f: _open(f, direct, notes) for f in {c.file for c in chunks}}
    local = threading.local()

    def run(c: _Chunk) -> int:
        if not hasattr(local, "buf"):
            local.buf = mmap.mmap(-1, chunk_bytes)  # page-aligned anonymous memory
            local.view = torch.frombuffer(local.buf, dtype=torch.uint8)  # [chunk_bytes]
        fd, _ = fds[c.file]
        got = 0
        while got < c.length:
            n = os.preadv(fd, [memoryview(local.buf)[got:c.length]], c.start + got)
            if n == 0:
                break  # end of file inside the last aligned block
            got += n
        for j in c.jobs:
            a, b = max(j.src_offset, c.start), min(j.src_offset + j.nbytes, c.start + got)
            if b <= a:
                raise OSError(f"{c.file}: short read at offset {c.start + got} (file truncated?)")
            out = dst(j)
            out[j.dst_offset + a - j.src_offset: j.dst_offset + b - j.src_offset].copy_(
                local.view[a - c.start: b - c.start])
        return got

    try:
        with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="chunked-read") as pool:
            total = sum(pool.map(run, chunks))
    finally:
        for fd, _ in fds.values():
            os.close(fd)
    return ReadStats(total, all(d for _, d in fds.values()), notes)
