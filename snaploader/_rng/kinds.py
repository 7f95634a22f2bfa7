"""Generator objects, one kind at a time: how to read and write each one's state as
bytes, and the encoding of a worker's object states that snapshots and checkpoints carry.

The kinds: ``random.Random`` (and subclasses), ``numpy.random.RandomState`` over
MT19937, ``numpy.random.Generator`` and bare bit generators (MT19937, PCG64,
PCG64DXSM, SFC64, Philox), and CPU ``torch.Generator``. Mersenne Twister states
(``random.Random``, ``RandomState``, MT19937) are copied raw by ``_rng/raw.py``, with the
layouts it verified at import (NOTE [ raw RNG access ]); the other bit generators (a few
dozen bytes) go through their public ``state`` dict.

Encoding (:func:`encode_entries`; little-endian), one record per object, in discovery
order::

    u16 path length, path (UTF-8), u8 kind, u32 state length, state

A checkpoint is untrusted: :func:`parse` checks every record (kind, length, and every
field a C struct trusts: a Mersenne Twister position past 624, a Philox buffer position
past 4, would read past the end of the state on the next draw) before anything is
written into a generator.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Protocol

import numpy as np
import torch

from .raw import (
    MT19937_BYTES,
    PY_STATE_BYTES,
    check_mt_blob,
    check_torch_state,
    legacy_numpy_access,
    mt19937_access,
    pack_torch_state,
    python_rng_access,
    torch_state_bytes,
    torch_state_tensor,
)

_HEAD = struct.Struct("<H")
_KIND = struct.Struct("<BI")
_PCG = struct.Struct("<QQQQBI")  # state lo, hi; increment lo, hi; has_uint32; uinteger
_SFC = struct.Struct("<4QBI")
_PHILOX = struct.Struct("<4Q2Q4QiBI")  # counter, key, buffer, buffer_pos, has_uint32, uinteger
_MASK64: Final = (1 << 64) - 1


class Access(Protocol):
    """Reads and writes one generator object's state as bytes."""

    def read(self) -> bytes: ...

    def write(self, blob: bytes) -> None: ...


def _split(value: int) -> tuple[int, int]:
    return value & _MASK64, value >> 64


class _PCGAccess:
    def __init__(self, bit_generator: Any) -> None:
        self.bit_generator = bit_generator
        self.name = type(bit_generator).__name__

    def read(self) -> bytes:
        full = self.bit_generator.state
        state = full["state"]
        return _PCG.pack(*_split(state["state"]), *_split(state["inc"]), full["has_uint32"], full["uinteger"])

    def write(self, blob: bytes) -> None:
        s_lo, s_hi, i_lo, i_hi, has, value = _PCG.unpack(blob)
        self.bit_generator.state = {
            "bit_generator": self.name,
            "state": {"state": s_lo | s_hi << 64, "inc": i_lo | i_hi << 64},
            "has_uint32": has,
            "uinteger": value,
        }


class _SFCAccess:
    def __init__(self, bit_generator: Any) -> None:
        self.bit_generator = bit_generator

    def read(self) -> bytes:
        full = self.bit_generator.state
        return _SFC.pack(*(int(x) for x in full["state"]["state"]), full["has_uint32"], full["uinteger"])

    def write(self, blob: bytes) -> None:
        *words, has, value = _SFC.unpack(blob)
        self.bit_generator.state = {
            "bit_generator": "SFC64",
            "state": {"state": np.array(words, dtype=np.uint64)},
            "has_uint32": has,
            "uinteger": value,
        }


class _PhiloxAccess:
    def __init__(self, bit_generator: Any) -> None:
        self.bit_generator = bit_generator

    def read(self) -> bytes:
        full = self.bit_generator.state
        words = [*full["state"]["counter"], *full["state"]["key"], *full["buffer"]]
        return _PHILOX.pack(*(int(x) for x in words), full["buffer_pos"], full["has_uint32"], full["uinteger"])

    def write(self, blob: bytes) -> None:
        values = _PHILOX.unpack(blob)
        u64 = lambda part: np.array(part, dtype=np.uint64)  # noqa: E731
        self.bit_generator.state = {
            "bit_generator": "Philox",
            "state": {"counter": u64(values[0:4]), "key": u64(values[4:6])},
            "buffer": u64(values[6:10]),
            "buffer_pos": values[10],
            "has_uint32": values[11],
            "uinteger": values[12],
        }


class _TorchAccess:
    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def read(self) -> bytes:
        return pack_torch_state(torch_state_bytes(self.generator.get_state()))

    def write(self, blob: bytes) -> None:
        self.generator.set_state(torch_state_tensor(blob))


def _check_flag(has_uint32: int) -> None:
    if has_uint32 > 1:
        raise ValueError(f"its has_uint32 flag is {has_uint32}; expected 0 or 1")


def _check_pcg(blob: bytes) -> None:
    _check_flag(_PCG.unpack(blob)[4])


def _check_sfc(blob: bytes) -> None:
    _check_flag(_SFC.unpack(blob)[4])


def _check_philox(blob: bytes) -> None:
    values = _PHILOX.unpack(blob)
    if not 0 <= values[10] <= 4:
        raise ValueError(f"its Philox buffer position is {values[10]}; expected 0 to 4")
    _check_flag(values[11])


