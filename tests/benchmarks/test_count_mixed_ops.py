"""benchmarks/count_decode_ops' mixed-step mode: an eager step's launches do not grow with its sequences
(the paged prefill attention: one Triton launch per layer for all the step's sequences), and the step has no host sync (Triton kernels as on CUDA,
under TRITON_INTERPRET here)."""

from __future__ import annotations

from collections import Counter

import torch

from benchmarks.count_decode_ops import SYNCS, count_mixed_step, main


def _per_layer(counter, layer: int = 1) -> Counter:
    return counter.counts.get(f"layer {layer}", Counter())


def test_mixed_step_launches_do_not_grow_with_sequences():
    one = count_mixed_step("synthetic:tiny", torch.bfloat16, decode_rows=2, prompts=1, prompt_len=12)
    many = count_mixed_step("synthetic:tiny", torch.bfloat16, decode_rows=6, prompts=3, prompt_len=12)
    assert _per_layer(many)["triton::_paged_prefill_kernel"] == 1 and not _per_layer(many)["scaled_dot_product_attention"]
    assert sum(_per_layer(many).values()) == sum(_per_layer(one).values())
    assert not [name for c in many.counts.values() for name in c if name in SYNCS]


def test_cli_refuses_a_bad_mixed_spec(capsys):
    try:
        main(["--mixed", "16,4"])
    except SystemExit as exc:
        assert exc.code == 2
    assert "--mixed wants ROWS,PROMPTS,LEN" in capsys.readouterr().err
