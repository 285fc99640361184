"""``response_format`` -> the engine's grammar (constrained decoding, services/engine/runtime/grammar.py):
the output is then valid by construction, whatever the weights.

    {"type": "text"}                                        no grammar
    {"type": "json_object"}                                 any JSON object
    {"type": "json_schema", "json_schema": {"schema": S}}   JSON valid under S; `strict` true or not, S
                                                            is enforced (a stricter answer than asked)

A schema the grammar library cannot compile comes back from the engine as a 400 naming why.
"""

from __future__ import annotations

from services.gateway.generation import RequestError
from services.gateway.protocol import ResponseFormat


def grammar_for_response_format(fmt: ResponseFormat | None) -> dict | None:
    """The engine's ``sampling.grammar`` for ``fmt`` (None: unconstrained text)."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"json_schema": {"type": "object"}}
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise RequestError("response_format of type json_schema needs json_schema.schema (a JSON schema)",
                           "response_format.json_schema")
    return {"json_schema": fmt.json_schema.schema_}
