"""Plain data: what a checkpoint may hold, and the JSON-safe encoding of user state.

A checkpoint holds only dict (str keys), list, str, int, float, bool and None, so that
``json.dumps`` works, ``json.loads`` of it gives it back equal, and
``torch.load(weights_only=True)`` loads it. What a dataset's, iterator's or sampler's
own ``state_dict()`` returns may hold more (bytes, tuples, tensors, int keys);
:func:`encode` turns it into JSON-safe values with tagged dicts, and :func:`decode`
gives the user's object back exactly as it was returned. Also the one conversion of a
tensor to its raw bytes and back, which result messages and ``verify`` use too.

    bytes            {"__snaploader__": "bytes", "b64": ...}
    tuple            {"__snaploader__": "tuple", "items": [...]}
    tensor (CPU)     {"__snaploader__": "tensor", "dtype": "float32", "shape": [...], "b64": ...}
    a dict that is not str-keyed, or has the tag key itself
                     {"__snaploader__": "dict", "items": [[key, value], ...]}
"""

from __future__ import annotations

import base64
import binascii
from typing import Any, Final

import numpy as np
import torch

from .._errors import CheckpointFormatError, StateNotPlainDataError

TAG: Final = "__snaploader__"
_JSON_SCALARS: Final = (str, int, float, bool, type(None))
_ACCEPTED: Final = (
    "dicts (str or int keys), lists, tuples, numbers, str, bytes, None and CPU tensors"
)


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def unb64(text: str, where: str) -> bytes:
    """The bytes of a base64 string; ValueError naming ``where`` when it is not one."""
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError):
        raise ValueError(f"{where} is not valid base64") from None


