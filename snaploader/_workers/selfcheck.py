"""The resume self-check: small digests of the batches a checkpoint did not cover.

A checkpoint taken mid-epoch describes the batches *yielded*; the batches that were
prefetched but not yet yielded are produced again after a restore. Checkpoints written
before 2026-12-03 keep, in ``next_batches``, the digest of each worker's next batch when
it had already arrived. After a restore of one, the first batch each worker produces is
digested in the main process and compared with it: a mismatch means that something the
checkpoint does not capture changed the stream (data changed on disk, or randomness
snaploader cannot see), and is worth one warning, not an error: the run goes on.

This release writes no such digest: which batches had arrived when ``state_dict()`` ran
depended on timing, and a state must be a function of its position
(NOTE [ one state per position ] in ``_format/checkpoint.py``). Only yielded batches are determined by a
position, and checking one after a restore would mean producing it again from the
state before it, which the checkpoint does not hold (it would double its size).
``snaploader verify`` is the check for a pipeline's determinism (docs/verify.md).

The digest is a fingerprint, not a hash of every byte: for each tensor its dtype,
shape and up to ``_EDGE_ELEMENTS`` elements from each end of its flattened values; for
other leaves their ``repr``. Randomness that changes a batch changes those (a random
crop, flip or noise moves the first and last values), and its cost does not grow with
the batch.
"""

from __future__ import annotations

import hashlib
import warnings
from typing import TYPE_CHECKING, Any, Final

import torch

from .._errors import ResumeMismatchWarning, user_stacklevel

if TYPE_CHECKING:
    from .._state.ledger import EpochProgress
    from .messages import Result

_EDGE_ELEMENTS: Final = 64
_DIGEST_BYTES: Final = 12


def batch_digest(batch: Any) -> str:
    """A short, deterministic fingerprint of ``batch`` (see the module docstring)."""
    h = hashlib.blake2b(digest_size=_DIGEST_BYTES)
    _feed(h, batch)
    return h.hexdigest()


def _feed(h: Any, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        if value.is_nested:
            # A nested tensor has no single shape: its components, in order.
            _feed(h, ("nested", *value.detach().unbind()))
            return
        h.update(f"T{value.dtype}{tuple(value.shape)}".encode())
        if value.layout != torch.strided:
            h.update(str(value.layout).encode())  # sparse and others: no cheap values
            return
        if value.is_quantized:
            value = value.int_repr()
        h.update(_edge_bytes(value.detach()))
    elif isinstance(value, dict):
        h.update(b"{")
        for key, item in value.items():
            h.update(repr(key).encode())
            _feed(h, item)
        h.update(b"}")
    elif isinstance(value, (list, tuple)):
        h.update(b"[" if isinstance(value, list) else b"(")
        for item in value:
            _feed(h, item)
        h.update(b"]")
    else:
        h.update(repr(value).encode(errors="replace"))


def _edge_bytes(value: torch.Tensor) -> bytes:
    """The bytes of up to ``_EDGE_ELEMENTS`` elements from each end of ``value``'s
    flattened values (all of them when it is short), in their native layout."""
    if value.device.type == "cpu" and not value.is_conj() and not value.is_neg():
        try:
            array = value.numpy()
        except (TypeError, RuntimeError):
            pass  # a dtype NumPy lacks (bfloat16, ...): torch below
        else:
            # NumPy reads the edges straight from the tensor's memory: a few torch
            # operations more per batch would page in megabytes of libtorch's code in
            # every worker (its RSS) for these few bytes.
            if array.size <= 2 * _EDGE_ELEMENTS:
                return array.tobytes()
            return array.flat[:_EDGE_ELEMENTS].tobytes() + array.flat[-_EDGE_ELEMENTS:].tobytes()
    flat = value.resolve_conj().resolve_neg().reshape(-1)
    if not flat.numel():
        return b""
    edges = flat if flat.numel() <= 2 * _EDGE_ELEMENTS else torch.cat((flat[:_EDGE_ELEMENTS], flat[-_EDGE_ELEMENTS:]))
    return edges.to("cpu").contiguous().view(torch.uint8).numpy().tobytes()


def check_restored_batch(progress: EpochProgress, slot: int, result: Result, worker: str) -> None:
    """Compare a restored slot's first batch with the digest the checkpoint kept of it;
    warn once per restore. ``worker``: the slot in words."""
    expected = progress.next_batches[slot]
    if expected is None or expected[0] != result.snapshot.produced:
        return
    progress.next_batches[slot] = None
    if batch_digest(result.payload) == expected[1]:
        return
    progress.next_batches = []
    warnings.warn(
        mismatch_message(progress.yielded, progress.epoch, worker, expected[0]),
        ResumeMismatchWarning,
        stacklevel=user_stacklevel(),
    )


def mismatch_message(batch: int, epoch: int, worker: str, produced: int) -> str:
    """The ResumeMismatchWarning's text: ``worker``'s ``produced``-th batch of the epoch,
    batch ``batch`` of epoch ``epoch``, differs from its digest in the checkpoint. The
    first line says what happened and what to do (``snaploader verify`` shows only it);
    batches are named by their index from 0, as ``skip_to`` takes them."""
    return (
        f"resume self-check: batch {batch} of epoch {epoch} differs from the one prefetched "
        "when the checkpoint was taken, so this resumed stream is not the interrupted one; "
        "run `snaploader verify` on the pipeline to find the cause (docs/verify.md)\n"
        f"The batch is {worker}'s batch {produced - 1} of the epoch (from 0). Usual causes: "
        "the data changed on disk since; a dataset state_dict() that does not hold "
        "everything its position depends on (a shuffle buffer it does not save: see "
        "state_protocol=False in docs/iterable.md); randomness the checkpoint does not "
        "capture (a generator created inside __getitem__, a global of another module, "
        "time- or os-seeded code, a C extension's own RNG: docs/limitations.md). "
        "check_resume=False turns this check off."
    )
