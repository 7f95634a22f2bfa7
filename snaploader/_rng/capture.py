"""Capture and restore random number generator states, cheaply and as bytes.

A worker's snapshot after every batch holds the three global RNGs a dataset may draw
from (Python ``random``, NumPy's legacy global generator and torch's CPU generator),
encoded as raw bytes (at most 7.5 KB, microseconds), never as tensors or 625-element
tuples, so a snapshot costs almost nothing to pickle. :class:`RngSource` is the
generator an epoch's base seed and sampler draw from, in the main process.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Final

import torch

from .raw import (
    _PY_BLOB,
    _TORCH_PACKED,
    _numpy_rng,
    _pack_torch,
    _python_rng,
    check_mt_blob,
    check_torch_state,
    pack_torch_state,
    torch_state_bytes,
    torch_state_tensor,
)
from .twist import check_code, expand, part_sizes

def _parts(full: bytes) -> tuple[bytes, bytes, bytes]:
    return full[:_PY_BLOB], full[_PY_BLOB : 2 * _PY_BLOB], full[2 * _PY_BLOB :]


_seed_cache: tuple[bytes, tuple[bytes, bytes, bytes]] = (b"", (b"", b"", b""))


def _seed_parts(seed: bytes) -> tuple[bytes, bytes, bytes]:
    # A worker passes the same seed object after every batch: split it once.
    global _seed_cache
    if _seed_cache[0] is not seed:
        _seed_cache = (seed, _parts(seed[1:]))
    return _seed_cache[1]


_NAMES: Final = ("Python random", "NumPy", "torch")


def check_rng(blob: bytes, seeded: bool) -> None:
    """Raise ValueError unless ``blob`` is a well-formed :func:`capture_rng` encoding,
    possibly with twist codes (``_rng/twist.py``; ``seeded``: captured relative to a seed
    state). Every byte that ends up in a C struct is range-checked here, so a restore
    from a checked blob cannot corrupt memory: a Mersenne Twister position past its 624
    words would make the next draw read past the end of the state array."""
    if not blob:
        raise ValueError("it is empty")
    flags = blob[0]
    if flags > 0b111111 or (flags and not seeded) or flags & (flags >> 3):
        raise ValueError(
            f"its flags byte is {flags}; expected 0 to 63, no state both kept and coded "
            "(0 for a main-process state)"
        )
    at = 1
    for part, (name, size) in enumerate(zip(_NAMES, part_sizes(flags))):
        if size is None:
            continue
        end = len(blob) if size < 0 else at + size
        stored = blob[at:end]
        if len(stored) != size and size >= 0:
            raise ValueError(f"its {name} state has {len(stored)} bytes; expected {size}")
        at = end
        if flags & (8 << part):
            before, after = check_code(stored, part, name)
            words = b"\0" * (4 * 624)  # not range-checked by anyone: any will do
            stored = before + words + after
        if part < 2:
            check_mt_blob(stored, name)
        else:
            check_torch_state(stored, "torch")
    if at != len(blob):
        raise ValueError(f"it has {len(blob) - at} bytes after its last state")


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
        return _encode(self.python, self.numpy, _packed_torch(torch_state_bytes(self.torch)), self.seed)

    @staticmethod
    def decode(blob: bytes, seed: bytes | None) -> NativeRng:
        check_rng(blob, seeded=seed is not None)
        flags = blob[0]
        if flags:
            if seed is None:
                raise ValueError("this RNG state was captured relative to a seed state; pass it")
            seed_parts = _seed_parts(seed)
            blob = expand(blob, seed_parts)
            flags, rest = blob[0], blob[1:]
            parts = []
            for bit, size in enumerate((_PY_BLOB, _PY_BLOB, None)):
                if flags & (1 << bit):
                    parts.append(seed_parts[bit])
                else:
                    parts.append(rest[:size] if size is not None else rest)
                    rest = rest[size:] if size is not None else b""
            py, npb, torch_state = parts
        else:
            py, npb, torch_state = _parts(blob[1:])
        tensor = torch_state_tensor(torch_state)
        return NativeRng(py, npb, tensor, seed)


RngState = bytes | NativeRng


def capture_rng(seed: bytes | None = None) -> bytes:
    """The three global RNG states of this process, encoded as one bytes object.

    With ``seed`` (a capture taken right after seeding), a generator still in its seed
    state is written as a flag, not 2.5 KB: most datasets draw from one generator or
    none, and their snapshots and checkpoints shrink accordingly.
    """
    torch_raw = torch_state_bytes(_torch_get_state())
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
        return pack_torch_state(torch_state_bytes(state))

    def next_epoch_state(self) -> bytes | None:
        """What a checkpoint between epochs keeps of the source (``rng_next``): the
        generator's state; None for torch's global RNG, which belongs to the training
        loop."""
        return None if self.generator is None else self.get_state()

    @staticmethod
    def check_state(state: bytes) -> None:
        """Raise ValueError unless ``state`` (from :meth:`get_state`) is one torch accepts."""
        check_rng(b"\x03" + state, seeded=True)  # the torch part alone

    def set_state(self, state: bytes) -> None:
        tensor = torch_state_tensor(state)
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