def nested_deeper(value: Any, limit: int) -> bool:
    """True when ``value`` nests dicts and lists more than ``limit`` deep. Iterative, so
    it never hits the recursion limit itself (NOTE [ checkpoint limits ])."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        if isinstance(item, dict):
            stack.extend((child, depth + 1) for child in item.values() if isinstance(child, (dict, list)))
        elif isinstance(item, list):
            stack.extend((child, depth + 1) for child in item if isinstance(child, (dict, list)))
    return False


def check_plain(value: Any, where: str) -> None:
    """Raise :class:`StateNotPlainDataError` unless :func:`encode` can store ``value``."""
    if isinstance(value, _JSON_SCALARS) or isinstance(value, bytes):
        return
    if isinstance(value, torch.Tensor):
        if value.layout != torch.strided or value.is_quantized:
            raise StateNotPlainDataError(
                f"{where} is a {value.layout} or quantized tensor; store a dense one"
            )
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, (str, int)) or isinstance(key, bool):
                raise StateNotPlainDataError(
                    f"{where} has a key of type {type(key).__name__} ({key!r}); "
                    "use str or int keys so the checkpoint stays plain data"
                )
            check_plain(item, f"{where}[{key!r}]")
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_plain(item, f"{where}[{i}]")
        return
    hint = ""
    if isinstance(value, np.ndarray):
        hint = " (convert NumPy arrays with torch.from_numpy or .tolist())"
    elif isinstance(value, np.generic):
        hint = " (convert NumPy scalars with .item())"
    elif isinstance(value, np.random.Generator):
        hint = " (save generator.bit_generator.state instead)"
    raise StateNotPlainDataError(
        f"{where} holds a {type(value).__module__}.{type(value).__qualname__}, which a "
        f"checkpoint cannot hold as plain data (torch.load(weights_only=True) and json refuse it){hint}; return only {_ACCEPTED} from "
        "state_dict()"
    )


def encode(value: Any) -> Any:
    """``value`` (checked by :func:`check_plain`) as JSON-safe data."""
    if isinstance(value, _JSON_SCALARS):
        return value
    if isinstance(value, list):
        return [encode(item) for item in value]
    if isinstance(value, dict):
        if TAG not in value and all(type(key) is str for key in value):
            return {key: encode(item) for key, item in value.items()}
        return {TAG: "dict", "items": [[encode(key), encode(item)] for key, item in value.items()]}
    if isinstance(value, tuple):
        return {TAG: "tuple", "items": [encode(item) for item in value]}
    if isinstance(value, bytes):
        return {TAG: "bytes", "b64": b64(value)}
    if isinstance(value, torch.Tensor):
        raw = tensor_bytes(value)
        return {
            TAG: "tensor",
            "dtype": str(value.dtype).removeprefix("torch."),
            "shape": list(value.shape),
            "b64": b64(raw),
        }
    raise StateNotPlainDataError(f"a {type(value).__name__} cannot be stored; store {_ACCEPTED}")


def decode(value: Any, where: str) -> Any:
    """The user's object that :func:`encode` stored; ValueError naming the key path
    when ``value`` is not something :func:`encode` makes."""
    if isinstance(value, _JSON_SCALARS):
        return value
    if isinstance(value, list):
        return [decode(item, f"{where}[{i}]") for i, item in enumerate(value)]
    if not isinstance(value, dict):
        raise ValueError(f"{where} is a {type(value).__name__}, which a checkpoint does not hold")
    if TAG not in value:
        return {key: decode(item, f"{where}[{key!r}]") for key, item in value.items()}
    kind = value[TAG]
    if kind == "dict" and isinstance(value.get("items"), list):
        out = {}
        for i, pair in enumerate(value["items"]):
            if not (isinstance(pair, list) and len(pair) == 2):
                raise ValueError(f"{where}['items'][{i}] should be a [key, value] pair")
            key = decode(pair[0], f"{where}['items'][{i}][0]")
            if not isinstance(key, (str, int)):
                raise ValueError(f"{where}['items'][{i}] has a {type(key).__name__} key")
            out[key] = decode(pair[1], f"{where}[{key!r}]")
        return out
    if kind == "tuple" and isinstance(value.get("items"), list):
        return tuple(decode(item, f"{where}[{i}]") for i, item in enumerate(value["items"]))
    if kind == "bytes" and isinstance(value.get("b64"), str):
        return unb64(value["b64"], f"{where}['b64']")
    if kind == "tensor":
        return _decode_tensor(value, where)
    raise ValueError(f"{where} is tagged {kind!r}, which this snaploader does not know")


def _decode_tensor(value: dict[str, Any], where: str) -> torch.Tensor:
    dtype = getattr(torch, str(value.get("dtype")), None)
    shape = value.get("shape")
    if not isinstance(dtype, torch.dtype) or not (
        isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape)
    ):
        raise ValueError(f"{where} has a dtype or shape that is not a tensor's")
    text = value.get("b64")
    raw = unb64(text if isinstance(text, str) else "?", f"{where}['b64']")
    count = 1
    for n in shape:
        count *= n
    itemsize = torch.empty((), dtype=dtype).element_size()
    if len(raw) != count * itemsize:
        raise ValueError(f"{where} holds {len(raw)} bytes for a {dtype} tensor of shape {shape}")
    return tensor_from_bytes(raw, dtype, tuple(shape))


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """A dense tensor's raw bytes in element order. view(uint8) reads any dtype's bytes
    (bfloat16 and bool included), which .numpy() would refuse for some."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def tensor_from_bytes(raw: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The tensor whose :func:`tensor_bytes` are ``raw`` (a copy: it owns its memory)."""
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape)


# The deepest nesting a checkpoint may hold (NOTE [ checkpoint limits ] in
# _format/checkpoint.py): checked on load before anything recursive runs.
MAX_DEPTH: Final = 100
# A user's state sits this deep in a checkpoint at most (workers, ledger, snapshot, data).
_USER_DEPTH: Final = MAX_DEPTH - 8


def check_depth(value: Any, where: str = "loader state") -> None:
    """Raise :class:`CheckpointFormatError` when ``value`` nests dicts and lists deeper
    than ``MAX_DEPTH``. Iterative: it must not itself hit the recursion limit."""
    if nested_deeper(value, MAX_DEPTH):
        raise CheckpointFormatError(
            f"{where} nests dicts and lists more than {MAX_DEPTH} deep, which snaploader never "
            "writes; it was crafted or corrupted"
        )


def check_user_depth(encoded: Any, where: str) -> None:
    """Refuse, when a checkpoint is made, a user's state (as encoded) that nests too
    deep for the checkpoint to load."""
    if nested_deeper(encoded, _USER_DEPTH):
        raise StateNotPlainDataError(
            f"{where} nests dicts, lists and tuples more than {_USER_DEPTH} deep in all (a "
            f"tuple or a dict with non-str keys counts twice); a checkpoint holds at most "
            f"{MAX_DEPTH} levels: flatten the state"
        )
