"""Text <-> token ids for the gateway and the engine (torch-free; the `tokenizers` library).

- ``Tokenizer``: loaded from a checkpoint dir (tokenizer.json + tokenizer_config.json +
  generation_config.json) or from the engine's info (the same three, as JSON text and dicts).
- ``IncrementalDetokenizer``: ids arrive one at a time while streaming; it yields text deltas that
  never split a UTF-8 character (a byte-level token can hold half of "é" or of an emoji: decoded
  alone it becomes U+FFFD, so trailing U+FFFD is held back until the next token completes it).
  The deltas concatenate to exactly ``decode(all ids)``.
- ``StopStringMatcher`` / ``find_stop``: OpenAI ``stop`` strings over the running text, holding back
  a tail that could still become a stop string, so no part of a stop string is ever streamed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
_REPLACEMENT = "\ufffd"  # what a partial UTF-8 sequence decodes to
# Encoding a 3.9 MB text left ~900 MB in malloc's free lists for good (issue 20); past this many
# characters the heap is trimmed after the encode (malloc_trim: ~1 ms, the memory goes back to the OS).
TRIM_AFTER_CHARS = 1 << 20
# A normalizer (NFC, ...) may join a few code points into one before tokenizing: the slack on
# max_token_chars that keeps ``max_token_chars`` a true bound under one.
_NORMALIZER_SLACK = 4


@functools.cache
def _malloc_trim():
    libc = ctypes.util.find_library("c")
    return getattr(ctypes.CDLL(libc), "malloc_trim", None) if libc else None  # glibc only


def trim_heap() -> None:
    """Give malloc's free memory back to the OS (glibc; a no-op elsewhere)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def _token_content(value: Any) -> str | None:
    """A special token from tokenizer_config: a string, or an AddedToken dict {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json_file(path: Path, required: bool) -> dict:
    if not path.is_file():
        if required:
            raise FileNotFoundError(f"tokenizer file missing: {path}")
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ValueError(f"corrupt tokenizer file {path}: {err}") from err
    if not isinstance(data, dict):
        raise ValueError(f"corrupt tokenizer file {path}: expected a JSON object, got {type(data).__name__}")
    return data


class Tokenizer:
    """A Hugging Face fast tokenizer plus the two configs that say how to use it.

    ``tokenizer_config`` carries the chat template and the special tokens (bos/eos/pad);
    ``generation_config`` carries the ids that end generation (``eos_token_id``).
    """

    def __init__(self, backend: _HFTokenizer, tokenizer_config: dict | None = None,
                 generation_config: dict | None = None, source: str = "<memory>"):
        self.backend = backend
        self.tokenizer_config = dict(tokenizer_config or {})
        self.generation_config = dict(generation_config or {})
        self.source = source
        self.eos_token_ids = self._eos_token_ids()

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def from_dir(cls, directory: str | Path) -> "Tokenizer":
        """Load ``directory``/tokenizer.json (required), tokenizer_config.json and generation_config.json
        (optional). A missing or corrupt file raises an error that names it."""
        d = Path(directory)
        path = d / TOKENIZER_FILE
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file missing: {path} (a checkpoint needs tokenizer.json)")
        try:
            backend = _HFTokenizer.from_file(str(path))
        except Exception as err:  # the Rust side raises a bare Exception on bad JSON / bad model
            raise ValueError(f"corrupt tokenizer file {path}: {err}") from err
        return cls(backend, _read_json_file(d / TOKENIZER_CONFIG_FILE, required=False),
                   _read_json_file(d / GENERATION_CONFIG_FILE, required=False), source=str(d))

    @classmethod
    def from_json(cls, tokenizer_json: str, tokenizer_config: dict | None = None,
                  generation_config: dict | None = None, source: str = "engine info") -> "Tokenizer":
        """Build from tokenizer.json's text and the two config dicts (what the engine's info returns)."""
        try:
            backend = _HFTokenizer.from_str(tokenizer_json)
        except Exception as err:
            raise ValueError(f"corrupt tokenizer.json from {source}: {err}") from err
        return cls(backend, tokenizer_config, generation_config, source=source)

    @classmethod
    def from_info(cls, info: dict) -> "Tokenizer":
        """Build from the engine's GET /engine/v1/info body (keys tokenizer_json, tokenizer_config,
        generation_config)."""
        if not info.get("tokenizer_json"):
            raise ValueError("engine info has no tokenizer_json (the engine's model dir lacks tokenizer.json)")
        return cls.from_json(info["tokenizer_json"], info.get("tokenizer_config"), info.get("generation_config"),
                             source=f"engine info of {info.get('model_id', '?')}")

    # ---- text <-> ids -------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``. Special-token strings in the text (e.g. "<|im_start|>" written by a
        chat template) become their single ids; ``add_special_tokens`` adds the post-processor's
        tokens (BOS for some models), off by default as prompts from chat templates carry their own.

        Through ``encode_batch_fast``: unlike ``encode`` it releases the GIL (a thread encoding a long
        prompt no longer stalls an event loop: measured 3 vs 800 loop ticks over an 8 s encode) and
        skips the offsets (a third less memory); the ids are the same."""
        ids = self.backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids
        if len(text) >= TRIM_AFTER_CHARS:
            trim_heap()
        return ids

    @functools.cached_property
    def max_token_chars(self) -> int:
        """At most this many characters of text become one token (the longest vocabulary entry, or
        added token, times a slack when a normalizer may shorten the text first): a text of N
        characters has at least N / max_token_chars tokens, known before tokenizing it."""
        longest = max((len(t) for t in self.backend.get_vocab(with_added_tokens=True)), default=1)
        return max(1, longest) * (1 if self.backend.normalizer is None else _NORMALIZER_SLACK)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids`` (partial UTF-8 sequences become U+FFFD)."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Any], add_generation_prompt: bool = True, **kwargs: Any) -> list[int]:
        """Prompt ids of a chat: ``render_chat`` with this tokenizer's config, then ``encode`` (no
        added special tokens, as transformers' ``apply_chat_template(tokenize=True)``).
        Raises ChatTemplateError (a ValueError) as ``render_chat`` does."""
        from services.common.chat_template import render_chat

        return self.encode(render_chat(self.tokenizer_config, messages, add_generation_prompt, **kwargs))

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows (added tokens included)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def special_token(self, name: str) -> str | None:
        """A named special token of tokenizer_config ("bos_token", "eos_token", "pad_token", ...)."""
        return _token_content(self.tokenizer_config.get(name))

    def _eos_token_ids(self) -> list[int]:
        """generation_config eos_token_id (int or list); else tokenizer_config's eos_token."""
        raw = self.generation_config.get("eos_token_id")
        ids = [raw] if isinstance(raw, int) else [i for i in (raw or []) if isinstance(i, int)]
        if not ids:
            eos = self.special_token("eos_token")
            eos_id = self.token_to_id(eos) if eos else None
            ids = [eos_id] if eos_id is not None else []
        return list(dict.fromkeys(ids))  # dedupe, keep order

    def detokenizer(self, skip_special_tokens: bool = True) -> "IncrementalDetokenizer":
        """A fresh streaming detokenizer over this tokenizer."""
        return IncrementalDetokenizer(self, skip_special_tokens=skip_special_tokens)

    def __repr__(self) -> str:
        return f"Tokenizer(source={self.source!r}, vocab_size={self.vocab_size}, eos_token_ids={self.eos_token_ids})"


