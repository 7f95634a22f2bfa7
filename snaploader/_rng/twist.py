"""A worker's RNG states in a checkpoint: where each Mersenne Twister state is on its
seed's path, not what it is (NOTE [ twist codes ]).

A worker's three global generators start from a state fixed by the epoch's base seed
and the worker's index (``seed_like_torch``). From there a generator only moves along
one path: it hands out the 624 words of its current block, then twists (regenerates
all 624 words from the old ones). So a state reached by drawing is fully described by
its twist count k, its position in the block and the few fields beside the words
(Python's ``gauss_next``, NumPy's cached gaussian, torch's normal cache and counters):
about 20 bytes instead of 2.5 KB of incompressible words.

- :func:`compact` (main process, at ``state_dict()`` time, never per batch) rewrites a
  ``capture_rng`` blob: each moved state found within :data:`MAX_TWISTS` twists of the
  seed becomes a code; one not found (a dataset drawing ~10**8 numbers, a
  ``worker_init_fn`` that reseeds) stays raw bytes. Searches resume where the last one
  for the same worker stopped, so repeated checkpoints only walk the new twists.
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
import threading
import time
import zlib
from collections import OrderedDict
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
# Replaying k twists costs ~1.4 µs each (NumPy's MT19937 bit generator, the same twist
# as CPython's, NumPy's legacy and torch's), so k is bounded both to keep a search at
# state_dict() time and a decode at load time short, and so that a crafted checkpoint
# cannot make loading spin: 2**16 twists, about 0.1 s, cover 40.9 million 32-bit draws
# (20 million doubles) from one generator since the worker was seeded. A search that
# gives up marks the worker's path as walked to the bound, so it is paid once. And one
# state_dict() searches for at most SEARCH_BUDGET_S in all: a state not found by then is
# stored raw this time (a size cost, never an exactness one; that ledger's plain form is
# then not cached), and the next call walks on from where this one stopped. So a heavy pipeline's first checkpoints of an epoch
# are never slow; its states are stored raw until the bound is walked.
MAX_TWISTS: Final = 2**16
SEARCH_BUDGET_S: Final = 0.1
# All of one checkpoint's codes together: about 1.5 s of replay. A state_dict() codes a
# state only while the checkpoint's total stays within it (the others stay raw), and a
# load refuses more before replaying any (NOTE [ checkpoint limits ] in _format/checkpoint.py).
LOAD_TWISTS: Final = 2**20
_MT_WORDS: Final = 624
_WORDS_BYTES: Final = _MT_WORDS * 4
_CHUNK_TWISTS: Final = 256  # twists generated per NumPy call while searching (1.3 MB)
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
            "are replayed (snaploader never writes more)"
        )
    rest = code[_HEAD.size :]
    return rest[: _WORDS_AT[part]], rest[_WORDS_AT[part] :]


def _words(part: bytes, index: int) -> np.ndarray:
    return np.frombuffer(part, dtype="<u4", count=_MT_WORDS, offset=_WORDS_AT[index])


def _temper(words: np.ndarray) -> np.ndarray:
    y = words.astype(np.uint32)
    y ^= y >> 11
    y ^= (y << 7) & np.uint32(0x9D2C5680)
    y ^= (y << 15) & np.uint32(0xEFC60000)
    y ^= y >> 18
    return y


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


class _Path:
    """How far one seed state's path has been searched: the generator at the last state
    found (or the bound, once a search found nothing), and the states found (a few, for
    snapshots asked again). Only states after the last one found are looked for: an
    older one asked for later (a loader rolled back in the same process) stays raw, as
    a search from the seed each time would make every checkpoint of a pipeline that
    outruns the bound walk all of it again."""

    def __init__(self, seed_words: np.ndarray) -> None:
        self.walked = 0
        self.generator = _twister(seed_words)
        self.found: OrderedDict[bytes, int] = OrderedDict()

    def find(self, words: bytes, deadline: float) -> int | None:
        """The twist count of ``words`` on this path, or None beyond MAX_TWISTS or when
        ``time.monotonic()`` passes ``deadline`` first."""
        if words in self.found:
            return self.found[words]
        target = _temper(np.frombuffer(words, dtype="<u4"))
        twists = self._walk(target, MAX_TWISTS, deadline)
        if twists is None:
            return None
        # Walk on from here next time, not from the end of the block searched: the
        # next state asked for is usually a little further on.
        self.walked, self.generator = twists, _twister(np.frombuffer(words, dtype="<u4"))
        self.found[words] = twists
        if len(self.found) > 8:
            self.found.popitem(last=False)
        return twists

    def _walk(self, target: np.ndarray, bound: int, deadline: float) -> int | None:
        chunk = 4  # small steps first: between two checkpoints a light pipeline twists a few times
        while self.walked < bound:
            if time.monotonic() > deadline:
                return None  # out of time: walk on from here next time
            step = min(chunk, bound - self.walked)
            chunk = min(2 * chunk, _CHUNK_TWISTS)
            block = self.generator.random_raw(_MT_WORDS * step).reshape(step, _MT_WORDS)
            for row in np.flatnonzero(block[:, 0] == target[0]):
                if np.array_equal(block[row], target):
                    return self.walked + int(row) + 1
            self.walked += step
        return None


_paths: OrderedDict[tuple[int, int, int], _Path] = OrderedDict()
_paths_lock = threading.Lock()


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


class TwistBudget:
    """The twists one checkpoint's codes may still add up to (:data:`LOAD_TWISTS`)."""

    def __init__(self, left: int = LOAD_TWISTS) -> None:
        self.left = left


