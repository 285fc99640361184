"""The demo checkpoint: a small Qwen3-MoE model with random weights, in the Hugging Face layout.

`tandem model demo DIR [--seed N]` writes it; `--model demo` uses `ensure_demo_checkpoint()`, which
writes it once into TANDEM_DEMO_DIR (default $XDG_CACHE_HOME/tandem/demo) and reuses it afterwards.

Files (the same set a Hub checkpoint has, tensor names as published for Qwen3-MoE, per expert):
    config.json               model_type qwen3_moe, L=4 layers, E=16 experts, A=4 active, D=128
    model.safetensors         random weights (fp32), written with the safetensors library
    tokenizer.json            byte-level BPE trained on the little English text below (tokenizers)
    tokenizer_config.json     ChatML chat_template (Qwen's shape), bos/eos/pad tokens
    generation_config.json    eos ids [<|im_end|>, <|endoftext|>], Qwen's sampling defaults
    tandem_demo.json          marker written last: a dir without it is incomplete

Everything is deterministic for a seed (same seed -> byte-identical files) and written atomically:
the files are built in a temp dir beside DIR and renamed into place, so an interrupted write never
leaves a half-written checkpoint that looks complete.
"""

from __future__ import annotations

import argparse
import fcntl
import functools
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from services.common.logging import get_logger, setup_logging
from services.common.settings import env

log = get_logger("demo")

DEMO_VERSION = 1  # bump when the files change shape; an older cached demo is then rewritten
MARKER = "tandem_demo.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
CHECKPOINT_FILES = ("config.json", "model.safetensors", *TOKENIZER_FILES)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2
BPE_VOCAB_SIZE = 1000  # the trainer's target; the text is small, merges stop earlier if they run out

# Geometry of the demo model (a tiny Qwen3-30B-A3B: same structure, toy sizes).
GEOMETRY = dict(
    num_hidden_layers=4,        # L
    num_experts=16,             # E
    num_experts_per_tok=4,      # A
    hidden_size=128,            # D
    moe_intermediate_size=64,   # I
    intermediate_size=256,      # dense MLP width (only used by mlp_only_layers, none here)
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
)

# Qwen2.5's ChatML template (system/user/assistant/tool turns, tools block, add_generation_prompt),
# without the default "You are Qwen" system prompt.
CHAT_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] + '\\n\\n' }}\n"
    "    {%- endif %}\n"
    "    {{- \"# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n"
    "        {{- \"\\n\" }}\n"
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, "
    "\\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n"
    "{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or "
    "(message.role == \"assistant\" and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n"
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n"
    "            {%- endif %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n"
    "            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n"
    "            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n"
    "        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- elif not (message.role == \"system\" and loop.first) %}\n"
    "        {{- raise_exception('Unsupported message role: ' + message.role) }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

# The tokenizer's training text: a little plain English (plus a few accented words) so common
# words become single tokens and decoded random ids look like text fragments.
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A mixture of experts model routes every token to a few
experts out of many. Each expert is a small feed forward network, and the router picks the best ones.
When the model does not fit in the memory of the graphics card, the experts stay in the host memory and
are copied over the bus when they are needed, or computed in place by the processor.
Hello! How are you today? I am fine, thank you. What would you like to know about the weather, the
city, the river or the mountains? The sun is bright and the sky is blue; the wind is cold in winter.
Once upon a time there was a little house at the edge of a forest. In the house lived an old man, his
daughter and a cat. Every morning the daughter walked to the market to sell bread, milk and apples.
One day she met a traveller who asked the way to the castle on the hill. "Follow the road," she said,
"and turn left at the old bridge." The traveller thanked her and gave her a silver coin.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024. Questions and answers, lists and tables, code and data.
def add(a, b):
    return a + b
The café served crème brûlée and a naïve résumé was left on the table. This is the end of the text.
"""


@functools.lru_cache(maxsize=1)
def _tokenizer_json() -> str:
    """Train the byte-level BPE once per process (~0.1 s) and return its tokenizer.json text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable: no unknown tokens
        show_progress=False,
    )
    # Several copies so pairs that occur once in the text still reach min_frequency.
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    return tok.to_str(pretty=True)