class IncrementalDetokenizer:
    """Streaming ids -> text deltas (the prefix/read-offset scheme of vLLM's detokenizer).

    Each step decodes only a short window: ``ids[prefix:]`` minus ``ids[prefix:read]``, so the cost
    per token is O(window), not O(sequence). Decoding from ``prefix`` (not from ``read``) keeps
    decoders that treat the first token specially (SentencePiece's leading space) consistent.
    A window that ends in U+FFFD is an incomplete character: nothing is emitted and ``read`` stays.
    ``finish()`` flushes what is held back (a truly invalid byte sequence then shows as U+FFFD).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""         # everything emitted so far
        self._prefix = 0       # window start
        self._read = 0         # ids before this are emitted

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Feed one id; return the new text (possibly "")."""
        self.ids.append(int(token_id))
        prefix_text = self._decode(self.ids[self._prefix:self._read])
        new_text = self._decode(self.ids[self._prefix:])
        if new_text.endswith(_REPLACEMENT) or not new_text.startswith(prefix_text):
            return ""  # an incomplete character (or a decoder that rewrites the window): wait
        delta = new_text[len(prefix_text):]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += delta
        return delta

    def add_many(self, token_ids: Iterable[int]) -> str:
        """Feed several ids; return their combined delta."""
        return "".join(self.add(t) for t in token_ids)

    def finish(self) -> str:
        """End of stream: return the held-back rest, so that ``text == decode(ids)``."""
        full = self._decode(self.ids)
        if not full.startswith(self.text):
            # Only a decoder whose output depends on far context could get here; never re-emit.
            return ""
        delta = full[len(self.text):]
        self.text = full
        self._prefix = self._read = len(self.ids)
        return delta


