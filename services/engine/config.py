"""The engine's one config object. CLI flags are derived from these fields (``services.common.settings``),
so `tandem serve --help` / `tandem engine --help` always match what the engine reads."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from services.common.settings import field


class MoEBackend(str, enum.Enum):
    """How experts are computed (docs/design.md §2)."""

    RESIDENT = "resident"  # all experts on the compute device, no cache
    OFFLOAD = "offload"  # GPU slot cache; misses fetched over PCIe
    CPU = "cpu"  # GPU slot cache for hits; misses computed by the CPU executor
    HYBRID = "hybrid"  # misses split between fetch and CPU by the fetch fraction f
    AUTO = "auto"  # chosen from the bandwidth profile, corrected online


class Device(str, enum.Enum):
    CPU = "cpu"
    CUDA = "cuda"


class DecodeOverlap(str, enum.Enum):
    """Whether the engine launches a decode step before reading the previous step's tokens."""

    AUTO = "auto"  # when the step replays a CUDA graph (queued at once, so the host really runs ahead)
    ON = "on"  # whenever the batch allows it, eager steps too (tests the chaining on the CPU)
    OFF = "off"


class CachePolicy(str, enum.Enum):
    """Which cached expert a fetched miss replaces (and, in hybrid, which misses are fetched)."""

    LRU = "lru"  # the least recently used slot; hybrid fetches the misses with the lowest ids
    LFU = "lfu"  # the slot whose expert was routed to least often (then least recently); hybrid fetches the most used


# The kernels' largest use-count cap (kernels/ensure_experts_ref.USE_CAP: a count must fit below their
# eviction key's recency bits); not imported, since this config must load without torch.
LFU_CAP_MAX = 1 << 10


class DType(str, enum.Enum):
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"


class ExpertDType(str, enum.Enum):
    """How the routed experts are held in the banks (the rest of the model is in --dtype)."""

    CHECKPOINT = "checkpoint"  # as stored: FP8 for a fine-grained FP8 checkpoint, MXFP4 for gpt-oss, else --dtype
    FP8 = "fp8"  # quantized at load to float8_e4m3fn with one scale per 128x128 block (half of bf16's bytes)
    DTYPE = "dtype"  # in --dtype: a quantized checkpoint's experts dequantized at load


# --max-running-requests when unset. A resident model on a GPU is a server for many clients: its decode step
# reads each distinct expert once (the grouped GEMM), and 32 streams of Qwen3-30B-A3B touch ~111 of 128
# experts per layer (25 GB per step at bf16, ~6 ms at HBM speed) against one stream's 8 (1.8 GB, in a ~2 ms
# step): ~3x the step for 32x the tokens. Their KV (48 layers x 96 KiB/token x 4096 tokens x 32 = 12.9 GB at
# bf16) fits beside the 61 GB of experts on the cards that hold them. Elsewhere (CPU, or a GPU too small for
# the experts, whose VRAM the expert cache wants) 8. docs/serving.md lists the GPU server's defaults.
GPU_SERVER_RUNNING = 32
DEFAULT_RUNNING = 8
# --max-prefill-tokens when unset: a prompt chunk of an offloaded model streams every expert it misses once
# (~19 GB at a third of 24-layer Qwen3-30B-A3B cached, 0.37 s of PCIe), so fewer, larger chunks prefill
# faster. H200, hybrid, 24 GiB: a 32k prompt in 2.8 s with 8192-token chunks, 2.1 s with 16384; the chunk's
# activations measured +0.8 GiB between the two (docs/serving.md "Long prompts").
DEFAULT_PREFILL_TOKENS = 16384


