"""One bs=1 decode step captured as a CUDA graph, for in-process decode benchmarks (no server, no HTTP).

The graph feeds its own sampled token back as the next input and advances the position itself, so a
replay is a whole decode step; the KV window is static (the whole cache, masked by position).
Sampling is greedy (temperature 0) or Gumbel-max at a temperature: random numbers drawn inside the
graph, so replays sample afresh and the routing stays representative (a random-weight model decoded
greedily tends to loop on a few tokens and touch few experts).
"""

from __future__ import annotations

import torch

from services.engine.runtime.kv_cache import ForwardBatch, KVCache


def prefill(lm, kv: KVCache, prompt: list[int]) -> int:
    """Eager prefill of ``prompt`` into KV slot 0; returns the greedy next token."""
    ids = torch.tensor(prompt, device="cuda")
    logits = lm.model(ids, torch.arange(len(prompt), device="cuda"), ForwardBatch.single(0, 0, len(prompt)), kv)
    return int(logits[0].argmax())


class GraphDecoder:
    """Prefill ``prompt``, then ``step()`` replays one captured decode step (3 warm-up steps run first,
    eagerly on a side stream, before the capture)."""

    def __init__(self, lm, kv: KVCache, prompt: list[int], temperature: float = 0.0):
        self.kv = kv
        self.ids = torch.tensor([prefill(lm, kv, prompt)], device="cuda")  # [1] static input
        self.pos = torch.tensor([len(prompt)], device="cuda")  # [1] static position
        batch = ForwardBatch(slots=[0], start_pos=[len(prompt)], query_lens=[1], kv_len=kv.max_seq_len,
                             slot_ids=torch.zeros(1, dtype=torch.long, device="cuda"))

        def body() -> None:
            logits = lm.model(self.ids, self.pos, batch, kv).float()  # [1, V]
            if temperature > 0:  # Gumbel-max: argmax(l / T + G) samples softmax(l / T)
                u = torch.rand_like(logits).clamp_(min=1e-10)
                logits = logits / temperature - torch.log(-torch.log(u))
            self.ids.copy_(logits.argmax(dim=-1))
            self.pos.add_(1)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):  # allocator, lazy inits and Triton compiles happen outside the capture
                body()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            body()

    def step(self) -> None:
        self.graph.replay()

    def check_room(self) -> None:
        """Raise if decode ran past the KV cache (call after the last step)."""
        if int(self.pos.item()) >= self.kv.max_seq_len:
            raise RuntimeError("decode ran past the KV cache; raise --max-seq-len")
