"""Twist codes: an older way of storing a worker's RNG states in a checkpoint, read
but no longer written (NOTE [ twist codes ]).

A worker's three global generators start from a state fixed by the epoch's base seed
and the worker's index (``seed_like_torch``). From there a generator only moves along
one path: it hands out the 624 words of its current block, then twists (regenerates
all 624 words from the old ones). So a state reached by drawing is fully described by
its twist count k, its position in the block and the few fields beside the words
(Python's ``gauss_next``, NumPy's cached gaussian, torch's normal cache and counters):
about 20 bytes instead of 2.5 KB of incompressible words.

- :func:`expand` (in the worker, which holds its seed state) turns the codes back into
  the raw bytes, twisting k times: at most :data:`MAX_TWISTS`, about 0.1 s.
- :func:`check_code` is what validation of an untrusted checkpoint trusts: k bounded,
  positions and flags in range. A CRC-32 of the words makes a code applied to another
  seed state (an edited base seed) an error rather than a wrong stream.

Blob layout: the flags byte of ``_rng/capture.py`` gains bits 3-5 (bit 3 + i: part i is a
code); a code is ``<II`` (k, CRC-32 of the words) then the part's bytes around its
words (Python and NumPy: position before, gaussian after; torch packed: 24 header
bytes before, 40 normal-cache bytes after).
"""

from __future__ import annotations

import functools
import random
import struct
import zlib
from typing import Final

import numpy as np
import torch
from torch.utils.data._utils import worker as torch_worker

from .raw import (
    _PY_BLOB,
    _TORCH_PACKED,
    _TORCH_WORDS_AT,
    legacy_numpy_access,
    pack_torch_state,
    python_rng_access,
)

# NOTE [ twist codes ]
# Finding k means walking the seed's path until the state turns up: time that grows
# with how much the worker drew (23 ms per state_dict() at 8 workers whose items draw
# a 3x224x224 noise image from each RNG), and the main process was where it ran. So
# checkpoints now store the raw states (NOTE [ raw RNG states ] in _format/build.py),
# and codes are only read, from checkpoints written before. Replaying k twists costs
# ~1.4 us each (NumPy's MT19937 bit generator, the same twist as CPython's, NumPy's
# legacy and torch's); k is bounded so that a crafted checkpoint cannot make loading
# spin: 2**16 twists, about 0.1 s.
MAX_TWISTS: Final = 2**16
# All of one checkpoint's codes together: about 1.5 s of replay. A load refuses more
# before replaying any (NOTE [ checkpoint limits ] in _format/checkpoint.py).
LOAD_TWISTS: Final = 2**20
_MT_WORDS: Final = 624
_WORDS_BYTES: Final = _MT_WORDS * 4
_HEAD = struct.Struct("<II")  # k, CRC-32 of the words
# Per part (Python, NumPy, torch): where its words start, and its whole size.
_WORDS_AT: Final = (4, 4, _TORCH_WORDS_AT)
_PART_BYTES: Final = (_PY_BLOB, _PY_BLOB, _TORCH_WORDS_AT + _WORDS_BYTES + 40)
_CODE_BYTES: Final = tuple(_HEAD.size + size - _WORDS_BYTES for size in _PART_BYTES)
_CODED_SHIFT: Final = 3  # flags bit 3 + i: part i is a code


def _codable(part: int) -> bool:
    return part < 2 or _TORCH_PACKED  # an unpacked torch state keeps its words as 64-bit


def part_sizes(flags: int) -> list[int | None]:
    """Bytes of each part stored in a blob with ``flags`` (None: not stored, it is the
    seed's; the last stored part takes the rest of the blob unless it is a code)."""
    sizes: list[int | None] = []
    for part in range(3):
        if flags & (1 << part):
            sizes.append(None)
        elif flags & (1 << (_CODED_SHIFT + part)):
            sizes.append(_CODE_BYTES[part])
        else:
            sizes.append(_PART_BYTES[part] if part < 2 else -1)  # -1: the rest
    return sizes


