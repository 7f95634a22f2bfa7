"""Capture and restore the state a worker needs to produce its next batch.

A snapshot is taken in the worker after every batch (the barrier): the three global
RNGs a dataset may draw from (Python ``random``, NumPy's legacy global generator and
torch's CPU generator), the position of the worker in its epoch (batches produced) and,
when the dataset or its iterator implements ``state_dict()``/``load_state_dict()``, that
state too. RNG states travel as raw bytes (about 10 KB, a few microseconds), never as
tensors or 625-element tuples, so a snapshot costs almost nothing to pickle and is plain
data for ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import ctypes
import random
import struct
import sys
from array import array
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import torch

from .errors import StateNotPlainDataError

_MT_WORDS: Final = 624
_MT_BYTES: Final = (_MT_WORDS + 1) * 4  # 624 state words and a position
_GAUSS = struct.Struct("<Bd")  # has a cached gaussian, its value


# NOTE [ raw RNG access ]
# random.getstate() builds a 625-tuple (~20 us) and numpy's get_state() builds a dict
# and copies arrays (~60 us); a snapshot after every batch cannot afford either. Both
# generators keep their Mersenne Twister state in a fixed C struct, so we copy those
# 2,500 bytes directly. The offsets are not guessed: _probe_* finds them on a throwaway
# generator at import and checks a round trip against the public API; if anything
# does not match (another Python or NumPy build), the slow public API is used instead.


class _MTAccess:
    """Reads and writes one Mersenne Twister state (plus cached gaussian) as bytes."""

    def read(self) -> bytes:
        raise NotImplementedError

    def write(self, blob: bytes) -> None:
        raise NotImplementedError


class _PyRandomSlow(_MTAccess):
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def read(self) -> bytes:
        _, words, gauss = self.rng.getstate()
        raw = array("I", words[-1:] + words[:-1]).tobytes()
        return raw + _GAUSS.pack(gauss is not None, gauss or 0.0)

    def write(self, blob: bytes) -> None:
        words = array("I")
        words.frombytes(blob[:_MT_BYTES])
        has_gauss, gauss = _GAUSS.unpack_from(blob, _MT_BYTES)
        state = tuple(words[1:]) + (words[0],)
        self.rng.setstate((3, state, gauss if has_gauss else None))


class _PyRandomRaw(_MTAccess):
    # CPython's RandomObject: PyObject_HEAD, int index, uint32_t state[624].
    _OFFSET = 2 * ctypes.sizeof(ctypes.c_void_p)

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.address = id(rng) + self._OFFSET

    def read(self) -> bytes:
        gauss = self.rng.gauss_next  # type: ignore[attr-defined]
        tail = _GAUSS.pack(gauss is not None, gauss or 0.0)
        return ctypes.string_at(self.address, _MT_BYTES) + tail

    def write(self, blob: bytes) -> None:
        ctypes.memmove(self.address, blob, _MT_BYTES)
        has_gauss, gauss = _GAUSS.unpack_from(blob, _MT_BYTES)
        self.rng.gauss_next = gauss if has_gauss else None  # type: ignore[attr-defined]


class _NumpySlow(_MTAccess):
    def __init__(self, rng: np.random.RandomState) -> None:
        self.rng = rng

    def read(self) -> bytes:
        _, keys, pos, has_gauss, cached = self.rng.get_state(legacy=True)
        assert isinstance(keys, np.ndarray)
        return struct.pack("<i", pos) + keys.tobytes() + _GAUSS.pack(has_gauss, cached)

    def write(self, blob: bytes) -> None:
        (pos,) = struct.unpack_from("<i", blob)
        keys = np.frombuffer(blob[4:_MT_BYTES], dtype=np.uint32)
        has_gauss, gauss = _GAUSS.unpack_from(blob, _MT_BYTES)
        self.rng.set_state(("MT19937", keys, pos, has_gauss, gauss))


class _NumpyRaw(_MTAccess):
    # mt19937_state_t is {uint32_t key[624]; int pos;}; the legacy gaussian cache lives
    # in RandomState's aug_bitgen_t {bitgen_t *; int has_gauss; double gauss;} at an
    # offset found by _probe_numpy_gauss_offset.
    def __init__(self, rng: np.random.RandomState, gauss_offset: int) -> None:
        self.rng = rng
        self.has_gauss_address = id(rng) + gauss_offset
        self.gauss_address = self.has_gauss_address + 8

    def read(self) -> bytes:
        state = self.rng._bit_generator.ctypes.state_address
        keys_and_pos = ctypes.string_at(state, _MT_BYTES)
        # stored as pos first, to match _NumpySlow's layout
        has_gauss = ctypes.c_int.from_address(self.has_gauss_address).value
        gauss = ctypes.c_double.from_address(self.gauss_address).value
        return keys_and_pos[-4:] + keys_and_pos[:-4] + _GAUSS.pack(has_gauss, gauss)

    def write(self, blob: bytes) -> None:
        state = self.rng._bit_generator.ctypes.state_address
        ctypes.memmove(state, blob[4:_MT_BYTES], _MT_BYTES - 4)
        ctypes.memmove(state + _MT_BYTES - 4, blob[:4], 4)
        has_gauss, gauss = _GAUSS.unpack_from(blob, _MT_BYTES)
        ctypes.c_int.from_address(self.has_gauss_address).value = has_gauss
        ctypes.c_double.from_address(self.gauss_address).value = gauss


def _agree(fast: _MTAccess, slow: _MTAccess, draw: Any) -> bool:
    """True when ``fast`` reads and writes exactly what ``slow`` (the public API) does,
    with and without a cached gaussian."""
    try:
        for _ in range(2):
            draw()
            if fast.read() != slow.read():
                return False
            saved = slow.read()
            draw()
            fast.write(saved)
            if slow.read() != saved:
                return False
        return True
    except Exception:  # any surprise in the layout means: use the public API
        return False


def _probe_python() -> type[_MTAccess]:
    rng = random.Random(1234)

    def draw() -> None:
        rng.random()
        rng.gauss(0.0, 1.0)

    if sys.implementation.name == "cpython" and _agree(
        _PyRandomRaw(rng), _PyRandomSlow(rng), draw
    ):
        return _PyRandomRaw
    return _PyRandomSlow


def _probe_numpy_gauss_offset() -> int | None:
    """Offset of ``has_gauss`` inside a RandomState object, or None if not found."""
    rng = np.random.RandomState(1234)
    rng.standard_normal()  # leaves a cached gaussian
    _, _, _, has_gauss, gauss = rng.get_state(legacy=True)
    if has_gauss != 1:
        return None
    needle = struct.pack("<i4xd", 1, gauss)
    try:
        head = ctypes.string_at(id(rng), 256)
    except Exception:
        return None
    offset = head.find(needle)
    if offset < 0 or head.find(needle, offset + 1) >= 0:
        return None
    return offset


def _probe_numpy() -> Any:
    offset = _probe_numpy_gauss_offset()
    if offset is None:
        return _NumpySlow
    rng = np.random.RandomState(99)

    def draw() -> None:
        rng.random_sample()
        rng.standard_normal()

    if _agree(_NumpyRaw(rng, offset), _NumpySlow(rng), draw):
        return lambda r: _NumpyRaw(r, offset)
    return _NumpySlow


_python_rng: _MTAccess = _probe_python()(random._inst)  # type: ignore[attr-defined,call-arg]
_numpy_rng: _MTAccess = _probe_numpy()(np.random.mtrand._rand)
_PY_BLOB: Final = _MT_BYTES + _GAUSS.size
RAW_RNG_ACCESS: Final = isinstance(_python_rng, _PyRandomRaw) and isinstance(
    _numpy_rng, _NumpyRaw
)


def capture_rng() -> bytes:
    """The three global RNG states of this process, encoded as one bytes object."""
    torch_state = torch.get_rng_state().numpy().tobytes()
    return _python_rng.read() + _numpy_rng.read() + torch_state


def restore_rng(blob: bytes) -> None:
    """Set this process's three global RNGs to a state made by :func:`capture_rng`."""
    _python_rng.write(blob[:_PY_BLOB])
    _numpy_rng.write(blob[_PY_BLOB : 2 * _PY_BLOB])
    torch.set_rng_state(torch.frombuffer(bytearray(blob[2 * _PY_BLOB :]), dtype=torch.uint8))


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What a worker needs to produce its next batch, taken right after a batch.

    ``produced`` counts the batches this worker produced in the current epoch.
    ``data`` is the dataset's or iterator's ``state_dict()`` (``data_owner`` says
    which), or None. ``complete`` is True when the snapshot alone positions the worker;
    False when an iterable dataset must be replayed from an earlier complete snapshot
    (or the epoch start) up to ``produced`` batches. ``exhausted`` marks the snapshot an
    iterable worker sends when its iterator ran dry.
    """

    rng: bytes
    produced: int
    data: Any = None
    data_owner: str | None = None
    complete: bool = True
    exhausted: bool = False

    def to_plain(self) -> dict[str, Any]:
        return {
            "rng": self.rng,
            "produced": self.produced,
            "data": self.data,
            "data_owner": self.data_owner,
            "complete": self.complete,
            "exhausted": self.exhausted,
        }

    @staticmethod
    def from_plain(plain: dict[str, Any]) -> Snapshot:
        return Snapshot(
            rng=bytes(plain["rng"]),
            produced=int(plain["produced"]),
            data=plain["data"],
            data_owner=plain["data_owner"],
            complete=bool(plain["complete"]),
            exhausted=bool(plain["exhausted"]),
        )


_PLAIN_SCALARS = (int, float, bool, str, bytes, type(None), torch.Tensor)


def check_plain(value: Any, where: str) -> None:
    """Raise :class:`StateNotPlainDataError` unless ``value`` is checkpointable plain
    data: nested dicts (str/int keys), lists and tuples of ints, floats, bools, str,
    bytes, None and tensors."""
    if isinstance(value, _PLAIN_SCALARS):
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, (str, int)):
                raise StateNotPlainDataError(
                    f"{where} has a key of type {type(key).__name__} ({key!r}); "
                    "use str or int keys so the checkpoint loads with weights_only=True"
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
        f"{where} holds a {type(value).__module__}.{type(value).__qualname__}, which "
        f"torch.load(weights_only=True) refuses{hint}; return only dicts, lists, "
        "numbers, str, bytes, None and tensors from state_dict()"
    )


