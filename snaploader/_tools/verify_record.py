"""``snaploader verify``'s records of a batch: digests of every leaf, the sample indices
of a map-style dataset, recorded by tagging its items (see ``_tools/verify_loader.py``),
and, for a resume into another batch size, the digests of each sample the batch holds."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import torch

from .._format.plain import tensor_bytes

_INDEX_MARK: Final = "__snaploader_verify_indices__"


# -- digests --------------------------------------------------------------------------


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    plain = tensor.detach().cpu()
    if plain.is_sparse:
        plain = plain.to_dense()
    return tensor_bytes(plain)


def leaf_digests(batch: Any) -> tuple[str, list[tuple[str, str]]]:
    """(digest of the whole batch, [(path, digest)] of each leaf) : sha256 over every
    tensor's and array's dtype, shape and bytes, other leaves' repr, and the nested
    structure (container types, keys, lengths) around them."""
    whole = hashlib.sha256()
    leaves: list[tuple[str, str]] = []

    def leaf(path: str, head: str, body: bytes) -> None:
        h = hashlib.sha256(head.encode())
        h.update(body)
        leaves.append((path, h.hexdigest()))
        whole.update(f"{path}\0{h.hexdigest()}\n".encode())

    def walk(path: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            leaf(path, f"tensor {value.dtype} {tuple(value.shape)}", _tensor_bytes(value))
        elif isinstance(value, np.ndarray) and value.dtype != object:
            leaf(path, f"ndarray {value.dtype} {value.shape}", np.ascontiguousarray(value).tobytes())
        elif isinstance(value, dict):
            whole.update(f"{path}\0{type(value).__qualname__}({len(value)})\n".encode())
            for key, item in value.items():
                walk(f"{path}[{key!r}]", item)
        elif isinstance(value, (list, tuple)):
            whole.update(f"{path}\0{type(value).__qualname__}({len(value)})\n".encode())
            for i, item in enumerate(value):
                walk(f"{path}[{i}]", item)
        else:
            leaf(path, type(value).__qualname__, repr(value).encode())

    walk("batch", batch)
    return whole.hexdigest(), leaves


# -- recording the sample indices of a map-style dataset -------------------------------


@dataclass(frozen=True, slots=True)
class _Tagged:
    index: Any
    sample: Any


def _tagged_getitem(self: Any, index: Any) -> _Tagged:
    return _Tagged(index, getattr(type(self).__mro__[1], "__getitem__")(self, index))


def _tagged_getitems(self: Any, indices: list[Any]) -> list[_Tagged]:
    samples = getattr(type(self).__mro__[1], "__getitems__")(self, indices)
    return [_Tagged(i, s) for i, s in zip(indices, samples)]


class RecordingCollate:
    """Wraps the loader's collate_fn: collates the samples as it would, and returns
    the requested indices beside the batch (unwrapped again in the main process)."""

    def __init__(self, collate_fn: Callable[[Any], Any]) -> None:
        self.collate_fn = collate_fn

    def __call__(self, samples: Any) -> tuple[str, list[Any], Any]:
        if isinstance(samples, _Tagged):  # automatic batching off: one sample
            return (_INDEX_MARK, [samples.index], self.collate_fn(samples.sample))
        return (_INDEX_MARK, [s.index for s in samples], self.collate_fn([s.sample for s in samples]))


def record_indices(dataset: Any) -> bool:
    """Make ``dataset`` tag each sample with its index, in place, by giving it a
    subclass of its own class (so isinstance checks and attributes are unchanged, and
    its draws from every RNG stay the same). False when its class cannot be swapped."""
    cls = type(dataset)
    namespace: dict[str, Any] = {"__slots__": (), "__module__": __name__, "__getitem__": _tagged_getitem}
    if getattr(cls, "__getitems__", None):
        namespace["__getitems__"] = _tagged_getitems
    try:
        dataset.__class__ = type(cls.__name__, (cls,), namespace)
    except TypeError:
        return False
    return True


def split_recorded(batch: Any) -> tuple[list[Any] | None, Any]:
    if isinstance(batch, tuple) and len(batch) == 3 and batch[0] == _INDEX_MARK:
        return batch[1], batch[2]
    return None, batch


def plain_index(index: Any) -> Any:
    if isinstance(index, (int, np.integer)) and not isinstance(index, bool):
        return int(index)
    if isinstance(index, torch.Tensor) and index.numel() == 1:
        return int(index.item())
    return repr(index)


# -- a batch split into samples (for a resume into another batch size) -----------------


class Unsplittable(ValueError):
    """A batch that cannot be cut into its samples along the first dimension."""


_SCALARS: Final = (str, bytes, int, float, bool, type(None))


def sample_digests(batch: Any, n: int) -> list[tuple[str, list[tuple[str, str]]]]:
    """(digest, [(path, digest)] of each part) of each of the ``n`` samples of a collated
    batch: a tensor or array is cut along dim 0, a dict by key, a list or tuple into its
    fields, a list of ``n`` plain values (strings, as default_collate leaves them) into
    its items; a list of ``n`` items that do not cut into fields is taken as the samples
    themselves (a collate_fn that returns them as they are). A sample's digests do not
    depend on which batch it came in, so runs batched differently compare."""
    parts: list[list[tuple[str, str]]] = [[] for _ in range(n)]
    shapes: list[str] = []

    def leaf(path: str, head: str, bodies: list[bytes]) -> None:
        named = "sample" + path.removeprefix("batch")
        for j, body in enumerate(bodies):
            h = hashlib.sha256(head.encode())
            h.update(body)
            parts[j].append((named, h.hexdigest()))

    def walk(path: str, value: Any) -> None:
        if isinstance(value, (torch.Tensor, np.ndarray)):
            shape = tuple(value.shape)
            if isinstance(value, np.ndarray) and value.dtype == object:
                raise Unsplittable(f"{path} is a NumPy array of Python objects")
            if not shape or shape[0] != n:
                raise Unsplittable(
                    f"{path} is a {type(value).__name__} of shape {shape}, whose first dimension "
                    f"is not the batch's {n} samples"
                )
            if isinstance(value, torch.Tensor):
                leaf(path, f"tensor {value.dtype} {shape[1:]}", [_tensor_bytes(row) for row in value])
            else:
                leaf(path, f"ndarray {value.dtype} {shape[1:]}", [np.ascontiguousarray(row).tobytes() for row in value])
        elif isinstance(value, dict):
            shapes.append(f"{path}\0{type(value).__qualname__}({len(value)})")
            for key, item in value.items():
                walk(f"{path}[{key!r}]", item)
        elif isinstance(value, (list, tuple)) and len(value) == n and all(isinstance(v, _SCALARS) for v in value):
            leaf(path, "value", [f"{type(v).__qualname__} {v!r}".encode() for v in value])
        elif isinstance(value, (list, tuple)):
            shapes.append(f"{path}\0{type(value).__qualname__}({len(value)})")
            for i, item in enumerate(value):
                walk(f"{path}[{i}]", item)
        else:
            raise Unsplittable(f"{path} is a {type(value).__qualname__} ({_short_repr(value)}), one value for the whole batch")

    try:
        walk("batch", batch)
    except Unsplittable:
        if not (isinstance(batch, (list, tuple)) and len(batch) == n):
            raise
        return [_whole(leaf_digests(item)) for item in batch]
    structure = "\n".join(shapes)
    return [_whole((hashlib.sha256("\n".join([structure] + [f"{p}\0{d}" for p, d in own]).encode()).hexdigest(), own))
            for own in parts]


def _whole(digests: tuple[str, list[tuple[str, str]]]) -> tuple[str, list[tuple[str, str]]]:
    whole, leaves = digests
    return whole, [(path.replace("batch", "sample", 1), d) for path, d in leaves]


def _short_repr(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
