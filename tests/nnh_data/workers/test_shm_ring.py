"""The shared-memory ring (nnh_data.workers.shm_ring): arrays come out as they went in, slots come
back, and batches that do not fit go by value, with real DataLoader workers too."""

from __future__ import annotations

from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from nnh_data import PackedField
from nnh_data.workers import shm_ring
from nnh_data.workers.handoff import handed_out

pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("ignore::UserWarning")]


def arrays(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 255, 1000, dtype=np.uint8), rng.random((3, 5)),
            np.arange(7, dtype=np.int32), np.zeros(0, np.int64)]  # fmt: skip


def test_arrays_come_out_as_they_went_in_and_slots_come_back():
    ring = shm_ring.Ring(64 << 10)
    placed = [ring.put(arrays(i)) for i in range(shm_ring.SLOTS)]
    assert all(p is not None for p in placed) and ring.put(arrays(9)) is None  # all in use
    sent = [ForkingPickler.loads(ForkingPickler.dumps(p)) for p in placed]  # handles travel
    for i, message in enumerate(sent):
        got = shm_ring.rebuild(*message)
        assert all(a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(got, arrays(i)))
        got[0][:] = 0  # the receiver's own memory
    again = ring.put(arrays(20))
    assert again is not None and again[1] is None  # the ring is known now: no handle
    assert np.array_equal(shm_ring.rebuild(*again)[1], arrays(20)[1])
    assert ring.put([np.zeros(65 << 10, np.uint8)]) is None  # larger than a slot


def test_the_worker_ring_grows_to_fit_and_stops_at_the_cap():
    small = shm_ring.worker_ring(1000)
    assert shm_ring.worker_ring(500) is small
    bigger = shm_ring.worker_ring(small.slot_bytes + 1)
    assert bigger is not small and bigger.slot_bytes > small.slot_bytes
    assert shm_ring.worker_ring(shm_ring.MAX_SLOT_BYTES + 1) is None


class Batches(IterableDataset):
    def __init__(self, count: int, big: bool = False) -> None:
        self.count, self.big = count, big

    def __iter__(self):
        for i in range(self.count):
            yield handed_out(batch(i, self.big))


def batch(i: int, big: bool) -> dict:
    n = 9 if big else 1  # nine tensors of 512 KiB: more than the largest slot, so by value
    return {"ids": torch.arange(10) + i, "text": PackedField.pack([str(i), None, "é"]),
            **{f"t{k}": torch.full((1 << 17,), float(i + k)) for k in range(n)}}  # fmt: skip


@pytest.mark.parametrize("big", [False, True])
def test_many_batches_through_real_workers(big):
    """More batches than slots, all kept by the loop: each arrives intact."""
    loader = DataLoader(Batches(4 * shm_ring.SLOTS, big), batch_size=None, num_workers=2)
    got = list(loader)
    expected = [batch(i, big) for i in range(4 * shm_ring.SLOTS) for _ in range(2)]
    key = lambda b: int(b["ids"][0])  # noqa: E731
    for a, b in zip(sorted(got, key=key), sorted(expected, key=key)):
        assert a["text"] == b["text"] and all(torch.equal(a[k], b[k]) for k in b if k != "text")