def _vocab_size(tokenizer_json: str) -> int:
    """Embedding rows: the tokenizer's size rounded up to a multiple of 128 (as Hub models pad)."""
    from tokenizers import Tokenizer

    n = Tokenizer.from_str(tokenizer_json).get_vocab_size(with_added_tokens=True)
    return -(-n // 128) * 128


def _token_ids() -> dict[str, int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(_tokenizer_json())
    return {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}


def _tokenizer_config() -> dict:
    ids = _token_ids()
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(ids[t]): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                          "single_word": False, "special": True}
            for t in SPECIAL_TOKENS
        },
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 4096,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def _generation_config() -> dict:
    ids = _token_ids()
    return {
        "bos_token_id": ids["<|endoftext|>"],
        "do_sample": True,
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"],
        "temperature": 0.7,
        "top_k": 20,
        "top_p": 0.8,
    }


def _model_config() -> dict:
    ids = _token_ids()
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        **GEOMETRY,
        "vocab_size": _vocab_size(_tokenizer_json()),
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "sliding_window": None,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "torch_dtype": "float32",
    }


def _dump(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False, sort_keys=False) + "\n", encoding="utf-8")


def write_tokenizer_files(directory: str | Path) -> None:
    """Write tokenizer.json, tokenizer_config.json and generation_config.json of the demo tokenizer
    into ``directory`` (created if needed). Synthetic models use this for their model_dir."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / "tokenizer.json").write_text(_tokenizer_json() + "\n", encoding="utf-8")
    _dump(d / "tokenizer_config.json", _tokenizer_config())
    _dump(d / "generation_config.json", _generation_config())


def _random_weights(config: dict, seed: int) -> dict:
    """The Qwen3-MoE state dict with the Hub's per-expert names; N(0, 0.02) matrices, unit norms."""
    import torch

    g = torch.Generator().manual_seed(seed)
    D, I, E = config["hidden_size"], config["moe_intermediate_size"], config["num_experts"]
    V, Dh = config["vocab_size"], config["head_dim"]
    Hq, Hkv = config["num_attention_heads"], config["num_key_value_heads"]

    def randn(*shape: int) -> "torch.Tensor":
        return (torch.randn(*shape, generator=g, dtype=torch.float32) * config["initializer_range"]).contiguous()

    def ones(n: int) -> "torch.Tensor":
        return torch.ones(n, dtype=torch.float32)

    sd = {"model.embed_tokens.weight": randn(V, D)}  # [V, D]
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        sd[p + "input_layernorm.weight"] = ones(D)
        sd[p + "self_attn.q_proj.weight"] = randn(Hq * Dh, D)
        sd[p + "self_attn.k_proj.weight"] = randn(Hkv * Dh, D)
        sd[p + "self_attn.v_proj.weight"] = randn(Hkv * Dh, D)
        sd[p + "self_attn.o_proj.weight"] = randn(D, Hq * Dh)
        sd[p + "self_attn.q_norm.weight"] = ones(Dh)
        sd[p + "self_attn.k_norm.weight"] = ones(Dh)
        sd[p + "post_attention_layernorm.weight"] = ones(D)
        # Router with a larger scale than 0.02 so routing is clearly token-dependent, not near-uniform.
        sd[p + "mlp.gate.weight"] = randn(E, D) * 10  # [E, D]
        for e in range(E):
            q = f"{p}mlp.experts.{e}."
            sd[q + "gate_proj.weight"] = randn(I, D)  # [I, D]
            sd[q + "up_proj.weight"] = randn(I, D)    # [I, D]
            sd[q + "down_proj.weight"] = randn(D, I)  # [D, I]
    sd["model.norm.weight"] = ones(D)
    sd["lm_head.weight"] = randn(V, D)  # [V, D]
    return sd


def _write_into(directory: Path, seed: int) -> None:
    """All files of the checkpoint into an existing (empty) ``directory``; the marker last."""
    from safetensors.torch import save_file

    config = _model_config()
    _dump(directory / "config.json", config)
    save_file(_random_weights(config, seed), str(directory / "model.safetensors"), metadata={"format": "pt"})
    write_tokenizer_files(directory)
    _dump(directory / MARKER, {"version": DEMO_VERSION, "seed": seed})
    # mkdtemp makes the dir 0700 and safetensors the file 0600: make the checkpoint readable like
    # any other written dir (containers may serve it as another user).
    directory.chmod(0o755)
    for path in directory.iterdir():
        path.chmod(0o644)