@dataclass(frozen=True)
class GeneratorKind:
    """One kind of generator object: its code in the encoding, the name users see, the
    exact state length (None: checked by ``check``), and the state check."""

    code: int
    name: str
    size: int | None
    check: Callable[[bytes], None]


KINDS: Final = {
    kind.code: kind
    for kind in (
        GeneratorKind(1, "random.Random", PY_STATE_BYTES, lambda b: check_mt_blob(b, "random.Random")),
        GeneratorKind(2, "numpy.random.RandomState", PY_STATE_BYTES, lambda b: check_mt_blob(b, "RandomState")),
        GeneratorKind(3, "numpy MT19937", MT19937_BYTES, lambda b: check_mt_blob(b + bytes(9), "MT19937")),
        GeneratorKind(4, "numpy PCG64", _PCG.size, _check_pcg),
        GeneratorKind(5, "numpy PCG64DXSM", _PCG.size, _check_pcg),
        GeneratorKind(6, "numpy SFC64", _SFC.size, _check_sfc),
        GeneratorKind(7, "numpy Philox", _PHILOX.size, _check_philox),
        GeneratorKind(8, "torch.Generator", None, lambda b: check_torch_state(b, "torch.Generator")),
    )
}
_BIT_GENERATORS: Final[dict[type, tuple[int, Callable[[Any], Access]]]] = {
    np.random.MT19937: (3, mt19937_access),
    np.random.PCG64: (4, _PCGAccess),
    np.random.PCG64DXSM: (5, _PCGAccess),
    np.random.SFC64: (6, _SFCAccess),
    np.random.Philox: (7, _PhiloxAccess),
}
_GLOBALS: Final = (random._inst, np.random.mtrand._rand, torch.default_generator)  # type: ignore[attr-defined]


def is_generator(obj: Any) -> bool:
    """True for an object this module has an answer for (a kind, or a reason not)."""
    return isinstance(obj, (random.Random, np.random.RandomState, np.random.Generator,
                            np.random.BitGenerator, torch.Generator))


def access_for(obj: Any) -> tuple[int, Any, Access] | str | None:
    """(kind code, identity object, access) for a generator object; a reason string when
    it is one that cannot be captured; None for a global RNG (captured already)."""
    if any(obj is known for known in _GLOBALS):
        return None
    if isinstance(obj, torch.Generator):
        if obj.device.type != "cpu":
            return f"a torch.Generator on {obj.device} (only CPU generators are captured)"
        return 8, obj, _TorchAccess(obj)
    if isinstance(obj, random.SystemRandom):
        return "a random.SystemRandom (it reads the OS's entropy and has no state to save)"
    if isinstance(obj, random.Random):
        return 1, obj, python_rng_access(obj)
    if isinstance(obj, np.random.RandomState):
        if type(obj._bit_generator) is not np.random.MT19937:  # type: ignore[attr-defined]
            return "a numpy.random.RandomState over a bit generator other than MT19937"
        return 2, obj, legacy_numpy_access(obj)
    bit_generator = obj.bit_generator if isinstance(obj, np.random.Generator) else obj
    known = _BIT_GENERATORS.get(type(bit_generator))
    if known is None:
        return f"a numpy bit generator of unknown kind {type(bit_generator).__qualname__}"
    code, make = known
    return code, bit_generator, make(bit_generator)


def encode_header(path: str, code: int) -> bytes:
    raw = path.encode("utf-8", "backslashreplace")[:0xFFFF]
    return _HEAD.pack(len(raw)) + raw + bytes((code,))


def encode_entries(headers: list[bytes], states: list[bytes]) -> bytes:
    parts = []
    for header, state in zip(headers, states):
        parts.append(header)
        parts.append(struct.pack("<I", len(state)))
        parts.append(state)
    return b"".join(parts)


def parse(blob: bytes, check: bool = True) -> list[tuple[str, int, bytes]]:
    """The (path, kind code, state) records of ``blob``, each checked; ValueError naming
    the first problem otherwise. ``check=False`` for a blob checked already (a
    checkpoint's, by its parse) or made by this code: the states are not checked again."""
    records = []
    at = 0
    while at < len(blob):
        if at + _HEAD.size > len(blob):
            raise ValueError(f"it is cut short at byte {at}")
        (length,) = _HEAD.unpack_from(blob, at)
        at += _HEAD.size
        path = blob[at : at + length].decode("utf-8", "replace")
        at += length
        if at + _KIND.size > len(blob):
            raise ValueError(f"the record of {path!r} is cut short")
        code, size = _KIND.unpack_from(blob, at)
        at += _KIND.size
        kind = KINDS.get(code)
        if kind is None:
            raise ValueError(f"the record of {path!r} has kind {code}; expected one of {sorted(KINDS)}")
        state = blob[at : at + size]
        at += size
        if len(state) != size or (kind.size is not None and size != kind.size):
            raise ValueError(f"the {kind.name} state of {path!r} has {len(state)} bytes; expected {kind.size or size}")
        try:
            if check:
                kind.check(state)
        except (ValueError, struct.error) as exc:
            raise ValueError(f"the {kind.name} state of {path!r} is not one snaploader wrote: {exc}") from None
        records.append((path, code, state))
    return records
