"""The pure rules of a world-size change (``distributed/rules.py``): which logical ranks a
new rank hosts, what is left of an interrupted epoch, and how it is dealt to the new
ranks. No loader, no process: test_world_size.py checks them end to end."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from snaploader._errors import CheckpointFormatError
from snaploader.distributed.rules import Source, hosted, remaining, sampler_for, share


def source(**changes: object) -> Source:
    plain = dict(num_replicas=4, shuffle=True, seed=3, sampler_drop_last=False, dataset_length=37,
                 batch_size=3, drop_last=False, sampler_epoch=2, consumed=(0, 0, 0, 0))
    plain.update(changes)
    return Source(**plain)  # type: ignore[arg-type]


def _batches(order: list[int], size: int, drop_last: bool) -> list[list[int]]:
    cut = [order[at : at + size] for at in range(0, len(order), size)]
    return cut[:-1] if cut and drop_last and len(cut[-1]) < size else cut


def _uninterrupted(src: Source) -> list[list[list[int]]]:
    """Per old rank, its batches of the epoch as torch's DistributedSampler gives them."""
    return [
        _batches(list(sampler_for(src, src.num_replicas, rank, src.sampler_epoch)), src.batch_size, src.drop_last)
        for rank in range(src.num_replicas)
    ]


@given(st.sampled_from([(4, 1), (4, 2), (4, 4), (6, 3), (6, 2)]))
def test_new_ranks_host_contiguous_blocks_covering_every_old_rank(sizes: tuple[int, int]) -> None:
    old, new = sizes
    blocks = [list(hosted(old, rank, new)) for rank in range(new)]
    assert [r for block in blocks for r in block] == list(range(old))
    assert {len(block) for block in blocks} == {old // new}


def _is_subsequence(part: list[int], whole: list[int]) -> bool:
    it = iter(whole)
    return all(any(i == j for j in it) for i in part)


@given(st.integers(0, 5), st.booleans(), st.booleans(), st.booleans(), st.integers(1, 4))
def test_remaining_is_what_the_old_world_had_left_in_its_order(
    consumed: int, drop_last: bool, sampler_drop_last: bool, shuffle: bool, batch_size: int
) -> None:
    # A world is taken at one step: every old rank has consumed as many batches.
    src = source(consumed=(consumed,) * 4, drop_last=drop_last, sampler_drop_last=sampler_drop_last,
                 shuffle=shuffle, batch_size=batch_size)
    per_rank = _uninterrupted(src)
    # Step by step, rank by rank: the order the old world's ranks would have gone on in.
    left: list[int] = []
    for step in range(max(len(b) for b in per_rank)):
        for rank, batches in enumerate(per_rank):
            if src.consumed[rank] <= step < len(batches):
                left.extend(batches[step])
    read = {i for rank, batches in enumerate(per_rank) for batch in batches[: src.consumed[rank]] for i in batch}
    pool = remaining(src)
    # In that order, each sample once: DistributedSampler's padding (a repeat of the
    # start of its index list) is left out, and so is what was already read.
    assert _is_subsequence(pool, left)
    assert len(pool) == len(set(pool)) and not set(pool) & read
    if not drop_last and not sampler_drop_last:  # every sample is read, once
        assert set(pool) | read == set(range(src.dataset_length))


def test_nothing_remains_of_an_epoch_that_is_not_under_way() -> None:
    assert remaining(source(sampler_epoch=None)) == []


@given(st.lists(st.integers(0, 100), max_size=40, unique=True), st.integers(1, 5), st.integers(1, 4))
def test_share_deals_whole_batches_round_robin_and_loses_nothing(pool: list[int], batch_size: int, world: int) -> None:
    shares = [share(pool, batch_size, rank, world) for rank in range(world)]
    assert sorted(i for part in shares for i in part) == sorted(pool)
    batches = [pool[at : at + batch_size] for at in range(0, len(pool), batch_size)]
    for rank, part in enumerate(shares):
        assert part == [i for batch in batches[rank::world] for i in batch]


def test_a_source_survives_plain_data_and_a_bad_one_is_named() -> None:
    src = source(consumed=(1, 2, 0, 3))
    assert Source.from_plain(src.to_plain(), "x") == src
    with pytest.raises(CheckpointFormatError, match="state\\['reshard'\\] is not a re-partition source"):
        Source.from_plain({"num_replicas": 4}, "state['reshard']")
    with pytest.raises(CheckpointFormatError, match=r"\[.consumed.\] should be a list of one count per old rank"):
        Source.from_plain({**src.to_plain(), "consumed": [1, 2]}, "x")
