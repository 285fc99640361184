"""An eager prefill / mixed step on the CUDA code path (Triton kernels as on CUDA, under TRITON_INTERPRET here)
reads no device value on the host inside its layers: no ``.item()``/``.tolist()``/``bool(t)``/``int(t)``/
``.cpu()``/``nonzero``/..., no ``torch.tensor`` of host values (a pageable copy up waits for the stream), and
no aten op that syncs. What the step does need on the host (the packed index tables, the last-token rows)
happens once per step, so the count does not grow with the number of layers. On CUDA one such call per
layer would stall the host once per layer (the GPU idles while the next layer's launches are issued)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from benchmarks.count_decode_ops import SYNCS, count_mixed_step


def _host_calls(counter) -> dict[str, Counter]:
    return {label: c for label, c in counter.host.items() if sum(c.values())}


def _count(layers: int, decode_rows: int):
    return count_mixed_step(f"synthetic:tiny?layers={layers}", torch.bfloat16, decode_rows=decode_rows, prompts=1,
                            prompt_len=6)


@pytest.mark.parametrize("decode_rows", [0, 2], ids=["one prompt alone", "one prompt + 2 decode rows (packed)"])
def test_host_reads_do_not_grow_with_layers(decode_rows):
    two, three = _count(2, decode_rows), _count(3, decode_rows)
    for counter in (two, three):
        later_layers = {label: c for label, c in _host_calls(counter).items()
                        if label.startswith("layer ") and label != "layer 0"}
        assert not later_layers, f"host reads inside the layers: {later_layers}"
        assert not [name for c in counter.counts.values() for name in c if name in SYNCS]
    total = lambda counter: sum(sum(c.values()) for c in counter.host.values())  # noqa: E731
    assert total(two) == total(three), (_host_calls(two), _host_calls(three))


def test_a_per_layer_read_is_counted(monkeypatch):
    """The counter sees a sync hidden in a layer (what the test above guards against)."""
    from services.engine.moe.layer import MoEBlock

    forward = MoEBlock.forward
    monkeypatch.setattr(MoEBlock, "forward", lambda self, x: forward(self, x) * (x.abs().max().item() > -1))
    counter = _count(2, 0)
    assert counter.host["layer 1"]["host::item"] == 1
    assert counter.host["layer 1"]["host::__bool__"] == 0  # a Python float compared, not a tensor
