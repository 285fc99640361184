"""``response_format`` -> the engine's grammar (constrained decoding, services/engine/runtime/grammar.py):
the output is then valid by construction, whatever the weights.

    {"type": "text"}                                        no grammar
    {"type": "json_object"}                                 any JSON object
    {"type": "json_schema", "json_schema": {"schema": S}}   JSON valid under S; `strict` true or not, S
                                                            is enforced (a stricter answer than asked)

A schema the grammar library cannot compile comes back from the engine as a 400 naming why.

Harmony models (gpt-oss) answer in channels: the grammar lets them reason first (free ``analysis``
messages) and constrains the ``final`` message's body, which is the answer's text (reasoning.py).
"""

from __future__ import annotations

import json

from services.gateway.generation import RequestError
from services.gateway.protocol import ResponseFormat
from services.gateway.reasoning import CHANNEL, MESSAGE, harmony_ids
from services.gateway.tool_parsers import harmony_grammar, harmony_markers


def grammar_for_response_format(fmt: ResponseFormat | None, tokenizer=None) -> dict | None:
    """The engine's ``sampling.grammar`` for ``fmt`` (None: unconstrained text) with ``tokenizer``."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        schema = {"type": "object"}
    elif fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise RequestError("response_format of type json_schema needs json_schema.schema (a JSON schema)",
                           "response_format.json_schema")
    else:
        schema = fmt.json_schema.schema_
    if harmony_ids(tokenizer) is None:
        return {"json_schema": schema}
    try:
        m = harmony_markers(tokenizer)
    except ValueError as exc:
        raise RequestError(f"response_format: {exc}", "response_format") from exc
    compact = {**schema, "x-guidance": {"whitespace_flexible": False}}
    return {"lark": harmony_grammar(tokenizer, f'{m[CHANNEL]} "final" {m[MESSAGE]} %json {json.dumps(compact)}')}