@dataclass
class EngineConfig:
    model: str = field(env="TANDEM_MODEL", help="checkpoint directory (Hugging Face layout), a GGUF file "
                       "(MODEL.gguf, or the first shard MODEL-00001-of-0000N.gguf: qwen3moe, qwen2moe, gpt-oss, "
                       "olmoe, mixtral; experts kept in their q4_K/q5_K/q6_K/q8_0/mxfp4 blocks, docs/gguf.md), "
                       "'demo', or 'synthetic:NAME[?layers=N&experts=TYPE]'")
    device: Device = field(Device.CPU, help="compute device")
    dtype: DType = field(DType.FLOAT32, help="weight and activation dtype")
    moe_expert_dtype: ExpertDType = field(ExpertDType.CHECKPOINT, help="routed experts' format: checkpoint (as "
                                          "stored: FP8 blocks for a fine-grained FP8 checkpoint, MXFP4 for gpt-oss, "
                                          "else --dtype), fp8 (a bf16/fp32 checkpoint's experts quantized at load to "
                                          "float8_e4m3fn with a scale per 128x128 block: half of bf16's bytes; error "
                                          "measured in docs/fp8.md) or dtype (a quantized checkpoint's experts "
                                          "dequantized at load to --dtype: 4x MXFP4's bytes)")
    moe_backend: MoEBackend = field(MoEBackend.RESIDENT, help="where experts are computed: resident (all on the "
                                    "GPU), offload (misses copied over PCIe), cpu (misses on the CPU), hybrid "
                                    "(misses split between both) or auto (offload or hybrid, timed while serving)")
    moe_cache_size: int | None = field(None, help="GPU expert cache size in slots (one slot = one expert of one layer)")
    moe_cache_rate: float | None = field(None, help="GPU expert cache size as a share of all L*E experts, 0 < r <= 1")
    moe_cache_auto: bool = field(False, help="size the expert cache to fill the VRAM budget after weights and the KV reserve")
    moe_cache_policy: CachePolicy | None = field(None, help="offload/cpu/hybrid: which cached expert a fetched miss "
                                                 "replaces: lfu (least often routed to, then least recent; hybrid then "
                                                 "fetches its most used misses and leaves the rest to the CPU) or lru "
                                                 "(least recently used); unset = lfu, or lru with --moe-prefetch")
    moe_cache_lfu_cap: int = field(LFU_CAP_MAX, help="lfu: when an expert's use count reaches this, every layer's "
                                                     "counts are halved, so old traffic fades; lower ages faster "
                                                     f"(2-{LFU_CAP_MAX})")
    moe_hybrid_max_fetch: int = field(-1, help="hybrid: most misses fetched per layer and step; -1 = automatic, 0 = all misses on the CPU")
    moe_cpu_threads: int = field(0, help="cpu/hybrid: CPU executor workers, each pinned to a physical core; 0 = one per core "
                                         "minus one for the thread driving the GPU")
    moe_prefetch: int = field(0, help="offload/hybrid: most experts per token copied ahead for the next layer while this "
                                      "one computes: the likeliest uncached ones of its routing as predicted by its "
                                      "router on this layer's input (at most top-k); 0 = off")
    moe_peer_devices: str = field("", help="offload/cpu/hybrid/auto: other GPUs whose VRAM holds a second tier of "
                                  "expert slots, comma-separated (cuda:1,cuda:2); a miss held there is copied "
                                  "device to device (NVLink/P2P) instead of over PCIe. A peer equal to the home "
                                  "device (cuda:0 beside --device cuda on cuda:0; cpu for --device cpu) simulates "
                                  "one with a second pool there; empty = off (docs/multi-gpu.md)")
    moe_peer_memory: float | None = field(None, help="--moe-peer-devices: GiB of expert slots on each peer; unset = "
                                          "the peer's free VRAM less headroom (a CPU peer: every expert; a peer "
                                          "on the home GPU needs it)")
    decode_overlap: DecodeOverlap = field(DecodeOverlap.AUTO, help="launch each decode step before the host reads the "
                                          "previous step's tokens (they feed the next step on the device), so stop "
                                          "checks, streaming and HTTP run while the GPU computes: auto = when the step "
                                          "replays a CUDA graph, on = whenever the batch allows it, off = never")
    gpu_memory_limit: float | None = field(None, help="cap the VRAM budget at this many GiB (emulate a smaller card)")
    max_running_requests: int | None = field(None, help="most requests decoded together (continuous batching; they "
                                             "share the KV pool's blocks, and CUDA graphs are captured "
                                             f"for every batch size up to it); unset = {GPU_SERVER_RUNNING} with "
                                             "--moe-backend resident on --device cuda (a GPU server), else "
                                             f"{DEFAULT_RUNNING}")
    max_waiting_requests: int = field(64, help="most requests queued before new ones get 429")
    max_seq_len: int | None = field(None, help="most tokens (prompt + generated) per request; unset = the model's "
                                    "trained context (max_position_embeddings). Reserves nothing: requests share "
                                    "the KV pool's blocks")
    kv_cache_memory: float | None = field(None, help="GiB of the paged KV cache (shared by all requests, on the "
                                          "compute device); unset = room for one request of --max-seq-len plus "
                                          "4096 tokens for each other running request, taken before the expert "
                                          "cache's share")
    max_prefill_tokens: int | None = field(None, help="most prompt tokens computed per step; longer prompts are "
                                           "prefilled in chunks while running requests keep decoding; unset = "
                                           f"{DEFAULT_PREFILL_TOKENS} (a chunk streams the missing experts once, so "
                                           "larger chunks prefill faster, smaller ones stall decoding less)")
    prefix_cache: bool = field(True, help="reuse the KV of a prompt's longest prefix already computed (a multi-turn "
                                         "chat's history, a system prompt shared by users) from a finished request's "
                                         "KV slot or a running one, instead of prefilling it again")
    batch_invariant: bool = field(False, help="a request's tokens do not depend on the requests that share its "
                                  "steps (greedy texts equal their solo texts, bf16 on a GPU too): every decode "
                                  "step replays the one CUDA graph of --max-running-requests rows (unused rows "
                                  "padded), each prompt is prefilled in a forward of its own, the prefix cache is "
                                  "off. Cost: a decode step of one stream costs what one of --max-running-requests "
                                  "streams costs, and arrivals are prefilled one per step. resident and offload "
                                  "only; on --device cpu float32 only (docs/serving.md)")
    record_routing: str | None = field(None, help="write every MoE layer's expert ids of every computed token to a "
                                       "routing trace in this directory (one file per start; replay it with "
                                       "benchmarks/sim_expert_cache.py --trace, or fit a preset with --fit); turns "
                                       "CUDA graphs off while it records; unset = off")
    record_routing_max_gb: float = field(1.0, help="--record-routing: the trace file stops growing at this many GB")
    served_model_name: str = field("", help="the name(s) clients call the model by, comma-separated (aliases; the "
                                            "first is its id in the engine's info); empty = the checkpoint's own id")
    host: str = field("127.0.0.1", help="address to listen on")
    port: int = field(8001, help="port to listen on")
    seed: int = field(0, help="seed for synthetic weights and the demo checkpoint")

    @property
    def served_model_names(self) -> list[str]:
        return list(dict.fromkeys(n.strip() for n in self.served_model_name.split(",") if n.strip()))

    def __post_init__(self) -> None:
        self.device = Device(self.device)
        self.dtype = DType(self.dtype)
        self.moe_expert_dtype = ExpertDType(self.moe_expert_dtype)
        self.moe_backend = MoEBackend(self.moe_backend)
        self.decode_overlap = DecodeOverlap(self.decode_overlap)
        if self.max_running_requests is None:
            gpu_server = self.device is Device.CUDA and self.moe_backend is MoEBackend.RESIDENT
            self.max_running_requests = GPU_SERVER_RUNNING if gpu_server else DEFAULT_RUNNING
        if self.moe_cache_policy is None:  # lfu, except where the prefetch needs LRU order (below)
            self.moe_cache_policy = CachePolicy.LRU if self.moe_prefetch > 0 else CachePolicy.LFU
        self.moe_cache_policy = CachePolicy(self.moe_cache_policy)
        if self.moe_cache_policy is CachePolicy.LFU and self.moe_prefetch > 0:
            raise ValueError("--moe-cache-policy lfu does not combine with --moe-prefetch: the prefetch copies into "
                             "the oldest slots while the layer before still reads the newest, which only LRU "
                             "order guarantees")
        if not 2 <= self.moe_cache_lfu_cap <= LFU_CAP_MAX:
            raise ValueError(f"--moe-cache-lfu-cap must be in [2, {LFU_CAP_MAX}], got {self.moe_cache_lfu_cap}")
        sizing = [self.moe_cache_size is not None, self.moe_cache_rate is not None, bool(self.moe_cache_auto)]
        if sum(sizing) > 1:
            raise ValueError("--moe-cache-size, --moe-cache-rate and --moe-cache-auto are mutually exclusive; give one")
        if self.moe_cache_size is not None and self.moe_cache_size <= 0:
            raise ValueError(f"--moe-cache-size must be positive, got {self.moe_cache_size}")
        if self.moe_cache_rate is not None and not 0.0 < self.moe_cache_rate <= 1.0:
            raise ValueError(f"--moe-cache-rate must be in (0, 1], got {self.moe_cache_rate}")
        if self.moe_hybrid_max_fetch < -1:
            raise ValueError(f"--moe-hybrid-max-fetch must be -1 (auto), 0 or positive, got {self.moe_hybrid_max_fetch}")
        if self.moe_cpu_threads < 0:
            raise ValueError(f"--moe-cpu-threads must be 0 (one per physical core) or positive, got {self.moe_cpu_threads}")
        if self.moe_prefetch < 0:
            raise ValueError(f"--moe-prefetch must be 0 (off) or positive, got {self.moe_prefetch}")
        self._check_peer_flags()
        self._check_batch_invariant()
        if self.gpu_memory_limit is not None and self.gpu_memory_limit <= 0:
            raise ValueError(f"--gpu-memory-limit must be positive GiB, got {self.gpu_memory_limit}")
        if self.max_prefill_tokens is None:
            self.max_prefill_tokens = DEFAULT_PREFILL_TOKENS
        if self.record_routing_max_gb <= 0:
            raise ValueError(f"--record-routing-max-gb must be positive, got {self.record_routing_max_gb}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"--kv-cache-memory must be positive GiB, got {self.kv_cache_memory}")
        for name in ("max_running_requests", "max_waiting_requests", "max_seq_len", "max_prefill_tokens"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")

    def _check_batch_invariant(self) -> None:
        """--batch-invariant needs every expert of a step computed by the same kernels whatever the batch
        (docs/serving.md), and turns the prefix cache off: a hit takes a prompt's K/V from another request's
        pass and shortens the computed suffix, so its rows would be computed at other batch sizes."""
        if not self.batch_invariant:
            return
        if self.moe_backend not in (MoEBackend.RESIDENT, MoEBackend.OFFLOAD):
            raise ValueError(f"--batch-invariant needs --moe-backend resident or offload, not "
                             f"{self.moe_backend.value}: the CPU's share of the experts depends on the batch")
        if self.device is Device.CPU and self.dtype is DType.BFLOAT16:
            raise ValueError("--batch-invariant on --device cpu needs --dtype float32: the CPU's matmuls round a "
                             "row differently at different batch sizes, which bf16 turns into other greedy tokens")
        self.prefix_cache = False

    def _check_peer_flags(self) -> None:
        """--moe-peer-devices names devices of the engine's kind (checked against the host when the cache
        is built: services/engine/moe/peer_cache.py) and needs a slot cache to extend."""
        names = [n.strip() for n in self.moe_peer_devices.split(",") if n.strip()]
        if self.moe_peer_memory is not None and (self.moe_peer_memory <= 0 or not names):
            raise ValueError(f"--moe-peer-memory {self.moe_peer_memory}: needs --moe-peer-devices and a positive GiB")
        if not names:
            return
        kind = "cuda" if self.device is Device.CUDA else "cpu"
        for n in names:
            ok = n == "cpu" if kind == "cpu" else n.startswith("cuda:") and n[5:].isdigit()
            if not ok:
                raise ValueError(f"--moe-peer-devices {self.moe_peer_devices!r}: {n!r} is not a "
                                 f"{'cuda:N GPU' if kind == 'cuda' else 'cpu (simulated) peer'} for --device {kind}")
        if self.moe_backend is MoEBackend.RESIDENT:
            raise ValueError("--moe-peer-devices extends the expert cache; --moe-backend resident has none "
                             "(use offload, hybrid, cpu or auto)")
