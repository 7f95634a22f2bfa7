"""Decoding a sample's members by extension, for ``ShardStream(map=...)``.

:class:`Decoder` takes handlers with webdataset's signature, ``handler(".ext", data)``
returning the decoded value or None to pass, so ``webdataset.autodecode``'s handlers
(``imagehandler("rgb")``, ``basichandlers``, ``torch_video``...) work unchanged where
webdataset is installed; a ``webdataset.autodecode.Decoder`` is itself a valid ``map``.
Without webdataset, :func:`decode` (``Decoder()``) decodes the common extensions:
``.npy``, ``.json``, ``.txt``/``.text``, ``.cls``/``.cls2``/``.index`` and images
through PIL when it is installed.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["Decoder", "decode", "plain_handler"]

Handler = Callable[[str, bytes], Any]

_IMAGES = frozenset({"jpg", "jpeg", "png", "ppm", "pgm", "pbm", "pnm", "bmp", "webp", "tif", "tiff", "gif"})
_TEXT = frozenset({"txt", "text", "transcript"})
_INTS = frozenset({"cls", "cls2", "class", "count", "index", "inx", "id"})


def _last(ext: str) -> str:
    return ext.rsplit(".", 1)[-1].lower()


def plain_handler(key: str, data: bytes) -> Any:
    """The plain decoders by extension (``.npy``, ``.json``, text, class labels), or
    None for an extension it does not know."""
    ext = _last(key)
    if ext == "npy":
        return np.load(io.BytesIO(data), allow_pickle=False)
    if ext == "json":
        return json.loads(data)
    if ext in _TEXT:
        return data.decode("utf-8")
    if ext in _INTS:
        return int(data)
    return None


def pil_handler(mode: str) -> Handler:
    """Images as PIL images (``mode="pil"``) or uint8 HWC arrays (``mode="numpy"``)."""
    def handler(key: str, data: bytes) -> Any:
        if _last(key) not in _IMAGES:
            return None
        try:
            from PIL import Image
        except ImportError:
            raise ImportError(
                f"a sample member {key!r} is an image, which Decoder reads with PIL, and PIL is "
                "not installed: pip install pillow, or Decoder(image=None) to keep its bytes"
            ) from None
        with Image.open(io.BytesIO(data)) as image:
            image.load()
            return np.asarray(image) if mode == "numpy" else image.copy()
    return handler


class Decoder:
    """``Decoder(*handlers, image="pil")(sample)``: each member of ``sample`` (its
    ``__key__`` and ``__url__`` aside) decoded by the first handler that returns
    something other than None, then by the plain ones; a member no handler knows stays
    bytes. ``image``: ``"pil"``, ``"numpy"``, or None to leave images as bytes."""

    def __init__(self, *handlers: Handler, image: str | None = "pil") -> None:
        if image not in ("pil", "numpy", None):
            raise ValueError(f"image should be 'pil', 'numpy' or None, got {image!r}")
        self.handlers: tuple[Handler, ...] = handlers + (plain_handler,)
        if image is not None:
            self.handlers += (pil_handler(image),)

    def decode_one(self, ext: str, data: bytes) -> Any:
        key = "." + ext
        for handler in self.handlers:
            result = handler(key, data)
            if type(result).__name__ == "Continue":  # webdataset's: go on with new data
                key, data = result.key, result.data
                continue
            if result is not None:
                return result
        return data

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        decoded = {}
        for ext, data in sample.items():
            if ext.startswith("__") or not isinstance(data, bytes):
                decoded[ext] = data
                continue
            try:
                decoded[ext] = self.decode_one(ext, data)
            except Exception as exc:
                exc.add_note(
                    f"while decoding member {ext!r} of sample {sample.get('__key__')!r} of shard "
                    f"{sample.get('__url__')}"
                )
                raise
        return decoded


decode: Callable[[dict[str, Any]], dict[str, Any]] = Decoder()
"""The plain decoders, images as PIL images: ``ShardStream(urls, map=decode)``."""
