"""Reasoning apart from the answer for harmony models (gpt-oss): ``reasoning_content``, as vLLM returns it.

A harmony reply is a run of messages, each ``[<|start|>ROLE]<|channel|>NAME[ ...]<|message|>TEXT`` ended by
``<|end|>`` (more follows), ``<|return|>`` / ``<|call|>`` (generation stops). The chat template's
generation prompt ends with ``<|start|>assistant``, so a reply begins at ``<|channel|>``. Text of the
``analysis`` channel is reasoning; every other channel's text (``final``, tool ``commentary``) is the answer.
The split works on token ids (the markers are special tokens, which the detokenizer drops), so it streams:
``feed`` takes each engine delta's ids and returns (reasoning ids, answer ids), which the caller
detokenizes as two texts.
"""

from __future__ import annotations

from services.common.tokenizer import Tokenizer

CHANNEL, MESSAGE, END, START = "<|channel|>", "<|message|>", "<|end|>", "<|start|>"
REASONING_CHANNEL = "analysis"


class HarmonySplitter:
    def __init__(self, tokenizer: Tokenizer, ids: dict[str, int]) -> None:
        self.tokenizer = tokenizer
        self.channel_id, self.message_id = ids[CHANNEL], ids[MESSAGE]
        self.header_ends = {ids[END], ids[START]}  # a message ends / the next one's header starts
        self.in_header = True  # a reply starts inside the first message's header
        self.header: list[int] = []
        self.channel = ""

    def feed(self, ids: list[int]) -> tuple[list[int], list[int]]:
        """One delta's token ids -> (reasoning ids, answer ids); header and marker tokens go to neither."""
        reasoning: list[int] = []
        answer: list[int] = []
        for t in ids:
            if t in self.header_ends or t == self.channel_id:
                self.in_header, self.header = True, [t]
            elif t == self.message_id and self.in_header:
                self.channel = self._channel_of(self.header)
                self.in_header, self.header = False, []
            elif self.in_header:
                self.header.append(t)
            else:
                (reasoning if self.channel == REASONING_CHANNEL else answer).append(t)
        return reasoning, answer

    def _channel_of(self, header: list[int]) -> str:
        """The channel named after ``<|channel|>`` in a header (``analysis``, ``final``, ``commentary to=...``)."""
        if self.channel_id not in header:
            return ""
        after = header[len(header) - header[::-1].index(self.channel_id):]
        words = self.tokenizer.decode(after, skip_special_tokens=True).split()
        return words[0] if words else ""


def harmony_splitter(tokenizer: Tokenizer | None) -> HarmonySplitter | None:
    """A splitter when ``tokenizer`` is a harmony tokenizer (has the channel markers as tokens), else None."""
    if tokenizer is None:
        return None
    ids = {name: tokenizer.token_to_id(name) for name in (CHANNEL, MESSAGE, END, START)}
    if any(i is None for i in ids.values()):
        return None
    return HarmonySplitter(tokenizer, ids)
