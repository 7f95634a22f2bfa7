import torch
from torch.utils.data import TensorDataset

import snaploader


def test_two_workers_match_torch() -> None:
    ds = TensorDataset(torch.arange(20))
    ours = [b[0] for b in snaploader.DataLoader(ds, batch_size=3, shuffle=True, num_workers=2, generator=torch.Generator().manual_seed(1))]
    theirs = [b[0] for b in torch.utils.data.DataLoader(ds, batch_size=3, shuffle=True, num_workers=2, generator=torch.Generator().manual_seed(1))]
    assert len(ours) == len(theirs) and all(torch.equal(a, b) for a, b in zip(ours, theirs))
