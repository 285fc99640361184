"""The tokenizer of a GGUF file: ``tokenizer.ggml.*`` metadata -> tokenizer.json, tokenizer_config.json and
generation_config.json (what the engine and the gateway read from a checkpoint directory).

Two kinds, built like transformers' GGUF converter (integrations/gguf/gguf_tokenizer_mapping.py) with the
``tokenizers`` library alone (transformers is not an engine dependency):
- byte-level BPE (``tokenizer.ggml.model == "gpt2"``: Qwen, gpt-oss, Llama 3, ...; byte_level_tokenizer,
  set_split_regex): the vocabulary and merges as stored, the pre-tokenizer split of ``tokenizer.ggml.pre``
  (llama.cpp's name for the regex the merges were learned with);
- SentencePiece BPE (``"llama"``: Mixtral, Mistral, Llama 2; sentencepiece_tokenizer + LlamaTokenizer): the
  vocabulary with byte fallback, the merges recovered from the token scores (transformers'
  generate_merges), Metaspace ("▁", prefixed to the first word).
In both, tokens of type CONTROL (3) are added as special tokens and USER_DEFINED (4) as plain added tokens
(``<think>``), as add_gguf_special_tokens does. The tests check the ids against transformers' own GGUF
tokenizer.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from services.engine.models.errors import LoaderError
from services.engine.models.gguf_reader import GGUFFile

CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types

_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                r"|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> the split regex before byte-level mapping (None: GPT-2's own, inside ByteLevel)
# ("gpt-2" is llama.cpp's name for GPT-2's regex; "gpt2" accepted too)
PRE_SPLITS: dict[str, str | None] = {"default": None, "gpt-2": None, "gpt2": None, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
                                     "llama3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "gpt-4o": _GPT4O_SPLIT}
NFC_PRES = ("qwen2", "deepseek-r1-qwen")  # Qwen2's tokenizer.json normalizes to NFC first


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the alphabet byte-level vocabularies are spelled in)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _added(tokens: list[str], types: list[int], keep=lambda t: True) -> list[dict]:
    """CONTROL tokens as special added tokens, USER_DEFINED ones as plain added tokens."""
    return [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
             "special": ty == CONTROL}
            for i, (t, ty) in enumerate(zip(tokens, types)) if (ty == CONTROL and keep(t)) or ty == USER_DEFINED]


def _spm_merges(vocab: dict[str, int], scores: dict[str, float]) -> list[list[str]]:
    """The merges a SentencePiece BPE vocabulary implies (transformers' generate_merges): every split of a
    token into two vocabulary tokens, the higher-scored merged token first."""
    merges = []
    for token, score in scores.items():
        local = [(token[:k], token[k:], score) for k in range(1, len(token))
                 if token[:k] in vocab and token[k:] in vocab]
        merges.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [[a, b] for a, b, _ in merges]


def _spm_doc(f: GGUFFile, tokens: list[str], types: list[int]) -> dict:
    vocab = {t: i for i, t in enumerate(tokens)}
    scores = f.get("tokenizer.ggml.scores", None) or [0.0] * len(tokens)
    unk = f.get("tokenizer.ggml.unknown_token_id", None)
    metaspace = {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first", "split": False}
    return {
        "normalizer": None, "pre_tokenizer": metaspace, "post_processor": None,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "}, {"type": "ByteFallback"},
            {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "added_tokens": _added(tokens, types),
        "model": {"type": "BPE", "dropout": None, "unk_token": tokens[unk] if unk is not None else None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None, "fuse_unk": True,
                  "byte_fallback": True, "ignore_merges": False, "vocab": vocab,
                  "merges": _spm_merges(vocab, dict(zip(tokens, scores)))},
    }


def tokenizer_json(f: GGUFFile) -> str:
    """tokenizer.json text of the file's tokenizer (LoaderError for a kind that is not supported or a
    pre-tokenizer that is unknown)."""
    model = f.get("tokenizer.ggml.model", None)
    if model not in ("gpt2", "llama"):
        raise LoaderError(f"{f.path}: tokenizer.ggml.model {model!r} is not supported (supported: 'gpt2', "
                          "byte-level BPE; 'llama', SentencePiece BPE)")
    tokens = f.get("tokenizer.ggml.tokens")
    types = f.get("tokenizer.ggml.token_type", None) or [1] * len(tokens)
    if model == "llama":
        return json.dumps({"version": "1.0", "truncation": None, "padding": None, **_spm_doc(f, tokens, types)},
                          ensure_ascii=False)
    pre = f.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_SPLITS:
        raise LoaderError(f"{f.path}: tokenizer.ggml.pre {pre!r} is not supported (supported: {', '.join(PRE_SPLITS)})")
    spell = _bytes_to_unicode()
    alphabet = set(spell.values())
    vocab = {t if set(t) <= alphabet else "".join(spell[b] for b in t.encode("utf-8")): i for i, t in enumerate(tokens)}
    # a CONTROL token outside the byte alphabet is a llama.cpp mislabel (transformers skips it too)
    added = _added(tokens, types, keep=lambda t: set(t) <= alphabet)
    split = PRE_SPLITS[pre]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": split is None}
    pre_tok = byte_level if split is None else {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": split}, "behavior": "Isolated", "invert": False}, byte_level]}
    doc = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": {"type": "NFC"} if pre in NFC_PRES else None,
        "pre_tokenizer": pre_tok,
        "post_processor": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": [m.split(" ", 1) for m in f.get("tokenizer.ggml.merges")]},
    }
    return json.dumps(doc, ensure_ascii=False)


def tokenizer_configs(f: GGUFFile) -> tuple[dict, dict]:
    """(tokenizer_config, generation_config) dicts: the chat template and the named special tokens; the ids
    that end generation (eos, and eot where the file gives one)."""
    tokens = f.get("tokenizer.ggml.tokens")

    def token(key: str) -> str | None:
        i = f.get(f"tokenizer.ggml.{key}", None)
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
              "add_bos_token": bool(f.get("tokenizer.ggml.add_bos_token", False))}
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("unk_token", "unknown_token_id"),
                      ("pad_token", "padding_token_id")):
        if token(key) is not None:
            config[name] = token(key)
    template = f.get("tokenizer.chat_template", None)
    if template:
        config["chat_template"] = template
    eos = [f.get(f"tokenizer.ggml.{k}", None) for k in ("eos_token_id", "eot_token_id", "eom_token_id")]
    generation = {"eos_token_id": list(dict.fromkeys(i for i in eos if i is not None))}
    for name in ("bos_token_id", "padding_token_id"):
        if f.get(f"tokenizer.ggml.{name}", None) is not None:
            generation[name.replace("padding", "pad")] = f.get(f"tokenizer.ggml.{name}")
    return config, generation


def write_tokenizer_files(f: GGUFFile, directory: Path) -> None:
    """The three files into ``directory`` (created)."""
    from tokenizers import Tokenizer

    text = tokenizer_json(f)
    try:
        Tokenizer.from_str(text)
    except Exception as e:  # noqa: BLE001 - the Rust side raises a bare Exception
        raise LoaderError(f"{f.path}: the tokenizer in its metadata does not build ({e})") from e
    config, generation = tokenizer_configs(f)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(text, encoding="utf-8")
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2), encoding="utf-8")


def tokenizer_dir(f: GGUFFile, root: Path) -> Path:
    """A directory under ``root`` with the file's tokenizer files, written once per file version (keyed by
    its path, size and mtime; written to a temporary name, then renamed: concurrent starts agree)."""
    st = f.paths[0].stat()
    key = hashlib.sha256(f"{f.paths[0].resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    d = root / f"gguf-tokenizer-{key}"
    if (d / "generation_config.json").is_file():
        return d
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".gguf-tokenizer.tmp-", dir=root))
    try:
        write_tokenizer_files(f, tmp)
        os.rename(tmp, d)
    except OSError:  # another process won the race
        shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return d
