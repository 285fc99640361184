"""Host bank memory (services/engine/moe/banks.py host_bank / pin_host): its own private mapping on a
2 MiB boundary, advised to transparent huge pages (checked in /proc/self/smaps), alive as long as a
tensor over it, and pinned in place on CUDA."""

from __future__ import annotations

import gc

import pytest
import torch

from services.engine.moe.banks import _REGIONS, ExpertBanks, ExpertFormat, HUGE_PAGE, host_bank, host_page_report


def thp_mode() -> str:
    return open("/sys/kernel/mm/transparent_hugepage/enabled").read().split("[")[1].split("]")[0]


def test_banks_start_on_a_huge_page_and_take_any_dtype():
    for dtype in (torch.bfloat16, torch.float32, torch.int8):
        t = host_bank((3, 5, 7), dtype)
        assert t.shape == (3, 5, 7) and t.dtype == dtype and t.data_ptr() % HUGE_PAGE == 0
        t.copy_(torch.arange(105).view(3, 5, 7).to(dtype))
        assert t[2, 4, 6].item() == 104  # the whole span is writable memory
    assert host_bank((0, 4), torch.bfloat16).numel() == 0


@pytest.mark.parametrize("advise", [True, False])
def test_huge_pages_follow_the_setting(advise):
    """Advised banks are backed by huge pages wherever THP is not off; without the advice a 'madvise'
    system gives them none (the comparison bench_cpu_stream --pages makes)."""
    t = host_bank((16, 1024, 1024), torch.bfloat16, huge_pages=advise)  # 32 MiB
    t.fill_(1.0)  # first touch: the kernel picks the page size now
    huge = host_page_report([t])["huge_page_bytes"]
    mode = thp_mode()
    if mode == "never":
        assert huge == 0
    elif advise:
        assert huge >= t.numel() * t.element_size() // 2, f"THP {mode}: {huge} of {t.numel() * 2} bytes in huge pages"
    elif mode == "madvise":
        assert huge == 0


def test_the_mapping_lives_as_long_as_a_tensor_over_it():
    t = host_bank((4, 1024), torch.float32)
    key = t.data_ptr()
    view = t[1:3]
    del t
    gc.collect()
    assert key in _REGIONS  # the view keeps the region
    view.fill_(2.0)
    del view
    gc.collect()
    assert key not in _REGIONS  # unmapped with its last tensor


def test_allocated_banks_are_host_banks():
    banks = ExpertBanks.allocate(ExpertFormat.UNQUANTIZED, 2, 4, 32, 16, torch.bfloat16)
    for layer in banks.layers:
        for t in layer.tensors.values():
            assert t.data_ptr() in _REGIONS and t.data_ptr() % HUGE_PAGE == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pinning_registers_in_place():
    from services.engine.moe.banks import pin_banks, pin_host

    banks = ExpertBanks.allocate(ExpertFormat.UNQUANTIZED, 2, 8, 256, 64, torch.bfloat16)
    before = {(i, n): t.data_ptr() for i, l in enumerate(banks.layers) for n, t in l.tensors.items()}
    for layer in banks.layers:
        for t in layer.tensors.values():
            t.copy_(torch.randn(t.shape))
    pin_banks(banks)
    for i, layer in enumerate(banks.layers):
        for name, t in layer.tensors.items():
            assert t.data_ptr() == before[(i, name)] and t.is_pinned()
            assert torch.equal(t.to("cuda", non_blocking=True).cpu(), t)
    other = torch.randn(1000)  # not a host bank: pinned as a copy
    (pinned,) = pin_host([other])
    assert pinned.is_pinned() and pinned.data_ptr() != other.data_ptr() and torch.equal(pinned, other)
    del banks, layer, t
    gc.collect()  # unregistered and unmapped without a CUDA error
    torch.cuda.synchronize()
