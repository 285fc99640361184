"""Harmony replies (gpt-oss) split by channel: reasoning apart from the answer (``reasoning_content``, as
vLLM returns it) and, when the request has tools, function calls apart from both.

A harmony reply is a run of messages, each a header then ``<|message|>`` then the body, ended by
``<|end|>`` (more follows) or ``<|return|>`` / ``<|call|>`` (generation stops: both are EOS in
generation_config, so the engine consumes them). The chat template's generation prompt ends with
``<|start|>assistant``, so a reply begins inside the first header. A header names the channel after
``<|channel|>`` and may name a recipient (``to=functions.NAME``, before or after the channel) and a
content type (``<|constrain|>json``):

    <|channel|>analysis<|message|>Need the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Oslo"}<|call|>

Text of the ``analysis`` channel is reasoning; a message addressed to ``functions.NAME`` is a call of NAME
(its body the arguments, a JSON object) when calls are asked for; every other body (``final``, a
``commentary`` preamble) is the answer. The split works on token ids (the markers are special tokens,
which the detokenizer drops), so it streams: ``feed`` takes each engine delta's ids and returns the
parts, which the caller detokenizes; a call is returned once its message has ended.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from services.common.tokenizer import Tokenizer

CHANNEL, MESSAGE, END, START = "<|channel|>", "<|message|>", "<|end|>", "<|start|>"
CONSTRAIN, CALL, RETURN = "<|constrain|>", "<|call|>", "<|return|>"
REASONING_CHANNEL = "analysis"
FUNCTIONS = "functions."  # the namespace the chat template gives the request's tools


@dataclass
class HarmonyParts:
    reasoning: list[int] = field(default_factory=list)  # ids of analysis bodies
    answer: list[int] = field(default_factory=list)  # ids of every other body (and of malformed calls)
    calls: list = field(default_factory=list)  # the calls completed, as ``make_call`` returned them


class HarmonySplitter:
    """``make_call(name, body_text)``: a call object, or None when the body is not a call (malformed
    arguments: the body then goes to the answer, as the text parsers leave a malformed call as
    content); None (the default) returns no calls: addressed bodies go to the answer too."""

    def __init__(self, tokenizer: Tokenizer, ids: dict[str, int | None],
                 make_call: Callable[[str, str], object | None] | None = None) -> None:
        self.tokenizer, self.make_call = tokenizer, make_call
        self.channel_id, self.message_id, self.start_id = ids[CHANNEL], ids[MESSAGE], ids[START]
        self.ends = {i for i in (ids[END], ids.get(CALL), ids.get(RETURN)) if i is not None}
        self.header_markers = {i for i in (ids[CHANNEL], ids.get(CONSTRAIN)) if i is not None}
        self.in_header = True  # a reply starts inside the first message's header
        self.header: list[int] = []
        self.channel = ""
        self.call: str | None = None  # the function the current body is addressed to
        self.body: list[int] = []  # the current call's body ids

    def feed(self, ids: list[int]) -> HarmonyParts:
        """One delta's token ids -> its parts; header and marker tokens go to none."""
        out = HarmonyParts()
        for t in ids:
            if t in self.ends or t == self.start_id or (t == self.channel_id and not self.in_header):
                self._end_message(out)  # a <|channel|> in a body: a header without its <|start|>
                self.in_header, self.header = True, [t] if t == self.channel_id else []
            elif t == self.message_id and self.in_header:
                self.channel, recipient = self._read_header(self.header)
                self.call = self._function(recipient)
                self.in_header, self.header = False, []
            elif self.in_header:
                self.header.append(t)
            elif self.call is not None:
                self.body.append(t)
            else:
                (out.reasoning if self.channel == REASONING_CHANNEL else out.answer).append(t)
        return out

    def _function(self, recipient: str) -> str | None:
        """The function a body addressed to ``recipient`` calls, when calls are asked for; else None."""
        name = recipient[len(FUNCTIONS):] if recipient.startswith(FUNCTIONS) else ""
        return name if name and self.make_call is not None else None

    def finish(self) -> HarmonyParts:
        """The end of the generation: a call whose ``<|call|>`` the engine consumed (or max_tokens cut) ends."""
        out = HarmonyParts()
        self._end_message(out)
        return out

    def _end_message(self, out: HarmonyParts) -> None:
        if self.call is None:
            return
        name, body = self.call, self.body
        self.call, self.body = None, []
        made = self.make_call(name, self.tokenizer.decode(body, skip_special_tokens=True))
        if made is None:
            out.answer.extend(body)
        else:
            out.calls.append(made)

    def _read_header(self, header: list[int]) -> tuple[str, str]:
        """(channel, recipient) of a header: the first word after ``<|channel|>``, and the word after ``to=``
        wherever it stands (``assistant to=functions.f<|channel|>commentary json`` or ``<|channel|>commentary
        to=functions.f <|constrain|>json``). Each stretch between markers is decoded alone: a marker the
        decoder drops must not glue two words together."""
        channel, recipient, segment, after_channel = "", "", [], False
        for t in [*header, self.channel_id]:  # a sentinel marker flushes the last stretch
            if t not in self.header_markers:
                segment.append(t)
                continue
            words = self.tokenizer.decode(segment, skip_special_tokens=True).split()
            if after_channel and words and not channel:
                channel = words[0]
            recipient = recipient or next((w[3:] for w in words if w.startswith("to=")), "")
            segment, after_channel = [], t == self.channel_id
        return channel, recipient


def harmony_ids(tokenizer: Tokenizer | None) -> dict[str, int | None] | None:
    """The harmony marker ids of ``tokenizer`` (CONSTRAIN, CALL, RETURN may be None), or None when it is not
    a harmony tokenizer (lacks the channel markers as tokens)."""
    if tokenizer is None:
        return None
    ids = {name: tokenizer.token_to_id(name) for name in (CHANNEL, MESSAGE, END, START, CONSTRAIN, CALL, RETURN)}
    if any(ids[name] is None for name in (CHANNEL, MESSAGE, END, START)):
        return None
    return ids


def harmony_splitter(tokenizer: Tokenizer | None, make_call=None) -> HarmonySplitter | None:
    """A splitter when ``tokenizer`` is a harmony tokenizer, else None (``make_call``: see HarmonySplitter)."""
    ids = harmony_ids(tokenizer)
    return None if ids is None else HarmonySplitter(tokenizer, ids, make_call)
