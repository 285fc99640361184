"""The one error type of checkpoint loading (a ValueError, so CLI front-ends report it as bad input)."""

from __future__ import annotations


class LoaderError(ValueError):
    """A checkpoint that cannot be loaded. The message names the file and, where one is at fault,
    the tensor (e.g. ``model-00002-of-00003.safetensors: tensor 'model.layers.3.mlp.gate.weight'
    has shape [8, 32], expected [16, 32]``)."""
