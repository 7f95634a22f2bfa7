"""Raw access to Mersenne Twister states: Python's ``random.Random``, NumPy's legacy
``RandomState`` and torch's CPU generator, read and written as bytes in microseconds,
with every layout verified against the public API at import (NOTE [ raw RNG access ]).
Also a torch state's bytes, their packing and the check that torch accepts them.
``_rng/capture.py`` builds captures of the global generators on it, ``_rng/kinds.py`` those of
generator objects."""

from __future__ import annotations

import ctypes
import random
import struct
import sys
from array import array
from typing import Any, Final

import numpy as np
import torch

_MT_WORDS: Final = 624
_MT_BYTES: Final = (_MT_WORDS + 1) * 4  # 624 state words and a position
_GAUSS = struct.Struct("<Bd")  # has a cached gaussian, its value
_NO_GAUSS: Final = _GAUSS.pack(False, 0.0)
_TWIST_NEXT: Final = struct.pack("<i", _MT_WORDS)  # a position that twists before the next draw


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

    def write_words(self, words: memoryview) -> None:
        """Set the state to 624 given words (2,496 bytes), the position at "twist before
        the next draw", no cached gaussian: as seeding leaves it, without the seeding
        (NOTE [ cheap per-sample states ] in ``_rng/per_sample.py``)."""
        self.write(b"".join((_TWIST_NEXT, words, _NO_GAUSS)))


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


def _memory(address: int, size: int) -> memoryview:
    """A writable view of ``size`` bytes at ``address``, made once: reading it is
    ``tobytes()`` and writing a slice assignment, with no foreign call each time (a
    ctypes ``string_at`` or ``memmove`` costs about a microsecond a call). The caller
    keeps the object owning the memory alive."""
    return memoryview((ctypes.c_char * size).from_address(address)).cast("B")


class _PyRandomRaw(_MTAccess):
    # CPython's RandomObject: PyObject_HEAD, int index, uint32_t state[624].
    _OFFSET = 2 * ctypes.sizeof(ctypes.c_void_p)

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng  # owns the memory of the view
        self.state = _memory(id(rng) + self._OFFSET, _MT_BYTES)

    def read(self) -> bytes:
        gauss = self.rng.gauss_next  # type: ignore[attr-defined]
        tail = _NO_GAUSS if gauss is None else _GAUSS.pack(True, gauss)
        return self.state.tobytes() + tail

    def write(self, blob: bytes) -> None:
        self.state[:] = memoryview(blob)[:_MT_BYTES]
        has_gauss, gauss = _GAUSS.unpack_from(blob, _MT_BYTES)
        self.rng.gauss_next = gauss if has_gauss else None  # type: ignore[attr-defined]

    def write_words(self, words: memoryview) -> None:
        self.state[4:] = words
        self.state[:4] = _TWIST_NEXT
        self.rng.gauss_next = None  # type: ignore[attr-defined]


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


class _MT19937Raw(_MTAccess):
    # A numpy MT19937 bit generator's mt19937_state_t {uint32_t key[624]; int pos;}, read
    # as position first (_NumpySlow's layout). The address is fixed for the generator's
    # lifetime (seeding and set_state write into the same struct), so it is looked up
    # once: ``bit_generator.ctypes`` builds a new tuple on every access.
    def __init__(self, bit_generator: Any) -> None:
        self.bit_generator = bit_generator  # keeps the state struct alive
        state_address = bit_generator.ctypes.state_address
        self.keys = _memory(state_address, _MT_BYTES - 4)
        self.pos = _memory(state_address + _MT_BYTES - 4, 4)

    def read(self) -> bytes:
        return self.pos.tobytes() + self.keys.tobytes()

    def write(self, blob: bytes) -> None:
        view = memoryview(blob)
        self.keys[:] = view[4:_MT_BYTES]
        self.pos[:] = view[:4]


class _MT19937Public(_MTAccess):
    def __init__(self, bit_generator: Any) -> None:
        self.bit_generator = bit_generator

    def read(self) -> bytes:
        state = self.bit_generator.state["state"]
        return struct.pack("<i", state["pos"]) + state["key"].astype("<u4").tobytes()

    def write(self, blob: bytes) -> None:
        (pos,) = struct.unpack_from("<i", blob)
        key = np.frombuffer(blob, dtype="<u4", count=_MT_WORDS, offset=4).astype(np.uint32)
        self.bit_generator.state = {"bit_generator": "MT19937", "state": {"key": key, "pos": pos}}


