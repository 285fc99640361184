"""How a generation is answered, shared by chat and completions: one JSON body, or Server-Sent Events
(the endpoint's chunks, then an error event or the optional usage chunk, then ``data: [DONE]``)."""

from __future__ import annotations

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


async def event_stream(gen: g.Generation, stream, events_of: Callable[[g.Delta], Iterable[str]],
                       usage_chunk: Callable[[], dict] | None, opening: Iterable[str] = ()) -> AsyncIterator[str]:
    """SSE text of a started generation: ``opening``, the events of each delta, then (unless the engine
    failed mid-stream: its error event) the usage chunk if asked, then ``[DONE]``."""
    for event in opening:
        yield event
    try:
        async for d in g.deltas(gen, stream):
            for event in events_of(d):
                yield event
    except EngineError as exc:
        yield sse(exc.body)
        yield sse("[DONE]")
        return
    if usage_chunk is not None:
        yield sse(usage_chunk())
    yield sse("[DONE]")


async def respond(pool: EnginePool, gen: g.Generation, req, id_prefix: str,
                  events: Callable[[object, str, bool], AsyncIterator[str]], body: Callable[[str], BaseModel],
                  is_disconnected=None) -> Response:
    """Start ``gen`` on its engine and answer ``req``: SSE from ``events(stream, response_id,
    include_usage)`` when it asks to stream, else ``body(response_id)`` once the generation ended
    (499 when the client left before that)."""
    stream = await g.start(pool, gen)
    response_id = new_id(id_prefix)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(events(stream, response_id, include_usage), media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    if not await g.complete(gen, stream, is_disconnected):
        return Response(status_code=499)  # client closed the request (nginx's code); nobody reads it
    return JSONResponse(body(response_id).model_dump())