def check_code(code: bytes, part: int, name: str) -> tuple[bytes, bytes]:
    """Raise ValueError unless ``code`` is a well-formed code for part ``part``; return
    the bytes before and after the words it stands for."""
    if not _codable(part):
        raise ValueError(f"its {name} state is a twist code, which this torch build cannot decode")
    if len(code) != _CODE_BYTES[part]:
        raise ValueError(f"its {name} twist code has {len(code)} bytes; expected {_CODE_BYTES[part]}")
    twists, _ = _HEAD.unpack_from(code)
    if twists > MAX_TWISTS:
        raise ValueError(
            f"its {name} state is {twists} twists from the seed state; at most {MAX_TWISTS} "
            "are replayed (no version of snaploader wrote more)"
        )
    rest = code[_HEAD.size :]
    return rest[: _WORDS_AT[part]], rest[_WORDS_AT[part] :]


def _words(part: bytes, index: int) -> np.ndarray:
    return np.frombuffer(part, dtype="<u4", count=_MT_WORDS, offset=_WORDS_AT[index])


def _twister(words: np.ndarray) -> np.random.MT19937:
    """A bit generator at ``words`` whose next draw twists (as after seeding)."""
    generator = np.random.MT19937()
    generator.state = {"bit_generator": "MT19937", "state": {"key": words.astype(np.uint32), "pos": _MT_WORDS}}
    return generator


def twisted(words: np.ndarray, twists: int) -> np.ndarray:
    """``words`` after ``twists`` Mersenne Twister twists."""
    generator = _twister(words)
    left = twists
    while left:
        step = min(left, 4096)
        generator.random_raw(_MT_WORDS * step, output=False)
        left -= step
    key: np.ndarray = generator.state["state"]["key"]
    return key.astype("<u4")


def _parts(blob: bytes, seed: tuple[bytes, bytes, bytes]) -> list[bytes]:
    flags, at, parts = blob[0], 1, []
    for part, size in enumerate(part_sizes(flags)):
        if size is None:
            parts.append(seed[part])
            continue
        end = len(blob) if size < 0 else at + size
        parts.append(blob[at:end])
        at = end
    return parts


@functools.lru_cache(maxsize=64)
def seed_state(base_seed: int, worker_id: int) -> tuple[bytes, bytes, bytes]:
    """The three parts ``capture_rng()`` gives right after ``seed_like_torch(base_seed,
    worker_id)``, computed on throwaway generators (the global ones are left alone)."""
    seed = base_seed + worker_id
    python = python_rng_access(random.Random(seed)).read()
    legacy = np.random.RandomState(torch_worker._generate_state(base_seed, worker_id))
    numpy = legacy_numpy_access(legacy).read()
    generator = torch.Generator().manual_seed(seed)
    return python, numpy, pack_torch_state(generator.get_state().numpy().tobytes())


def has_codes(blob: bytes) -> bool:
    return blob[0] >> _CODED_SHIFT != 0


def code_twists(blob: bytes) -> int:
    """The twists the codes of ``blob`` (checked by ``check_rng``) ask to replay."""
    flags, at, total = blob[0], 1, 0
    for part, size in enumerate(part_sizes(flags)):
        if size is None:
            continue
        if flags & (1 << (_CODED_SHIFT + part)):
            total += _HEAD.unpack_from(blob, at)[0]
        at = len(blob) if size < 0 else at + size
    return total


def expand_for(blob: bytes, base_seed: int, worker_id: int) -> bytes:
    """``blob`` of worker ``worker_id`` seeded from ``base_seed`` with its codes
    replayed (in the main process, once per load); ValueError when a code's CRC says it
    belongs to another seed state."""
    if not has_codes(blob):
        return blob
    return expand(blob, seed_state(base_seed, worker_id))


def expand(blob: bytes, seed: tuple[bytes, bytes, bytes]) -> bytes:
    """``blob`` with its codes replaced by the states they stand for (the seed parts
    ``seed`` are the worker's own); ValueError when a code does not fit them."""
    flags = blob[0]
    if flags >> _CODED_SHIFT == 0:
        return blob
    parts = _parts(blob, seed)
    kept: list[bytes] = []
    for part, name in enumerate(("Python random", "NumPy", "torch")):
        if flags & (1 << part):
            continue
        if not flags & (1 << (_CODED_SHIFT + part)):
            kept.append(parts[part])
            continue
        before, after = check_code(parts[part], part, name)
        twists, crc = _HEAD.unpack_from(parts[part])
        words = twisted(_words(seed[part], part), twists).tobytes()
        if zlib.crc32(words) != crc:
            raise ValueError(
                f"its {name} state is {twists} twists from a seed state other than this "
                "worker's (the base seed or worker index was changed)"
            )
        kept.append(before + words + after)
    return bytes((flags & 0b111,)) + b"".join(kept)
