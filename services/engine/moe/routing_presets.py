"""Routing presets: synthetic models that route like real ones (``synthetic:NAME?routing=sticky``).

Random weights route almost uniformly (a third of the experts cached misses ~half the picks), while real MoE
models route with strong locality, very differently by family. A preset replaces *which* experts each token
uses by a generative process calibrated to published measurements (docs/routing.md has the table: target,
source, measured), per MoE layer:

  - each of the A picks of a token keeps the expert its lane held at the previous token with probability
    ``stay``, else draws one from the layer's ``popularity`` (a Zipf law over a random order of the experts: a
    few experts take most picks). Together they set how often a pick repeats at the next token and how well a
    cache of a given share hits; a skewed popularity with rare stays is what fits Qwen3-30B-A3B's published
    curve (45 % next-token repeats, yet 90 % LRU hits at 40 % cached);
  - the A experts of a token are distinct; the weights are the router's softmax over them.

The process is a pure function of (seed, layer, request, position, lane): kernels/synthetic_route.py runs it in
one launch per layer, inside the CUDA graphs, on every backend (routing happens before the expert backend).
Each request draws its own randomness from its id (``assign``), so concurrent requests do not share lanes.

``uniform`` is no process: the model's own router picks (the behaviour of every number measured before
presets existed). ``file:PATH`` loads a preset fitted to a recorded trace (benchmarks/sim_expert_cache.py --fit):
per layer its own ``stay`` and its measured popularity.
"""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from services.engine.models import fused
from services.engine.models.errors import LoaderError

FILE_PREFIX = "file:"
FILE_FORMAT = "tandem-routing-preset/1"


@dataclass(frozen=True)
class Preset:
    stay: float  # probability that a pick keeps its lane's expert from the previous token
    zipf: float  # exponent s of the popularity law (rank r gets r^-s); 0 = every expert alike
    about: str  # what it stands for (the calibration targets: docs/routing.md)


# Calibrated by tests/engine/moe/test_routing_presets.py against the targets named here (simulated, in CI).
PRESETS: dict[str, Preset] = {
    "sticky": Preset(0.05, 1.6, "Qwen3-30B-A3B: 45 % of picks repeat at the next token, 80 % of reuses within 8 "
                                "tokens; LRU of 40 % hits 90-95 % warm; cold over 256 tokens 36/74/89/96 % at "
                                "6/19/38/64 % cached"),
    "moderate": Preset(0.33, 0.30, "Qwen3.8-Flash-Next (512 experts, top-10): LRU hits 43/62/72/79 % at 18/36/54/73 % "
                                   "cached"),
    "flat": Preset(0.0, 0.95, "gpt-oss-120b, DeepSeek-V4-Flash, GLM-5.2: LRU 8-18 % at 3-5 % cached, a frequency "
                              "oracle 40-52 %, nearly every expert live"),
}
NAMES = ("uniform", *PRESETS)


@dataclass
class RoutingTables:
    """The process's parameters per MoE layer: ``stay`` [L] and ``popularity`` [L, E] (rows sum to 1)."""

    stay: torch.Tensor
    popularity: torch.Tensor

    @staticmethod
    def from_preset(preset: Preset, num_layers: int, num_experts: int, seed: int) -> "RoutingTables":
        """Zipf popularity over a random order of each layer's experts (the order drawn from ``seed``)."""
        gen = torch.Generator().manual_seed(seed)
        law = torch.arange(1, num_experts + 1, dtype=torch.float64) ** -preset.zipf
        pop = torch.stack([law[torch.argsort(torch.randperm(num_experts, generator=gen))]
                           for _ in range(num_layers)])
        return RoutingTables(torch.full((num_layers,), preset.stay, dtype=torch.float64), pop / pop.sum(1, keepdim=True))

    @staticmethod
    def load(path: Path) -> "RoutingTables":
        try:
            doc = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise LoaderError(f"routing=file:{path}: cannot read the preset ({e})") from None
        if not isinstance(doc, dict) or doc.get("format") != FILE_FORMAT:
            raise LoaderError(f"routing=file:{path}: not a routing preset (expected format {FILE_FORMAT!r})")
        try:
            stay = torch.tensor(doc["stay"], dtype=torch.float64)
            pop = torch.tensor(doc["popularity"], dtype=torch.float64)
        except (KeyError, TypeError, ValueError) as e:
            raise LoaderError(f"routing=file:{path}: bad preset ({type(e).__name__}: {e})") from None
        if stay.dim() != 1 or pop.dim() != 2 or pop.shape[0] != stay.shape[0] or not ((0 <= stay) & (stay < 1)).all() \
                or not (pop >= 0).all() or not (pop.sum(1) > 0).all():
            raise LoaderError(f"routing=file:{path}: needs stay [L] in [0, 1) and popularity [L, E] >= 0 per layer")
        return RoutingTables(stay, pop / pop.sum(1, keepdim=True))

    def save(self, path: Path, source: str) -> None:
        Path(path).write_text(json.dumps({"format": FILE_FORMAT, "source": source, "stay": self.stay.tolist(),
                                          "popularity": self.popularity.tolist()}) + "\n")