# ---------------------------------------------------------------------------------------------
# Stop strings
# ---------------------------------------------------------------------------------------------


def find_stop(text: str, stop: Sequence[str], start: int = 0) -> tuple[int, str] | None:
    """The earliest stop string in ``text[start:]``: (index in text, the stop string), or None."""
    best: tuple[int, str] | None = None
    for s in stop:
        if not s:
            continue
        i = text.find(s, start)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return best


def partial_stop_start(text: str, stop: Sequence[str], start: int = 0) -> int:
    """Where the longest tail of ``text[start:]`` that is a proper prefix of a stop string begins
    (``len(text)`` when none): text from there on must be held back while streaming."""
    hold = len(text)
    for s in stop:
        for k in range(min(len(s) - 1, len(text) - start), 0, -1):
            if text.endswith(s[:k]):
                hold = min(hold, len(text) - k)
                break
    return hold


def apply_stop_strings(text: str, emitted: int, stop: Sequence[str], final: bool = False) -> tuple[str, bool]:
    """Text to stream now under stop strings.

    ``text`` is all text generated so far, ``emitted`` how many characters of it were already
    streamed (never part of a stop string). Returns (what to emit now, stopped): on a stop, the text
    up to the earliest stop string (excluded) and True; otherwise everything but a tail that may
    still grow into a stop string (``final=True``: the stream ended, emit it all).
    """
    hit = find_stop(text, stop, emitted)
    if hit is not None:
        return text[emitted:hit[0]], True
    end = len(text) if final else max(emitted, partial_stop_start(text, stop, emitted))
    return text[emitted:end], False


class StopStringMatcher:
    """Stateful wrapper of ``apply_stop_strings`` for one stream: feed deltas, get what to emit."""

    def __init__(self, stop: Sequence[str] | None):
        self.stop = [s for s in (stop or []) if s]
        self.text = ""
        self.emitted = 0
        self.stopped = False
        self.stop_string: str | None = None  # the stop string that matched

    def feed(self, delta: str) -> tuple[str, bool]:
        """Add generated text; return (text to emit now, whether a stop string matched)."""
        if self.stopped:
            return "", True
        self.text += delta
        out, self.stopped = apply_stop_strings(self.text, self.emitted, self.stop)
        self.emitted += len(out)
        if self.stopped:
            hit = find_stop(self.text, self.stop, self.emitted)
            self.stop_string = hit[1] if hit else None
        return out, self.stopped

    def flush(self) -> str:
        """The stream ended without a stop: the held-back tail."""
        if self.stopped:
            return ""
        out, _ = apply_stop_strings(self.text, self.emitted, self.stop, final=True)
        self.emitted += len(out)
        return out