def is_complete(directory: str | Path, seed: int | None = None) -> bool:
    """True when ``directory`` holds a fully written demo checkpoint (of ``seed``, when given)."""
    d = Path(directory)
    try:
        marker = json.loads((d / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if marker.get("version") != DEMO_VERSION or (seed is not None and marker.get("seed") != seed):
        return False
    return all((d / name).is_file() for name in CHECKPOINT_FILES)


def _remove_stale_temps(target: Path, max_age_s: float = 3600.0) -> None:
    """Temp dirs of writers killed hard (SIGKILL, power loss) are removed once clearly abandoned."""
    now = time.time()
    for tmp in target.parent.glob(f".{target.name}.tmp-*"):
        try:
            if tmp.is_dir() and now - tmp.stat().st_mtime > max_age_s:
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError:
            pass  # another writer removed it first


def write_demo_checkpoint(directory: str | Path, seed: int = 0) -> Path:
    """Write the demo checkpoint into ``directory`` atomically and return its path.

    Built in a temp dir beside ``directory``; a missing (or empty) target is replaced by one rename.
    An existing non-empty target gets each file moved in with ``os.replace`` (the marker last), so
    other files there survive and no temp dir is left behind, even when the write fails.
    """
    target = Path(directory).absolute()
    if target.exists() and not target.is_dir():
        raise NotADirectoryError(f"demo checkpoint target {target} exists and is not a directory")
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        _write_into(tmp, seed)
        if target.is_dir() and not any(target.iterdir()):
            target.rmdir()
        try:
            os.rename(tmp, target)  # atomic when target does not exist
        except OSError:
            if not target.is_dir():
                raise
            (target / MARKER).unlink(missing_ok=True)  # incomplete until the new marker lands
            for name in (*CHECKPOINT_FILES, MARKER):
                os.replace(tmp / name, target / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def default_demo_dir() -> Path:
    """TANDEM_DEMO_DIR, or $XDG_CACHE_HOME/tandem/demo (~/.cache/tandem/demo)."""
    configured = env("TANDEM_DEMO_DIR")
    if configured:
        return Path(configured).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "tandem" / "demo"


def ensure_demo_checkpoint(seed: int = 0) -> Path:
    """The demo checkpoint dir, written on first use (see ``default_demo_dir``) and reused after.
    Seed 0 lives in that dir, another seed N beside it in ``<dir>-seedN`` (engines with different
    seeds never rewrite each other's checkpoint)."""
    target = default_demo_dir()
    if seed:
        target = target.with_name(f"{target.name}-seed{seed}")
    if is_complete(target, seed):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Gateway, engine and test workers may start together: one writes, the others wait and reuse.
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not is_complete(target, seed):
            log.info("writing the demo checkpoint (seed %d) to %s", seed, target)
            write_demo_checkpoint(target, seed)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tandem model demo",
        description="Write the small demo MoE checkpoint (qwen3_moe, 4 layers, 16 experts, top-4, hidden 128, "
                    "random weights) in the Hugging Face layout: config.json, model.safetensors, tokenizer.json, "
                    "tokenizer_config.json (ChatML chat template), generation_config.json. Serve it with "
                    "`tandem serve --model DIR`.",
    )
    parser.add_argument("dir", metavar="DIR", help="output directory (created if missing; existing demo files "
                        "in it are replaced atomically, other files are left alone)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the random weights; the same seed writes byte-identical files (default 0)")
    args = parser.parse_args(argv)
    setup_logging()
    try:
        path = write_demo_checkpoint(args.dir, args.seed)
    except OSError as err:
        print(f"tandem model demo: cannot write {args.dir}: {err}", file=sys.stderr)
        return 1
    config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    print(f"wrote demo checkpoint to {path} (qwen3_moe: {config['num_hidden_layers']} layers, "
          f"{config['num_experts']} experts, top-{config['num_experts_per_tok']}, hidden {config['hidden_size']}, "
          f"vocab {config['vocab_size']}, seed {args.seed})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