class _NumpyRaw(_MTAccess):
    # A RandomState's MT19937 state (_MT19937Raw) and its legacy gaussian cache, which
    # lives in RandomState's aug_bitgen_t {bitgen_t *; int has_gauss; double gauss;} at
    # an offset found by _probe_numpy_gauss_offset.
    def __init__(self, rng: np.random.RandomState, gauss_offset: int) -> None:
        self.rng = rng
        self.twister = _MT19937Raw(rng._bit_generator)  # type: ignore[attr-defined]
        self.has_gauss = ctypes.c_int.from_address(id(rng) + gauss_offset)
        self.gauss = ctypes.c_double.from_address(id(rng) + gauss_offset + 8)

    def read(self) -> bytes:
        return self.twister.read() + _GAUSS.pack(self.has_gauss.value, self.gauss.value)

    def write(self, blob: bytes) -> None:
        self.twister.write(blob)
        has_gauss, gauss = _GAUSS.unpack_from(blob, _MT_BYTES)
        self.has_gauss.value = has_gauss
        self.gauss.value = gauss

    def write_words(self, words: memoryview) -> None:
        self.twister.keys[:] = words
        self.twister.pos[:] = _TWIST_NEXT
        self.has_gauss.value = 0


def agree(fast: Any, slow: Any, draw: Any) -> bool:
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

    if sys.implementation.name == "cpython" and agree(
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

    if agree(_NumpyRaw(rng, offset), _NumpySlow(rng), draw):
        return lambda r: _NumpyRaw(r, offset)
    return _NumpySlow


_python_rng: _MTAccess = _probe_python()(random._inst)  # type: ignore[attr-defined,call-arg]
_numpy_rng: _MTAccess = _probe_numpy()(np.random.mtrand._rand)
_PY_BLOB: Final = _MT_BYTES + _GAUSS.size
RAW_RNG_ACCESS: Final = isinstance(_python_rng, _PyRandomRaw) and isinstance(
    _numpy_rng, _NumpyRaw
)


def _probe_mt19937() -> type[_MTAccess]:
    try:
        generator = np.random.Generator(np.random.MT19937(7))
        fast, slow = _MT19937Raw(generator.bit_generator), _MT19937Public(generator.bit_generator)
    except Exception:  # any surprise in the layout means: use the public API
        return _MT19937Public
    return _MT19937Raw if agree(fast, slow, lambda: generator.random(700)) else _MT19937Public


_MT19937_ACCESS: Final = _probe_mt19937()


# torch's CPU generator state (5,056 bytes) keeps its 624 Mersenne Twister words as
# 64-bit integers holding 32-bit values: half of it is zeros. Dropping them keeps a
# checkpoint at 8 workers well under 64 KB. Same rule as NOTE [ raw RNG access ]: the
# layout is checked on throwaway generators at import, or the state is kept whole.
_TORCH_WORDS_AT: Final = 24  # seed (8), left (4), seeded (4), next (8)
_TORCH_WORDS_END: Final = _TORCH_WORDS_AT + _MT_WORDS * 8


def _pack_torch(state: bytes | np.ndarray) -> bytes:
    raw = np.frombuffer(state, dtype=np.uint8) if isinstance(state, bytes) else state
    words = raw[_TORCH_WORDS_AT:_TORCH_WORDS_END].view("<u4")[0::2]
    return raw[:_TORCH_WORDS_AT].tobytes() + words.tobytes() + raw[_TORCH_WORDS_END:].tobytes()


def _unpack_torch(packed: bytes) -> bytes:
    low_end = _TORCH_WORDS_AT + _MT_WORDS * 4
    words = np.zeros(2 * _MT_WORDS, dtype="<u4")
    words[0::2] = np.frombuffer(packed, dtype="<u4", count=_MT_WORDS, offset=_TORCH_WORDS_AT)
    return packed[:_TORCH_WORDS_AT] + words.tobytes() + packed[low_end:]


def _probe_torch_packing() -> bool:
    try:
        for seed in (1, 2**40 + 7, 12345):
            generator = torch.Generator().manual_seed(seed)
            torch.rand(1000, generator=generator)
            torch.randn(3, generator=generator)
            state = generator.get_state().numpy().tobytes()
            if len(state) < _TORCH_WORDS_END:
                return False
            high = np.frombuffer(state, dtype="<u4", count=2 * _MT_WORDS, offset=_TORCH_WORDS_AT)[1::2]
            if high.any() or _unpack_torch(_pack_torch(state)) != state:
                return False
            twin = torch.Generator()
            twin.set_state(torch.frombuffer(bytearray(_unpack_torch(_pack_torch(state))), dtype=torch.uint8))
            if not torch.equal(torch.rand(5, generator=generator), torch.rand(5, generator=twin)):
                return False
        return True
    except Exception:
        return False


_TORCH_PACKED: Final = _probe_torch_packing()


_TORCH_STATE_BYTES: Final = 5056


def torch_state_bytes(state: torch.Tensor) -> bytes:
    """The bytes of a torch CPU generator state (a uint8 tensor, as get_rng_state()
    returns and set_rng_state() takes), in one copy."""
    if state.dtype == torch.uint8 and state.is_contiguous():
        return ctypes.string_at(state.data_ptr(), state.numel())
    return state.numpy().tobytes()


def torch_state_tensor(packed: bytes) -> torch.Tensor:
    """The tensor set_rng_state() takes for a :func:`pack_torch_state` state."""
    return torch.frombuffer(bytearray(unpack_torch_state(packed)), dtype=torch.uint8)


def check_torch_state(packed: bytes, what: str) -> None:
    """Raise ValueError unless ``packed`` (a :func:`pack_torch_state` state) is one torch
    accepts; ``what`` names the generator in the message."""
    try:
        state = unpack_torch_state(packed)
        if len(state) != _TORCH_STATE_BYTES:
            raise ValueError(f"{len(state)} bytes")
        # torch range-checks the state it is given; a throwaway generator takes the blow.
        torch.Generator().set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
    except (ValueError, RuntimeError) as exc:
        raise ValueError(f"its {what} state is not one torch accepts ({exc})") from None


def pack_torch_state(state: bytes) -> bytes:
    """A torch CPU generator state without its always-zero half (when verified)."""
    return _pack_torch(state) if _TORCH_PACKED else state


def unpack_torch_state(packed: bytes) -> bytes:
    return _unpack_torch(packed) if _TORCH_PACKED else packed


# -- access to generator objects (``_rng/objects.py``) ----------------------------------
# The same verified raw access as the global generators get, for other instances.

PY_STATE_BYTES: Final = _PY_BLOB  # a random.Random or RandomState blob: position, words, gaussian


def python_rng_access(rng: random.Random) -> _MTAccess:
    """Raw (or, failing the import-time probe, public-API) access to ``rng``'s state."""
    return type(_python_rng)(rng)  # type: ignore[call-arg]


def legacy_numpy_access(rng: np.random.RandomState) -> _MTAccess:
    """Access to a RandomState over MT19937, as the global one is accessed."""
    if isinstance(_numpy_rng, _NumpyRaw):
        offset = ctypes.addressof(_numpy_rng.has_gauss) - id(_numpy_rng.rng)
        return _NumpyRaw(rng, offset)
    return _NumpySlow(rng)


MT19937_BYTES: Final = _MT_BYTES  # a numpy MT19937 blob: position, then 624 words


def mt19937_access(bit_generator: Any) -> _MTAccess:
    """Access to a numpy MT19937 bit generator's state (position first, then its 624
    words; no gaussian): raw, or failing the import-time probe, the public ``state``."""
    return _MT19937_ACCESS(bit_generator)  # type: ignore[call-arg]


def check_mt_blob(blob: bytes, what: str) -> None:
    """Raise ValueError unless ``blob`` is a :data:`PY_STATE_BYTES` state whose position
    and gaussian flag are in range (what a raw write trusts)."""
    if len(blob) != _PY_BLOB:
        raise ValueError(f"its {what} state has {len(blob)} bytes; expected {_PY_BLOB}")
    (position,) = struct.unpack_from("<i", blob)
    if not 0 <= position <= _MT_WORDS:
        raise ValueError(f"its {what} state has position {position}; expected 0 to {_MT_WORDS}")
    if blob[_MT_BYTES] > 1:
        raise ValueError(f"its {what} state has a gaussian flag of {blob[_MT_BYTES]}; expected 0 or 1")
