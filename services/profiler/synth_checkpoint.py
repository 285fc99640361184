"""Write a checkpoint on disk for `tandem bench load` when no real one can be downloaded: the experts
(and per layer a router and a q_proj, so expert tensors are interleaved with others as on the Hub) of
a synthetic preset, random values, Hugging Face layout — sharded safetensors + index + config.json.

    python -m services.profiler.synth_checkpoint DIR --model 'synthetic:qwen3-30b-a3b?layers=8' --shard-gib 4

Only what the expert loader reads is written; this is not a servable model.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm


def _tensors(cfg: dict, dtype: torch.dtype, gen: torch.Generator):
    """(name, tensor) in Hub order: per layer q_proj, then the router and experts (or a dense MLP)."""
    D = cfg["hidden_size"]
    E = cfg.get("num_experts") or cfg.get("num_local_experts")
    I = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    mixtral = cfg["model_type"] == "mixtral"
    prefix, (gate, up, down) = ("block_sparse_moe", ("w1", "w3", "w2")) if mixtral else ("mlp", ("gate_proj", "up_proj", "down_proj"))
    rnd = lambda *shape: torch.randn(*shape, generator=gen).to(dtype)  # noqa: E731
    for layer in range(cfg["num_hidden_layers"]):
        yield f"model.layers.{layer}.self_attn.q_proj.weight", rnd(64, D)
        if layer in (cfg.get("mlp_only_layers") or []):
            yield f"model.layers.{layer}.mlp.gate_proj.weight", rnd(cfg["intermediate_size"], D)
            continue
        yield f"model.layers.{layer}.{prefix}.gate.weight", rnd(E, D)
        for e in range(E):
            base = f"model.layers.{layer}.{prefix}.experts.{e}"
            yield f"{base}.{gate}.weight", rnd(I, D)
            yield f"{base}.{up}.weight", rnd(I, D)
            yield f"{base}.{down}.weight", rnd(D, I)


def write_checkpoint(directory: str | Path, cfg: dict, dtype: torch.dtype = torch.bfloat16,
                     shard_bytes: int = 4 << 30, seed: int = 0, progress: bool = False) -> Path:
    """Write ``cfg`` (a Hugging Face config dict)'s expert tensors into ``directory`` as shards of about
    ``shard_bytes``, plus model.safetensors.index.json and config.json. Returns the directory."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    names: list[list[str]] = [[]]
    bar = tqdm(desc="write checkpoint", unit="B", unit_scale=True, disable=not progress, file=sys.stderr)

    def flush(final: bool) -> None:
        nonlocal size
        save_file(shards[-1], str(directory / f"shard-{len(shards):05d}.safetensors"))
        if not final:
            shards[-1] = {}
            shards.append({})
            names.append([])
            size = 0

    for name, t in _tensors(cfg, dtype, gen):
        shards[-1][name] = t
        names[-1].append(name)
        size += t.numel() * t.element_size()
        bar.update(t.numel() * t.element_size())
        if size >= shard_bytes:
            flush(final=False)
    bar.close()
    if not shards[-1]:
        shards.pop()
        names.pop()
    else:
        flush(final=True)
    n = len(names)
    weight_map = {}
    for i, group in enumerate(names):
        final_name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        (directory / f"shard-{i + 1:05d}.safetensors").rename(directory / final_name)
        weight_map.update({k: final_name for k in group})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    return directory


def main(argv: list[str] | None = None) -> int:
    from services.engine.models.synthetic import PREFIX, PRESETS, parse_name

    p = argparse.ArgumentParser(prog="python -m services.profiler.synth_checkpoint", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("directory")
    p.add_argument("--model", default="synthetic:qwen3-30b-a3b?layers=8", help="synthetic preset (default: %(default)s)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--shard-gib", type=float, default=4.0, help="approximate shard size, GiB (default: %(default)s)")
    args = p.parse_args(argv)
    name, overrides = parse_name(args.model if args.model.startswith(PREFIX) else PREFIX + args.model)
    cfg = {**PRESETS[name], **overrides}
    cfg["vocab_size"] = cfg.get("vocab_size") or 1000
    out = write_checkpoint(args.directory, cfg, getattr(torch, args.dtype), int(args.shard_gib * (1 << 30)), progress=True)
    print(f"checkpoint written: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
