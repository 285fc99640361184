"""How a generation is answered, shared by chat and completions: one JSON body, or Server-Sent Events
(the endpoint's chunks, then an error event or the optional usage chunk, then ``data: [DONE]``).

A request for n choices runs n generations (one engine request each; the prompt is prefilled once,
the other choices take it from the engine's prefix cache: ``_start_all``); their stream chunks
interleave, each carrying its choice's index, and usage counts the prompt once and every choice's
completion tokens.
"""

from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator, Callable, Iterable

from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from services.gateway import generation as g
from services.gateway.engines import EngineError, EnginePool
from services.gateway.protocol import new_id

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def usage(gens: list[g.Generation]) -> dict:
    """The request's usage: the prompt once (OpenAI's and vLLM's count; its cached tokens as choice 0
    found them), every choice's completion."""
    out = gens[0].usage()
    more = sum(x.completion_tokens for x in gens[1:])
    out["completion_tokens"] += more
    out["total_tokens"] += more
    return out


async def _choice_events(gen: g.Generation, stream, events_of: Callable[[g.Generation, g.Delta], Iterable[str]]):
    async for d in g.deltas(gen, stream):
        for event in events_of(gen, d):
            yield event


async def _merged(iterators: list) -> AsyncIterator[str]:
    """The events of several choices as they come; closing this closes (aborts) every choice."""
    if len(iterators) == 1:
        async for event in iterators[0]:
            yield event
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(it):
        try:
            async for event in it:
                await queue.put(event)
            await queue.put(done)
        except Exception as exc:  # the engine failed: the merged stream reports it
            await queue.put(exc)

    tasks = [asyncio.create_task(pump(it)) for it in iterators]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is done:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for it in iterators:
            await it.aclose()


async def event_stream(gens: list[g.Generation], streams: list,
                       events_of: Callable[[g.Generation, g.Delta], Iterable[str]],
                       usage_chunk: Callable[[], dict] | None, opening: Iterable[str] = ()) -> AsyncIterator[str]:
    """SSE text of started generations: ``opening``, the events of each delta of every choice, then
    (unless an engine failed mid-stream: its error event) the usage chunk if asked, then ``[DONE]``."""
    for event in opening:
        yield event
    try:
        async for event in _merged([_choice_events(x, s, events_of) for x, s in zip(gens, streams)]):
            yield event
    except EngineError as exc:
        yield sse(exc.body)
        yield sse("[DONE]")
        return
    if usage_chunk is not None:
        yield sse(usage_chunk())
    yield sse("[DONE]")


class _Peeked:
    """A started engine stream whose first output was already read (and is replayed first)."""

    def __init__(self, stream):
        self._stream = stream
        self._it = stream.__aiter__()
        self._first: list = []

    async def read_first(self) -> None:
        try:
            self._first.append(await self._it.__anext__())
        except StopAsyncIteration:
            pass

    async def __aiter__(self):
        for out in self._first:
            yield out
        async for out in self._it:
            yield out

    async def aclose(self) -> None:
        await self._stream.aclose()


async def _start_all(pool: EnginePool, gens: list[g.Generation]) -> list:
    """Start every choice's generation; if one cannot start, the ones started are closed (aborted).

    Shared prefill: with several choices, the first one is started alone and the others once its first
    token came back, i.e. once its prompt is in the engine's KV cache, from where the engine's prefix
    cache copies it into theirs instead of computing it again (started together, each would compute it)."""
    streams: list = []
    try:
        for gen in gens:
            streams.append(await g.start(pool, gen))
            if len(gens) > 1 and len(streams) == 1:
                streams[0] = _Peeked(streams[0])
                await streams[0].read_first()
    except BaseException:
        for gen, stream in zip(gens, streams):
            await g.close(gen, stream)
        raise
    return streams


async def respond(pool: EnginePool, gens: list[g.Generation], req, id_prefix: str,
                  events: Callable[[list, str, bool], AsyncIterator[str]], body: Callable[[str], BaseModel],
                  is_disconnected=None) -> Response:
    """Start ``gens`` (the request's choices) on their engines and answer ``req``: SSE from
    ``events(streams, response_id, include_usage)`` when it asks to stream, else ``body(response_id)``
    once every generation ended (499 when the client left before that)."""
    streams = await _start_all(pool, gens)
    response_id = new_id(id_prefix)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(events(streams, response_id, include_usage), media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    tasks = [asyncio.ensure_future(g.complete(x, s, is_disconnected)) for x, s in zip(gens, streams)]
    try:
        finished = await asyncio.gather(*tasks)
    finally:  # one choice failed: the others are aborted, not left decoding
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    if not all(finished):
        return Response(status_code=499)  # client closed the request (nginx's code); nobody reads it
    return JSONResponse(body(response_id).model_dump())