def parse(value: str, num_layers: int, num_experts: int, seed: int) -> RoutingTables | None:
    """``routing=`` of a synthetic model -> its tables (None: uniform, the router's own picks)."""
    if value == "uniform":
        return None
    if value in PRESETS:
        return RoutingTables.from_preset(PRESETS[value], num_layers, num_experts, seed)
    if value.startswith(FILE_PREFIX):
        tables = RoutingTables.load(Path(value[len(FILE_PREFIX):]).expanduser())
        if tuple(tables.popularity.shape) != (num_layers, num_experts):
            raise LoaderError(f"routing={value}: the preset is for {tables.popularity.shape[0]} MoE layers x "
                              f"{tables.popularity.shape[1]} experts, this model has {num_layers} x {num_experts}")
        return tables
    raise LoaderError(f"routing={value!r}: expected one of {', '.join(NAMES)} or file:PATH")


def request_salt(request_id: str) -> int:
    """A request's 32-bit salt: its own stream of the process's random numbers."""
    return zlib.crc32(request_id.encode())


class SyntheticRouting:
    """Replaces a model's top-k picks by the preset's process (MoEBlock asks ``route``). Per forward the model
    calls ``begin`` with the tokens' positions and request slots; the runner calls ``assign`` when a slot takes
    a new request. Every tensor is allocated once, so CUDA graphs capture the kernel's reads."""

    def __init__(self, tables: RoutingTables, name: str, seed: int, top_k: int, renormalize: bool,
                 device: torch.device, max_slots: int = 64):
        from kernels.synthetic_route import layer_key

        self.name, self.top_k, self.renormalize = name, top_k, renormalize
        self.stay = [float(s) for s in tables.stay]
        order = torch.argsort(tables.popularity, dim=1, descending=True, stable=True)  # [L, E] experts by rank
        cdf = torch.cumsum(tables.popularity.gather(1, order), dim=1)
        cdf[:, -1] = math.inf  # no draw falls past the last rank, whatever the rounding
        self.cdf = cdf.to(torch.float32).to(device)  # [L, E]
        self.perm = order.to(device)  # [L, E] int64
        self.keys = [layer_key(seed, layer) for layer in range(len(self.stay))]
        self.salt = torch.zeros(max_slots, dtype=torch.long, device=device)  # [S] per request slot
        self._host_salt = [0] * max_slots
        self._positions: torch.Tensor | None = None
        self._slots: torch.Tensor | None = None

    def reserve(self, num_slots: int) -> None:
        """Room for ``num_slots`` request slots (call before a CUDA graph captures the salt tensor)."""
        if num_slots > len(self._host_salt):
            self._host_salt += [0] * (num_slots - len(self._host_salt))
            self.salt = torch.tensor(self._host_salt, dtype=torch.long, device=self.salt.device)

    def assign(self, slots: list[int], request_ids: list[str]) -> None:
        """Give each slot its request's salt (a small copy, only when a slot changed hands)."""
        changed = False
        for slot, rid in zip(slots, request_ids):
            if slot >= len(self._host_salt):
                raise ValueError(f"synthetic routing: slot {slot} beyond its {len(self._host_salt)} salts")
            salt = request_salt(rid)
            changed |= self._host_salt[slot] != salt
            self._host_salt[slot] = salt
        if changed:
            host = torch.tensor(self._host_salt, dtype=torch.long)
            self.salt.copy_(host.pin_memory() if self.salt.is_cuda else host, non_blocking=True)

    def begin(self, positions: torch.Tensor, token_slots: torch.Tensor) -> None:
        """The forward's tokens: positions [T] and request slots [T] (int64, on the model's device)."""
        self._positions, self._slots = positions, token_slots

    def route(self, moe_layer: int, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """router_logits [T, E] -> (weights [T, A] fp32, ids [T, A] int64) of ``moe_layer``."""
        if self._positions is None or self._positions.shape[0] != router_logits.shape[0]:
            raise RuntimeError("synthetic routing: the forward did not say its tokens (SyntheticRouting.begin)")
        args = (router_logits, self._positions, self._slots, self.salt, self.keys[moe_layer], self.stay[moe_layer],
                self.cdf[moe_layer], self.perm[moe_layer], self.top_k, self.renormalize)
        got = fused.call("synthetic_route", "synthetic_route", "synthetic_route", *args)
        if got is not None:
            return got
        from kernels.synthetic_route import synthetic_route_ref

        return synthetic_route_ref(*args)
