"""Capture and restore the state a worker needs to produce its next batch.

A snapshot is taken in the worker after every batch (the barrier): the three global
RNGs a dataset may draw from (Python ``random``, NumPy's legacy global generator and
torch's CPU generator), the position of the worker in its epoch (batches produced) and,
when the dataset or its iterator implements ``state_dict()``/``load_state_dict()``, that
state too. RNG states travel as raw bytes (at most 7.5 KB, microseconds), never as
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


def capture_rng(seed: bytes | None = None) -> bytes:
    """The three global RNG states of this process, encoded as one bytes object.

    With ``seed`` (a capture taken right after seeding), a generator still in its seed
    state is written as a flag, not 2.5 KB: most datasets draw from one generator or
    none, and their snapshots and checkpoints shrink accordingly.
    """
    torch_raw = torch.get_rng_state().numpy()
    torch_state = _pack_torch(torch_raw) if _TORCH_PACKED else torch_raw.tobytes()
    parts = (_python_rng.read(), _numpy_rng.read(), torch_state)
    if seed is None:
        return b"\x00" + b"".join(parts)
    seed_parts = _seed_parts(seed)
    flags = 0
    kept = []
    for bit, (part, seeded) in enumerate(zip(parts, seed_parts)):
        if part == seeded:
            flags |= 1 << bit
        else:
            kept.append(part)
    return bytes((flags,)) + b"".join(kept)


def restore_rng(blob: bytes, seed: bytes | None = None) -> None:
    """Set this process's three global RNGs to a state made by :func:`capture_rng`
    (with the same ``seed`` it was captured with)."""
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
    _python_rng.write(py)
    _numpy_rng.write(npb)
    torch_state = unpack_torch_state(torch_state)
    torch.set_rng_state(torch.frombuffer(bytearray(torch_state), dtype=torch.uint8))


def rng_to_plain(blob: bytes) -> torch.Tensor:
    """RNG bytes as a uint8 tensor: torch.save stores tensors raw, while its pickle
    protocol 2 stores ``bytes`` as latin-1 text, 1.6 times larger."""
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8)


def rng_from_plain(value: bytes | torch.Tensor) -> bytes:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", torch.uint8).contiguous().numpy().tobytes()
    return bytes(value)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What a worker needs to produce its next batch, taken right after a batch.

    ``produced`` counts the batches this worker produced in the current epoch.
    ``data`` is the dataset's or iterator's ``state_dict()`` (``data_owner`` says
    which), or None. ``complete`` is True when the snapshot alone positions the worker;
    False when an iterable dataset must be replayed from an earlier complete snapshot
    (or the epoch start) up to ``produced`` batches; ``data_owner`` is set then too
    when the dataset has the state protocol (``snapshot_every`` > 1 skipped this one),
    None when it has not (a replay for want of it). ``exhausted`` marks the snapshot
    after an iterable worker's last batch of the epoch: the one its iterator ran dry
    in (a short batch), or its "exhausted" reply.
    """

    rng: bytes
    produced: int
    data: Any = None
    data_owner: str | None = None
    complete: bool = True
    exhausted: bool = False

    def to_plain(self) -> dict[str, Any]:
        return {
            "rng": rng_to_plain(self.rng),
            "produced": self.produced,
            "data": self.data,
            "data_owner": self.data_owner,
            "complete": self.complete,
            "exhausted": self.exhausted,
        }

    @staticmethod
    def from_plain(plain: dict[str, Any]) -> Snapshot:
        return Snapshot(
            rng=rng_from_plain(plain["rng"]),
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


