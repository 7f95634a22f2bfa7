"""Tar-shard streams in the webdataset layout, resumable in O(shuffle buffer)
(docs/shards.md).

```python
from snaploader import DataLoader
from snaploader.shards import ShardStream, decode
stream = ShardStream(urls, shuffle_buffer=1000, map=lambda s: augment(decode(s)))
loader = DataLoader(stream, batch_size=64, num_workers=8, generator=g)
```
"""

from .decode import Decoder, decode
from .resplit import ResplitLoader, resplit
from .stream import ShardIterator, ShardStream
from .tar import ShardError

__all__ = ["Decoder", "ResplitLoader", "ShardError", "ShardIterator", "ShardStream", "decode", "resplit"]
