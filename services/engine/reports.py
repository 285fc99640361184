"""What the engine reports about itself, as JSON (no torch objects leave this file):
GET /engine/v1/info (build_info), the expert backend's counters in the metrics contract's shape
(flat_backend_stats) and VRAM use (vram_stats)."""

from __future__ import annotations

import json
from pathlib import Path

from services.engine.config import EngineConfig
from services.engine.moe.banks import host_page_report

API_VERSION = "v1"


def flat_backend_stats(raw: dict) -> dict:
    """A backend's stats with the metrics contract's keys at the top (services/engine/metrics.py):
    counters nested under "cache" (offload, hybrid) and the bandwidth pair lifted; the nested
    originals stay for readers that know them."""
    out = {**(raw.get("cache") or {}), **raw}
    bw = raw.get("bandwidth_bytes_per_second")
    if isinstance(bw, dict):
        out.setdefault("pcie_bytes_per_second", bw.get("pcie"))
        out.setdefault("cpu_bytes_per_second", bw.get("cpu"))
    if isinstance(raw.get("prefetch"), dict):  # --moe-prefetch: experts copied ahead, a counter like fetched
        out.setdefault("prefetched", raw["prefetch"]["prefetched"])
    return out


def vram_stats(config: EngineConfig) -> dict | None:
    """VRAM use in bytes when on CUDA (None on CPU)."""
    if config.device.value != "cuda":
        return None
    import torch

    free, total = torch.cuda.mem_get_info()
    return {"allocated_bytes": torch.cuda.memory_allocated(), "reserved_bytes": torch.cuda.memory_reserved(),
            "peak_allocated_bytes": torch.cuda.max_memory_allocated(), "free_bytes": free, "total_bytes": total}


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def build_info(loaded, max_seq_len: int, served_model_names: list[str] = ()) -> dict:
    """GET /engine/v1/info: what the gateway needs to tokenize, template and stop (no torch objects).
    ``model_id`` is the first served name (--served-model-name), else the checkpoint's own id;
    ``served_model_names`` every name the gateway routes to this engine."""
    names = list(served_model_names) or [loaded.model_id]
    model_dir = Path(loaded.model_dir)
    tok_path = model_dir / "tokenizer.json"
    if not tok_path.is_file():
        raise FileNotFoundError(f"{tok_path}: missing tokenizer.json; the engine cannot serve text without it")
    from services.common.tokenizer import Tokenizer

    gen = _read_json(model_dir / "generation_config.json")
    # generation_config's eos_token_id, else tokenizer_config's eos_token (the text helper's rule),
    # else config.json's eos_token_id
    eos_ids = Tokenizer.from_dir(model_dir).eos_token_ids
    if not eos_ids:
        eos = _read_json(model_dir / "config.json").get("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    return {"api_version": API_VERSION, "model_id": names[0], "served_model_names": names,
            "max_seq_len": max_seq_len,
            "tokenizer_json": tok_path.read_text(), "tokenizer_config": _read_json(model_dir / "tokenizer_config.json"),
            "generation_config": gen, "eos_token_ids": eos_ids,
            # the routed-expert geometry (benchmarks turn miss rates into bytes per token with it)
            "moe": {"layers": len(loaded.banks.layers), "experts": loaded.spec.num_experts,
                    "top_k": loaded.spec.top_k, "expert_bytes": loaded.banks.expert_nbytes(),
                    # how the host banks are mapped (huge pages or not): a suspect for server-to-server spread
                    "host_pages": host_page_report([t for lb in loaded.banks.layers for t in lb.tensors.values()
                                                    if t.device.type == "cpu"])}}
