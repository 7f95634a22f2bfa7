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
    # offset found by _probe_numpy_gauss_offset. The addresses are fixed for the
    # generator's lifetime (seeding and set_state write into the same structs), so they
    # are looked up once: ``bit_generator.ctypes`` builds a new tuple on every access.
    def __init__(self, rng: np.random.RandomState, gauss_offset: int) -> None:
        self.rng = rng
        self.bit_generator = rng._bit_generator  # keeps the state struct alive
        self.state_address = self.bit_generator.ctypes.state_address
        self.pos_address = self.state_address + _MT_BYTES - 4
        self.has_gauss = ctypes.c_int.from_address(id(rng) + gauss_offset)
        self.gauss = ctypes.c_double.from_address(id(rng) + gauss_offset + 8)

    def read(self) -> bytes:
        keys_and_pos = ctypes.string_at(self.state_address, _MT_BYTES)
        # stored as pos first, to match _NumpySlow's layout
        return keys_and_pos[-4:] + keys_and_pos[:-4] + _GAUSS.pack(self.has_gauss.value, self.gauss.value)

    def write(self, blob: bytes) -> None:
        ctypes.memmove(self.state_address, blob[4:_MT_BYTES], _MT_BYTES - 4)
        ctypes.memmove(self.pos_address, blob, 4)
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


_TORCH_STATE_BYTES: Final = 5056


def check_rng(blob: bytes, seeded: bool) -> None:
    """Raise ValueError unless ``blob`` is a well-formed :func:`capture_rng` encoding
    (``seeded``: captured relative to a seed state). Every byte that ends up in a C
    struct is range-checked here, so a restore from a checked blob cannot corrupt
    memory: a Mersenne Twister position past its 624 words would make the next draw
    read past the end of the state array."""
    if not blob:
        raise ValueError("it is empty")
    flags = blob[0]
    if flags > 0b111 or (flags and not seeded):
        raise ValueError(f"its flags byte is {flags}; expected 0 to 7 (0 for a main-process state)")
    at = 1
    for bit, name in enumerate(("Python random", "NumPy")):
        if flags & (1 << bit):
            continue
        part = blob[at : at + _PY_BLOB]
        if len(part) != _PY_BLOB:
            raise ValueError(f"its {name} state is cut short ({len(part)} of {_PY_BLOB} bytes)")
        (position,) = struct.unpack_from("<i", part)
        if not 0 <= position <= _MT_WORDS:
            raise ValueError(f"its {name} state has position {position}; expected 0 to {_MT_WORDS}")
        if part[_MT_BYTES] > 1:
            raise ValueError(f"its {name} state has a gaussian flag of {part[_MT_BYTES]}; expected 0 or 1")
        at += _PY_BLOB
    if flags & 0b100:
        if at != len(blob):
            raise ValueError(f"it has {len(blob) - at} bytes after its last state")
        return
    try:
        state = unpack_torch_state(blob[at:])
        if len(state) != _TORCH_STATE_BYTES:
            raise ValueError(f"{len(state)} bytes")
        # torch range-checks the state it is given; a throwaway generator takes the blow.
        torch.Generator().set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
    except (ValueError, RuntimeError) as exc:
        raise ValueError(f"its torch state is not one torch accepts ({exc})") from None


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
        return NativeRng(_python_rng.read(), _numpy_rng.read(), torch.get_rng_state(), seed)

    def put(self) -> None:
        _python_rng.write(self.python)
        _numpy_rng.write(self.numpy)
        torch.set_rng_state(self.torch)

    def encode(self) -> bytes:
        raw = self.torch.numpy()
        torch_state = _pack_torch(raw) if _TORCH_PACKED else raw.tobytes()
        parts = (self.python, self.numpy, torch_state)
        if self.seed is None:
            return b"\x00" + b"".join(parts)
        flags = 0
        kept = []
        for bit, (part, seeded) in enumerate(zip(parts, _seed_parts(self.seed))):
            if part == seeded:
                flags |= 1 << bit
            else:
                kept.append(part)
        return bytes((flags,)) + b"".join(kept)

    @staticmethod
    def decode(blob: bytes, seed: bytes | None) -> NativeRng:
        check_rng(blob, seeded=seed is not None)
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
    return NativeRng.take(seed).encode()


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

    @staticmethod
    def check_state(state: bytes) -> None:
        """Raise ValueError unless ``state`` (from :meth:`get_state`) is one torch accepts."""
        check_rng(b"\x03" + state, seeded=True)  # the torch part alone

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


# -- access to generator objects (``_objects.py``) ----------------------------------
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