def compact(
    blob: bytes, base_seed: int, worker_id: int, deadline: float = float("inf"), budget: TwistBudget | None = None
) -> bytes:
    """``blob`` (a ``capture_rng`` blob of worker ``worker_id`` seeded from
    ``base_seed``) with each moved state found near its seed, before ``deadline``
    (``time.monotonic()``), written as a code, while ``budget`` lasts."""
    flags = blob[0]
    if (flags & 0b111) == 0b111 or flags >> _CODED_SHIFT:
        return blob  # nothing moved, or already compact
    seed = seed_state(base_seed, worker_id)
    parts = _parts(blob, seed)
    kept: list[bytes] = []
    for part in range(3):
        if flags & (1 << part):
            continue
        raw = parts[part]
        words = raw[_WORDS_AT[part] : _WORDS_AT[part] + _WORDS_BYTES]
        twists = None
        if _codable(part) and len(raw) == _PART_BYTES[part]:
            with _paths_lock:
                twists = _path(base_seed, worker_id, part, seed[part]).find(words, deadline)
        if twists is not None and budget is not None:
            if twists > budget.left:
                twists = None  # stored raw: the checkpoint's codes are at their bound
            else:
                budget.left -= twists
        if twists is None:
            kept.append(raw)
            continue
        flags |= 1 << (_CODED_SHIFT + part)
        kept.append(
            _HEAD.pack(twists, zlib.crc32(words))
            + raw[: _WORDS_AT[part]]
            + raw[_WORDS_AT[part] + _WORDS_BYTES :]
        )
    return bytes((flags,)) + b"".join(kept)


def _path(base_seed: int, worker_id: int, part: int, seed_part: bytes) -> _Path:
    key = (base_seed, worker_id, part)
    path = _paths.get(key)
    if path is None:
        path = _paths[key] = _Path(_words(seed_part, part))
        if len(_paths) > 96:  # 32 workers' three generators
            _paths.popitem(last=False)
    return path


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
    belongs to another seed state. Each state found is remembered on its path, so the
    next ``state_dict()`` writes the same code again without a search."""
    if blob[0] >> _CODED_SHIFT == 0:
        return blob
    seed = seed_state(base_seed, worker_id)
    out = expand(blob, seed)
    flags, coded = blob[0], blob[0] >> _CODED_SHIFT
    parts = _parts(out, seed)
    with _paths_lock:
        for part in range(3):
            if coded & (1 << part) and not flags & (1 << part):
                words = parts[part][_WORDS_AT[part] : _WORDS_AT[part] + _WORDS_BYTES]
                twists = _HEAD.unpack_from(_parts(blob, seed)[part])[0]
                path = _path(base_seed, worker_id, part, seed[part])
                path.found[words] = twists
                if len(path.found) > 8:
                    path.found.popitem(last=False)
    return out


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
