"""Opening a shard: a local path with the built-in ``open``, a URL (``s3://``,
``gs://``, ``http(s)://``, ``memory://``, any fsspec protocol) with ``fsspec.open``,
whose files seek by range requests. fsspec is the optional extra ``shards``."""

from __future__ import annotations

import re
from typing import IO, Any, Callable

from .tar import ShardError

Opener = Callable[[str], IO[bytes]]

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def default_open(url: str) -> IO[bytes]:
    """``url`` opened for reading bytes, seekable."""
    if not _URL.match(url) or url.startswith("file://"):
        return open(url[len("file://"):] if url.startswith("file://") else url, "rb")
    try:
        import fsspec
    except ImportError:
        raise ImportError(
            f"shard {url} is a URL, which snaploader opens with fsspec, and fsspec is not "
            "installed: pip install 'snaploader[shards]' (or fsspec and the filesystem's "
            "own package, s3fs or gcsfs), or pass open= to ShardStream"
        ) from None
    return fsspec.open(url, "rb").open()  # type: ignore[no-any-return]


def open_shard(opener: Opener, url: str) -> IO[bytes]:
    """``opener(url)``, a missing shard or one that cannot be opened named in the error."""
    try:
        file: Any = opener(url)
    except FileNotFoundError as exc:
        raise ShardError(
            f"shard {url} is missing ({exc}); it is in the stream's shard list, so an epoch "
            "cannot be read without it: restore it, or build the stream without it (a "
            "checkpoint then no longer fits)"
        ) from exc
    except OSError as exc:
        raise ShardError(f"shard {url} cannot be opened: {exc}") from exc
    if not callable(getattr(file, "seek", None)) or not callable(getattr(file, "read", None)):
        raise ShardError(
            f"open({url!r}) returned {type(file).__qualname__}, which cannot seek and read; "
            "a shard stream seeks to its samples: return a binary file object"
        )
    return file  # type: ignore[no-any-return]
