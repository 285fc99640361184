"""Kernel tests run the Triton kernels under the interpreter when there is no GPU. TRITON_INTERPRET must be
set before any ``@triton.jit`` function is defined, i.e. before the kernel modules are imported, so it is
set here at collection time (Triton's own variable, not a Tandem setting)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def kernel_device() -> torch.device:
    """Where kernel tests put their tensors: the GPU when present, else the CPU (interpreter)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def device() -> torch.device:
    """kernel_device() as a fixture."""
    return kernel_device()
