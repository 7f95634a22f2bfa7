"""Capture and restore random number generator states, cheaply and as bytes.

A worker's snapshot after every batch holds the three global RNGs a dataset may draw
from (Python ``random``, NumPy's legacy global generator and torch's CPU generator),
encoded as raw bytes (at most 7.5 KB, microseconds), never as tensors or 625-element
tuples, so a snapshot costs almost nothing to pickle. :class:`RngSource` is the
generator an epoch's base seed and sampler draw from, in the main process.
"""

from __future__ import annotations

import ctypes
import random
import struct
import sys
from array import array
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Final

import numpy as np
import torch

_MT_WORDS: Final = 624
_MT_BYTES: Final = (_MT_WORDS + 1) * 4  # 624 state words and a position
_GAUSS = struct.Struct("<Bd")  # has a cached gaussian, its value
_NO_GAUSS: Final = _GAUSS.pack(False, 0.0)


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
    # offset found by _probe_numpy_gauss_offset. The addresses are fixed for the
    # generator's lifetime (seeding and set_state write into the same structs), so they
    # are looked up once: ``bit_generator.ctypes`` builds a new tuple on every access.
    def __init__(self, rng: np.random.RandomState, gauss_offset: int) -> None:
        self.rng = rng
        self.bit_generator = rng._bit_generator  # keeps the state struct alive
        state_address = self.bit_generator.ctypes.state_address
        self.keys = _memory(state_address, _MT_BYTES - 4)
        self.pos = _memory(state_address + _MT_BYTES - 4, 4)
        self.has_gauss = ctypes.c_int.from_address(id(rng) + gauss_offset)
        self.gauss = ctypes.c_double.from_address(id(rng) + gauss_offset + 8)

    def read(self) -> bytes:
        # stored as pos first, to match _NumpySlow's layout
        return self.pos.tobytes() + self.keys.tobytes() + _GAUSS.pack(self.has_gauss.value, self.gauss.value)

    def write(self, blob: bytes) -> None:
        view = memoryview(blob)
        self.keys[:] = view[4:_MT_BYTES]
        self.pos[:] = view[:4]
        has_gauss, gauss = _GAUSS.unpack_from(blob, _MT_BYTES)
        self.has_gauss.value = has_gauss
        self.gauss.value = gauss


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


def pack_torch_state(state: bytes) -> bytes:
    """A torch CPU generator state without its always-zero half (when verified)."""
    return _pack_torch(state) if _TORCH_PACKED else state


def unpack_torch_state(packed: bytes) -> bytes:
    return _unpack_torch(packed) if _TORCH_PACKED else packed


def _parts(full: bytes) -> tuple[bytes, bytes, bytes]:
    return full[:_PY_BLOB], full[_PY_BLOB : 2 * _PY_BLOB], full[2 * _PY_BLOB :]


_seed_cache: tuple[bytes, tuple[bytes, bytes, bytes]] = (b"", (b"", b"", b""))


def _seed_parts(seed: bytes) -> tuple[bytes, bytes, bytes]:
    # A worker passes the same seed object after every batch: split it once.
    global _seed_cache
    if _seed_cache[0] is not seed:
        _seed_cache = (seed, _parts(seed[1:]))
    return _seed_cache[1]


# NOTE [ capture only what changed ]
# Most datasets draw from one global RNG or none, so between two batches most of the
# three states are unchanged. Reading a state is a copy of a few KB (cheap); packing
# torch's (dropping its zero half) and joining the parts are what cost, so both are
# done only for a state that differs from the last one this process encoded: equal
# bytes are compared (memcmp) and the last packed part, or the whole last encoding, is
# reused. Each cache is one tuple, replaced whole, so a capture on another thread (a
# state_dict() at num_workers=0) can only miss it, never read half of it.
_torch_get_state: Final = torch.default_generator.get_state  # torch.get_rng_state, less a call
_last_torch: tuple[bytes, bytes] = (b"", b"")  # raw state, packed
_last_encoding: tuple[bytes | None, bytes, bytes, bytes, bytes] = (None, b"", b"", b"", b"")


def _tensor_bytes(state: torch.Tensor) -> bytes:
    """The bytes of a torch CPU generator state (a uint8 tensor, as get_rng_state()
    returns and set_rng_state() takes), in one copy."""
    if state.dtype == torch.uint8 and state.is_contiguous():
        return ctypes.string_at(state.data_ptr(), state.numel())
    return state.numpy().tobytes()


def _packed_torch(raw: bytes) -> bytes:
    """``pack_torch_state(raw)``, the same object as last time when ``raw`` is unchanged."""
    global _last_torch
    last = _last_torch
    if raw == last[0]:
        return last[1]
    packed = _pack_torch(raw) if _TORCH_PACKED else raw
    _last_torch = (raw, packed)
    return packed


def _encode(python: bytes, numpy: bytes, torch_packed: bytes, seed: bytes | None) -> bytes:
    """The three states as one bytes object (the layout :meth:`NativeRng.decode` reads):
    a flags byte (bit i: part i equals the seed state's, and is left out), the rest."""
    global _last_encoding
    last = _last_encoding
    if seed is last[0] and torch_packed is last[3] and python == last[1] and numpy == last[2]:
        return last[4]
    parts = (python, numpy, torch_packed)
    if seed is None:
        blob = b"\x00" + b"".join(parts)
    else:
        flags = 0
        kept = []
        for bit, (part, seeded) in enumerate(zip(parts, _seed_parts(seed))):
            if part == seeded:
                flags |= 1 << bit
            else:
                kept.append(part)
        blob = bytes((flags,)) + b"".join(kept)
    _last_encoding = (seed, python, numpy, torch_packed, blob)
    return blob


