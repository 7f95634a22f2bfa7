"""Reading a tar shard in the webdataset layout from any member offset.

A shard is a tar file whose regular members are grouped into samples by key: the
member name up to the first dot of its last path part is the sample's key, the rest its
extension (``a/b/000017.seg.png`` is key ``a/b/000017``, extension ``seg.png``), and a
sample's members lie next to each other. A sample is read as
``{"__key__": key, "__url__": url, ext: bytes, ...}``.

Every position here is the byte offset of a member's header, so a reader can start at
any sample by one seek (:func:`samples`): no byte before it is read. That is what makes
a shard stream's state a handful of integers (``shards/stream.py``).

Headers are parsed here, not by ``tarfile.TarFile``: its iteration ends silently at a
bad or truncated header found past the first member, which would shorten an epoch
without a word. Here every such header, a member whose data is cut short, and a shard
that ends without tar's end-of-archive blocks is a :class:`ShardError` naming the shard,
the member and the byte offset.
"""

from __future__ import annotations

import tarfile
from collections.abc import Iterator
from typing import IO, Any

_BLOCK = tarfile.BLOCKSIZE


class ShardError(ValueError):
    """A tar shard cannot be read as the webdataset layout: it is missing, truncated or
    corrupt, or one of its samples has two members with the same extension. The message
    names the shard, the member (or the byte offset) and what was wrong."""


class _Cursor:
    """The few attributes of a ``TarFile`` that ``TarInfo.fromtarfile`` reads, so that
    tarfile's own parser (pax and GNU long names included) reads one header at a time."""

    encoding = "utf-8"
    errors = "surrogateescape"

    def __init__(self, fileobj: IO[bytes]) -> None:
        self.fileobj = fileobj
        self.pax_headers: dict[str, str] = {}
        self.offset = 0


def split_name(name: str) -> tuple[str, str] | None:
    """(key, extension) of a member name as webdataset splits it, or None for a name
    without an extension (webdataset skips those members)."""
    slash = name.rfind("/") + 1
    dot = name.find(".", slash)
    if dot <= slash:
        return None
    return name[:dot], name[dot + 1 :]


def _header(cursor: _Cursor, url: str, offset: int) -> tarfile.TarInfo | None:
    """The member whose header starts at ``offset``, or None at the end-of-archive block."""
    cursor.fileobj.seek(offset)
    cursor.offset = offset
    try:
        info = tarfile.TarInfo.fromtarfile(cursor)  # type: ignore[arg-type]
    except tarfile.EOFHeaderError:  # type: ignore[attr-defined]
        return None
    except (tarfile.EmptyHeaderError, tarfile.TruncatedHeaderError):  # type: ignore[attr-defined]
        raise ShardError(
            f"shard {url} ends at byte {offset} without tar's end-of-archive blocks: the file "
            "is truncated (an interrupted copy or download?); copy it again"
        ) from None
    except tarfile.HeaderError as exc:
        raise ShardError(
            f"shard {url} has a corrupt tar header at byte {offset} ({exc}): the file is "
            "damaged or not a tar file; copy it again or drop it from the shard list"
        ) from None
    return info


def _data(cursor: _Cursor, url: str, info: tarfile.TarInfo) -> bytes:
    cursor.fileobj.seek(info.offset_data)
    data = cursor.fileobj.read(info.size)
    if len(data) != info.size:
        raise ShardError(
            f"shard {url} is truncated in member {info.name!r} (header at byte {info.offset}): "
            f"{len(data)} of its {info.size} bytes are there; copy the shard again"
        )
    return data


def samples(fileobj: IO[bytes], url: str, offset: int, limit: int = -1) -> Iterator[tuple[int, int, dict[str, Any]]]:
    """The samples of a shard from the sample whose first header is at ``offset``:
    ``(offset, next_offset, sample)`` for each, ``next_offset`` being where the next
    sample starts (the end-of-archive block after the last). At most ``limit`` samples
    when ``limit`` >= 0 (the next sample's first header is still read, to end this one)."""
    cursor = _Cursor(fileobj)
    start, key = offset, None
    sample: dict[str, Any] | None = None
    done = 0
    while limit < 0 or done < limit:
        info = _header(cursor, url, offset)
        if info is None:
            if sample is not None:
                yield start, offset, sample
            return
        after = cursor.offset  # set by tarfile's parser: the next header's offset
        parts = split_name(info.name) if info.isreg() else None
        if parts is not None:
            member_key, ext = parts
            if member_key != key:
                if sample is not None:
                    yield start, offset, sample
                    done += 1
                    if done == limit:
                        return
                start, key, sample = offset, member_key, {"__key__": member_key, "__url__": url}
            assert sample is not None
            if ext in sample:
                raise ShardError(
                    f"shard {url}: sample {key!r} has two members with extension {ext!r} "
                    f"(the second, {info.name!r}, at byte {offset}): its members disagree on "
                    "what the sample is; rename one of them or write the shard again"
                )
            sample[ext] = _data(cursor, url, info)
        offset = after
