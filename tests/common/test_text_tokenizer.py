"""Tokenizer, streaming detokenizer and stop strings (services/common/tokenizer.py).

References are independent of the code under test: the `tokenizers` library's own full decode,
and transformers' AutoTokenizer for encoding."""

from __future__ import annotations

import json
import random

import pytest

from services.common.tokenizer import (IncrementalDetokenizer, StopStringMatcher, Tokenizer, apply_stop_strings,
                                       find_stop)
from services.engine.models.demo import write_tokenizer_files

TEXTS = [
    "Hello, world!",
    "The café served crème brûlée.",
    "中文字符和标点。",
    "emoji 😀🎉 and 👩‍👩‍👧 family",
    "mixed: naïve 日本語 ∑ ∫ 🚀\nnew line\ttab  two spaces",
    "",
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    write_tokenizer_files(d)
    return d


@pytest.fixture(scope="module")
def tok(tok_dir):
    return Tokenizer.from_dir(tok_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text


def test_encode_matches_transformers(tok, tok_dir):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tok_dir))
    for text in TEXTS + ["<|im_start|>user\nHi<|im_end|>\n"]:
        assert tok.encode(text) == hf.encode(text, add_special_tokens=False), text


def test_special_tokens_and_eos(tok, tok_dir):
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == tok.token_to_id("<|im_start|>") and ids[-1] == tok.token_to_id("<|im_end|>")
    gen = json.loads((tok_dir / "generation_config.json").read_text())
    assert tok.eos_token_ids == gen["eos_token_id"]
    assert tok.eos_token_ids == [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]


def test_eos_falls_back_to_tokenizer_config(tok_dir):
    text = (tok_dir / "tokenizer.json").read_text()
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    t = Tokenizer.from_json(text, config, {})
    assert t.eos_token_ids == [t.token_to_id("<|im_end|>")]
    t = Tokenizer.from_json(text, config, {"eos_token_id": 1})
    assert t.eos_token_ids == [1]


def test_from_info_equals_from_dir(tok, tok_dir):
    info = {
        "model_id": "demo",
        "tokenizer_json": (tok_dir / "tokenizer.json").read_text(),
        "tokenizer_config": json.loads((tok_dir / "tokenizer_config.json").read_text()),
        "generation_config": json.loads((tok_dir / "generation_config.json").read_text()),
    }
    t = Tokenizer.from_info(info)
    for text in TEXTS:
        assert t.encode(text) == tok.encode(text)
    assert t.eos_token_ids == tok.eos_token_ids
    with pytest.raises(ValueError, match="tokenizer_json"):
        Tokenizer.from_info({"model_id": "x"})


def test_missing_tokenizer_names_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)


def test_corrupt_tokenizer_names_file(tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    with pytest.raises(ValueError, match=str(tmp_path / "tokenizer.json").replace("\\", "\\\\")):
        Tokenizer.from_dir(tmp_path)


def test_corrupt_config_names_file(tmp_path, tok_dir):
    write_tokenizer_files(tmp_path)
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="generation_config.json"):
        Tokenizer.from_dir(tmp_path)


def _stream(tok, ids, skip_special_tokens):
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens)
    deltas = [detok.add(i) for i in ids]
    deltas.append(detok.finish())
    return deltas


@pytest.mark.parametrize("text", TEXTS)
def test_detokenizer_never_splits_characters(tok, text):
    ids = tok.encode(text)
    deltas = _stream(tok, ids, skip_special_tokens=False)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)  # each delta is whole characters
    # Multi-byte characters span several byte-level tokens here, so some steps must hold back.
    if any(ord(c) > 0x7FF for c in text):
        assert "" in deltas[:-1]


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("skip", [False, True])
def test_detokenizer_random_ids(tok, seed, skip):
    rng = random.Random(seed)
    ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 80))]
    deltas = _stream(tok, ids, skip_special_tokens=skip)
    assert "".join(deltas) == tok.backend.decode(ids, skip_special_tokens=skip)


def test_detokenizer_skips_specials(tok):
    ids = tok.encode("<|im_start|>assistant\nbonjour 😀<|im_end|>")
    assert "".join(_stream(tok, ids, skip_special_tokens=True)) == "assistant\nbonjour 😀"


def test_find_stop_earliest():
    assert find_stop("abc STOP def END", ["END", "STOP"]) == (4, "STOP")
    assert find_stop("abc", ["x", ""]) is None


def test_apply_stop_strings_holds_partial_prefix():
    assert apply_stop_strings("Hello ST", 0, ["STOP"]) == ("Hello ", False)
    assert apply_stop_strings("Hello ST", 0, ["STOP"], final=True) == ("Hello ST", False)
    assert apply_stop_strings("Hello STOP more", 0, ["STOP"]) == ("Hello ", True)
    assert apply_stop_strings("Hello STX", 6, ["STOP"]) == ("STX", False)


@pytest.mark.parametrize("stop", [["\n\n"], ["END"], ["中文"], ["😀x"], ["a", "bcd"]])
def test_stop_across_token_boundaries(tok, stop):
    """Stream a text token by token through the detokenizer and the matcher: the emitted text is the
    text before the earliest stop string, whatever the token boundaries."""
    text = "Once upon a time\n\nthere was a bcd END of 中文 and 😀x tail"
    ids = tok.encode(text)
    detok, matcher = IncrementalDetokenizer(tok), StopStringMatcher(stop)
    out, stopped = [], False
    for i in ids:
        piece, stopped = matcher.feed(detok.add(i))
        out.append(piece)
        # never a whole stop string nor text after it in what was emitted
        assert not any(s in "".join(out) for s in stop)
        if stopped:
            break
    if not stopped:
        piece, stopped = matcher.feed(detok.finish())
        out.append(piece)
        out.append(matcher.flush())
    expected_at = min(text.find(s) for s in stop if s in text)
    assert stopped
    assert "".join(out) == text[:expected_at]
    assert len(ids) > len(text.split())  # the text is really several tokens


def test_stop_matcher_flush_without_stop():
    m = StopStringMatcher(["STOP"])
    assert m.feed("abc S") == ("abc ", False)
    assert m.feed("T") == ("", False)
    assert m.flush() == "ST"


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return int(f.read().split("VmRSS:")[1].split()[0]) / 1024


def test_long_encode_leaves_the_gil_and_its_memory(tok):
    """A 1.5 M-character prompt (issue 20: a 3.9 MB chat froze the gateway and kept ~900 MB): while a
    worker thread encodes it, the calling thread keeps running (the event loop in the gateway), and
    the memory the encode used goes back to the OS."""
    import threading
    import time

    text = "The quick brown fox jumps over the lazy dog. " * 33_400  # 1.5 M characters, > TRIM_AFTER_CHARS
    baseline = _rss_mb()
    result: list[int] = []
    worker = threading.Thread(target=lambda: result.extend(tok.encode(text)))
    worker.start()
    turns = 0
    while worker.is_alive():  # each turn needs the GIL: a GIL-holding encode allows ~1 turn in all
        time.sleep(0.002)
        turns += 1
    worker.join()
    assert turns >= 20, f"the calling thread ran {turns} times during the encode: the GIL was held"
    count = len(result)
    result.clear()
    grown = _rss_mb() - baseline
    assert grown < 64, f"the encode left {grown:.0f} MB with the process"
    assert count == len(tok.backend.encode(text).ids) > 300_000  # reference: the library's own encode
