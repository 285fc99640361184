"""``kv_cache.upload``: host ints to the device without a host sync, so an eager prefill / mixed step issues
all its launches without waiting for the GPU (a pageable ``torch.tensor(values, device=cuda)`` syncs the
stream: the packed tables in layer 0, the last-token rows after the layers, the runner's input ids and
positions)."""

from __future__ import annotations

import pytest
import torch

from services.engine.config import EngineConfig, MoEBackend
from services.engine.models.registry import load_model
from services.engine.runtime.kv_cache import ForwardBatch, KVCache, upload


def test_upload_on_the_cpu():
    got = upload([3, 1, 4], "cpu")
    assert got.dtype == torch.long and got.device.type == "cpu" and got.tolist() == [3, 1, 4]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [[6], [6, 5, 1, 1]], ids=["one prompt", "packed: two prompts + two decode rows"])
def test_eager_prefill_forward_has_no_host_sync_on_cuda(rows):
    """The whole eager forward under torch's sync check set to raise: no sync anywhere (layers or step)."""
    lm = load_model(EngineConfig(model="synthetic:tiny", device="cuda", dtype="bfloat16",
                                 moe_backend=MoEBackend.RESIDENT, max_seq_len=32))
    kv = KVCache(lm.spec, len(rows), 32, "cuda", torch.bfloat16)
    starts = [0 if n > 1 else 9 for n in rows]
    ids = upload([5] * sum(rows), "cuda")
    pos = upload([p for s, n in zip(starts, rows) for p in range(s, s + n)], "cuda")

    def forward() -> torch.Tensor:
        batch = ForwardBatch(slots=list(range(len(rows))), start_pos=starts, query_lens=rows)
        return lm.model(ids, pos, batch, kv)

    forward()  # compiles, lazy inits
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        logits = forward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert logits.shape == (len(rows), lm.spec.vocab_size)
    assert torch.isfinite(logits).all()
