"""snaploader: a drop-in for torch's DataLoader whose mid-epoch checkpoints resume the
batch stream bit for bit, and which survives the death of a worker.

```python
from snaploader import DataLoader
loader = DataLoader(ds, batch_size=64, shuffle=True, num_workers=8, generator=g)
ckpt["loader"] = loader.state_dict()               # any time, mid-epoch, cheap
loader.load_state_dict(torch.load(path, weights_only=True)["loader"])
```
"""

from torch.utils.data import get_worker_info
from torch.utils.data._utils.worker import WorkerInfo

from ._errors import (
    CheckpointFormatError,
    CheckpointMismatchError,
    ReplayRefusedError,
    ResumeMismatchWarning,
    StateNotPlainDataError,
    WorkerCrashedError,
    WorkerRespawnedWarning,
)
from .distributed.dcp import DcpState, dcp_state
from ._loader import DataLoader
from .mixture import Mixture
from . import distributed

__all__ = [
    "CheckpointFormatError",
    "CheckpointMismatchError",
    "DataLoader",
    "DcpState",
    "Mixture",
    "ReplayRefusedError",
    "ResumeMismatchWarning",
    "StateNotPlainDataError",
    "WorkerCrashedError",
    "WorkerRespawnedWarning",
    "WorkerInfo",
    "dcp_state",
    "distributed",
    "get_worker_info",
]

__version__ = "0.1.0"
