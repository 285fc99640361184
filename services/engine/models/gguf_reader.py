"""GGUFFile: one GGUF model (a single ``.gguf`` file, or the shards ``NAME-00001-of-0000N.gguf`` of a split
one) memory-mapped through the ``gguf`` package's reader: its metadata and its tensors by name.

GGUF stores a matrix of R rows and C columns as ``ne = [C, R]`` (fastest dimension first); ``shape(name)``
gives the torch order ``[R, C]`` (``[E, R, C]`` for the stacked expert tensors). Quantized tensors are
whole blocks per row: ``blocks(name)`` is the uint8 ``[..., R, row bytes]`` view of the mapped file
(no copy), ``dense(name)`` the values dequantized by the package's numpy reference.

Every problem (not a GGUF file, truncated, a missing shard, a tensor type the engine cannot hold) is a
LoaderError of one line naming the file and, where one is at fault, the tensor.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from services.engine.models.errors import LoaderError

SUFFIX = ".gguf"
_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")
_MISSING = object()


def is_gguf(model: str) -> bool:
    return model.lower().endswith(SUFFIX)


def shard_paths(path: Path) -> list[Path]:
    """The files of the model ``path`` names: itself, or every shard of a split model when it is one of
    them (``-0000K-of-0000N.gguf``; llama.cpp's gguf-split naming). LoaderError when one is missing."""
    m = _SPLIT.match(path.name)
    if m is None:
        if not path.is_file():
            raise LoaderError(f"--model {path}: no such GGUF file")
        return [path]
    count = int(m["count"])
    paths = [path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise LoaderError(f"{path}: split GGUF model of {count} files is missing {', '.join(missing)}")
    return paths


class GGUFFile:
    """Metadata and tensors of a GGUF model (all shards), memory-mapped."""

    def __init__(self, path: str | Path) -> None:
        import gguf

        self.path = Path(path).expanduser()
        self.paths = shard_paths(self.path)
        self.fields: dict[str, Any] = {}
        self._tensors: dict[str, tuple[Path, Any]] = {}  # name -> (file, gguf ReaderTensor)
        for p in self.paths:
            try:
                reader = gguf.GGUFReader(p, "r")
            except Exception as e:  # noqa: BLE001 - the package raises ValueError/IndexError/OSError on bad bytes
                raise LoaderError(f"{p}: not a readable GGUF file: corrupt or truncated ({type(e).__name__}: {e})") from e
            for name, field in reader.fields.items():
                self.fields.setdefault(name, field)  # the first shard holds the model's metadata
            for t in reader.tensors:
                if t.name in self._tensors:
                    raise LoaderError(f"{p}: tensor {t.name!r} also appears in {self._tensors[t.name][0].name}")
                if t.data.nbytes != t.n_bytes:  # the reader maps past the end of a truncated file silently
                    raise LoaderError(f"{p}: truncated GGUF file: tensor {t.name!r} needs {t.n_bytes} bytes, "
                                      f"{t.data.nbytes} present")
                self._tensors[t.name] = (p, t)
        self.arch = str(self.get("general.architecture"))

    # ---- metadata -------------------------------------------------------------------------------

    def get(self, key: str, default: Any = _MISSING) -> Any:
        """The value of metadata ``key`` (``{arch}.`` keys may be given as ``.block_count``); ``default``
        when absent, else a LoaderError naming the key."""
        if key.startswith("."):
            key = self.arch + key
        field = self.fields.get(key)
        if field is None:
            if default is _MISSING:
                raise LoaderError(f"{self.path}: missing GGUF metadata key {key!r}")
            return default
        return field.contents()

    # ---- tensors --------------------------------------------------------------------------------

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    @property
    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def _tensor(self, name: str):
        if name not in self._tensors:
            raise LoaderError(f"{self.path}: missing tensor {name!r}")
        return self._tensors[name][1]

    def qtype(self, name: str):
        """The tensor's ``gguf.GGMLQuantizationType``."""
        return self._tensor(name).tensor_type

    def shape(self, name: str) -> tuple[int, ...]:
        """Torch-order shape (GGUF's ``ne`` reversed): [R, C] for a matrix, [E, R, C] for stacked experts."""
        return tuple(int(n) for n in reversed(self._tensor(name).shape.tolist()))

    def blocks(self, name: str) -> torch.Tensor:
        """A quantized tensor's bytes as uint8 [..., R, row bytes] over the mapped file (read-only: copy
        before writing)."""
        t = self._tensor(name)
        data = t.data if t.data.dtype == np.uint8 else t.data.view(np.uint8)
        with warnings.catch_warnings():  # a read-only mapping: the callers only copy out of it
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(np.asarray(data)).view(*self.shape(name)[:-1], -1)

    def dense(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """The tensor dequantized to float32 in torch order (checked against ``shape`` when given)."""
        import gguf

        t = self._tensor(name)
        got = self.shape(name)
        if shape is not None and tuple(shape) != got:
            raise LoaderError(f"{self._tensors[name][0]}: tensor {name!r} has shape {list(got)}, expected {list(shape)}")
        try:
            values = gguf.dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise LoaderError(f"{self._tensors[name][0]}: tensor {name!r} has type {t.tensor_type.name}, which the "
                              f"gguf package cannot dequantize ({e})") from e
        # a copy: F32 tensors come back as the read-only mapping itself
        return torch.from_numpy(np.array(values, dtype=np.float32)).view(got)