class NativeRng:
    """The three global RNG states of this process as read, not yet encoded.

    Taking and putting back one of these is the cheapest swap there is (the
    ``num_workers=0`` runner does it around every batch); :meth:`encode` turns it into
    :func:`capture_rng`'s bytes only when a checkpoint needs them. ``seed`` is the
    capture taken right after seeding that the encoding is relative to, or None.
    """

    __slots__ = ("python", "numpy", "torch", "seed")

    def __init__(self, python: bytes, numpy: bytes, torch_state: torch.Tensor, seed: bytes | None) -> None:
        self.python = python
        self.numpy = numpy
        self.torch = torch_state
        self.seed = seed

    @staticmethod
    def take(seed: bytes | None = None) -> NativeRng:
        return NativeRng(_python_rng.read(), _numpy_rng.read(), _torch_get_state(), seed)

    def put(self) -> None:
        _python_rng.write(self.python)
        _numpy_rng.write(self.numpy)
        torch.set_rng_state(self.torch)

    def encode(self) -> bytes:
        return _encode(self.python, self.numpy, _packed_torch(_tensor_bytes(self.torch)), self.seed)

    @staticmethod
    def decode(blob: bytes, seed: bytes | None) -> NativeRng:
        flags, rest = blob[0], blob[1:]
        if flags:
            if seed is None:
                raise ValueError("this RNG state was captured relative to a seed state; pass it")
            seed_parts = _seed_parts(seed)
            parts = []
            for bit, size in enumerate((_PY_BLOB, _PY_BLOB, None)):
                if flags & (1 << bit):
                    parts.append(seed_parts[bit])
                else:
                    parts.append(rest[:size] if size is not None else rest)
                    rest = rest[size:] if size is not None else b""
            py, npb, torch_state = parts
        else:
            py, npb, torch_state = _parts(rest)
        tensor = torch.frombuffer(bytearray(unpack_torch_state(torch_state)), dtype=torch.uint8)
        return NativeRng(py, npb, tensor, seed)


RngState = bytes | NativeRng


def capture_rng(seed: bytes | None = None) -> bytes:
    """The three global RNG states of this process, encoded as one bytes object.

    With ``seed`` (a capture taken right after seeding), a generator still in its seed
    state is written as a flag, not 2.5 KB: most datasets draw from one generator or
    none, and their snapshots and checkpoints shrink accordingly.
    """
    torch_raw = _tensor_bytes(_torch_get_state())
    return _encode(_python_rng.read(), _numpy_rng.read(), _packed_torch(torch_raw), seed)


def restore_rng(state: RngState, seed: bytes | None = None) -> None:
    """Set this process's three global RNGs to ``state``: a :class:`NativeRng`, or bytes
    made by :func:`capture_rng` (with the same ``seed`` it was captured with)."""
    native = state if isinstance(state, NativeRng) else NativeRng.decode(state, seed)
    native.put()


def rng_bytes(state: RngState) -> bytes:
    """``state`` encoded as :func:`capture_rng` encodes it."""
    return state.encode() if isinstance(state, NativeRng) else state


class RngSource:
    """The generator an epoch's base seed and default sampler draw from: the loader's
    ``generator``, or torch's global RNG when there is none.

    Its state at the epoch start is saved in the checkpoint; restoring sets it back and
    repeats the same draws (the workers' base seed, then the sampler's), so the
    generator ends the epoch where the uninterrupted run leaves it. torch's global RNG
    belongs to the training loop, so it is only borrowed for those draws and then put
    back (:meth:`replaying`).
    """

    def __init__(self, generator: torch.Generator | None) -> None:
        self.generator = generator

    @property
    def kind(self) -> str:
        return "global" if self.generator is None else "generator"

    def get_state(self) -> bytes:
        state = torch.get_rng_state() if self.generator is None else self.generator.get_state()
        return pack_torch_state(state.numpy().tobytes())

    def set_state(self, state: bytes) -> None:
        tensor = torch.frombuffer(bytearray(unpack_torch_state(state)), dtype=torch.uint8)
        if self.generator is None:
            torch.set_rng_state(tensor)
        else:
            self.generator.set_state(tensor)

    def draw_base_seed(self) -> int:
        # The same draw, from the same generator, in the same order as torch's
        # _BaseDataLoaderIter.__init__.
        return int(torch.empty((), dtype=torch.int64).random_(generator=self.generator).item())

    @contextmanager
    def replaying(self, state: bytes) -> Iterator[None]:
        """Run the body with the source set to ``state``. The global RNG is handed back
        to the training loop afterwards as it was; a generator keeps what the body
        drew, as in the uninterrupted run."""
        saved = torch.get_rng_state() if self.generator is None else None
        self.set_state(state)
        try:
            yield
        finally:
            if saved is not None:
                torch.set_rng_state(saved)
