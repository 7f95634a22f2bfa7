"""``num_workers=0`` (``_workers/inline_runner.py``): the RNG swap around each fetch is process-wide,
so another thread drawing from the global RNGs during a fetch changes the stream; the
loader says so, once, where it can see it, and says nothing when no thread draws."""

from __future__ import annotations

import random
import threading
import warnings
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset

from snaploader import DataLoader

pytestmark = pytest.mark.usefixtures("keep_global_rngs")

_WAIT_S = 30.0


class Drawer(threading.Thread):
    """A thread that draws from ``random`` each time it is asked to (``draws=True``),
    or only acknowledges (``draws=False``: a thread that exists and stays off the RNGs)."""

    def __init__(self, draws: bool) -> None:
        super().__init__(daemon=True)
        self.draws = draws
        self.asked = threading.Event()
        self.done = threading.Event()
        self.stopping = False

    def run(self) -> None:
        while not self.stopping:
            if self.asked.wait(0.05):
                self.asked.clear()
                if self.draws:
                    random.random()
                self.done.set()

    def during_fetch(self) -> None:
        self.done.clear()
        self.asked.set()
        assert self.done.wait(_WAIT_S), "the drawing thread did not answer"


class NoisyWhileFetching(Dataset[torch.Tensor]):
    """Its ``state_dict()`` runs inside the fetch, after the RNG capture of the batch's
    snapshot: the moment another thread's draw lands there is made certain."""

    def __init__(self, n: int, drawer: Drawer) -> None:
        self.n = n
        self.drawer = drawer

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i, random.random()])

    def state_dict(self) -> dict[str, Any]:
        self.drawer.during_fetch()
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


@pytest.mark.parametrize("draws", [True, False])
def test_another_thread_drawing_during_a_fetch_is_reported_once(draws: bool) -> None:
    drawer = Drawer(draws)
    drawer.start()
    try:
        loader = DataLoader(NoisyWhileFetching(8, drawer), batch_size=2, num_workers=0,
                            generator=torch.Generator().manual_seed(1))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            batches = list(loader)
    finally:
        drawer.stopping = True
        drawer.join()
    assert len(batches) == 4
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    if draws:
        assert len(said) == 1, said
        assert "another thread drew from random" in said[0] and "not thread-safe" in said[0]
        assert caught[0].filename == __file__  # points at the user's loop
    else:
        assert said == []
