"""Data mixtures that resume exactly, even when their weights or sources change
(docs/mixtures.md).

```python
from snaploader import DataLoader
from snaploader.mixture import Mixture
mix = Mixture({"web": web, "code": code}, {"web": 0.7, "code": 0.3}, samples_per_epoch=100_000, seed=0)
loader = DataLoader(mix, batch_size=64, num_workers=8, generator=g)
```
"""

from .mixture import Mixture, MixtureSampler

__all__ = ["Mixture", "MixtureSampler"]
