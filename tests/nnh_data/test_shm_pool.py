"""The workers' reused shared-memory buffers (nnh_data.shm_pool): a buffer is written again only
after the receiving process let go of every tensor over it; batches a loop keeps stay as they
were; buffers are reused, a few per worker; a tensor that leaves some other way retires its
buffer."""

from __future__ import annotations

import gc

import pytest
import torch

from nnh_data import ShardedStreamingDataset, shm_pool, streaming_loader

SIDE = 96  # a decoded sample of 96x96x3 uint8 (27 KiB): batches of 48 are 1.3 MiB


def decode_image(sample: dict) -> dict:
    """A decoded "image" whose every byte tells the sample it came from."""
    g = int(sample["cls"])
    return {"image": torch.full((SIDE, SIDE, 3), g % 251, dtype=torch.uint8), "cls": g}


def test_a_buffer_is_written_again_only_after_the_receiver_lets_go():
    pool = shm_pool.Pool()
    shape = (shm_pool.MIN_BYTES,)
    first = pool.tensor(shape, torch.uint8)
    first.fill_(7)
    received = shm_pool.rebuild(*pool.placed(first))
    pointer = first.data_ptr()
    del first
    held = [pool.tensor(shape, torch.uint8) for _ in range(shm_pool.BUFFERS - 1)]
    assert pointer not in {t.data_ptr() for t in held}  # the receiver still holds the first
    assert pool.tensor(shape, torch.uint8) is None  # every buffer in use: the caller falls back
    assert torch.equal(received, torch.full(shape, 7, dtype=torch.uint8))
    view = received[:10]
    del received
    gc.collect()
    assert pool.tensor(shape, torch.uint8) is None  # a view still holds the buffer
    del view
    gc.collect()
    again = pool.tensor(shape, torch.uint8)
    assert again is not None and again.data_ptr() == pointer  # given back: the same memory


def test_a_tensor_that_leaves_another_way_retires_its_buffer():
    pool = shm_pool.Pool()
    shape = (shm_pool.MIN_BYTES,)
    lost = pool.tensor(shape, torch.uint8)
    storage = lost.untyped_storage()  # as torch's pickler would share the segment itself
    del lost
    assert pool.buffers[0] is None
    fresh = pool.tensor(shape, torch.uint8)
    assert fresh.untyped_storage().data_ptr() != storage.data_ptr()


def test_other_tensors_are_not_placed():
    pool = shm_pool.Pool()
    assert pool.placed(torch.zeros(3)) is None
    made = pool.tensor((shm_pool.MIN_BYTES,), torch.uint8)
    assert pool.placed(made) is not None and pool.placed(made) is None  # sent once


def _batches(urls: list[str], workers: int, context: str | None, keep: bool) -> list:
    ds = ShardedStreamingDataset(urls, decode=decode_image, seed=3)
    kwargs = {"multiprocessing_context": context} if workers else {}
    loader = streaming_loader(ds, 48, num_workers=workers, **kwargs)
    out = []
    for batch in loader:  # a loop that keeps every batch (no buffer may be reused under it)
        out.append((batch["cls"], batch["image"] if keep else None))
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_batches_kept_by_the_loop_stay_as_they_were(tar_shards, context):
    urls = tar_shards([150, 150, 150], size=8)
    expected = {int(c[0]): (c, image) for c, image in _batches(urls, 0, None, keep=True)}
    got = _batches(urls, 2, context, keep=True)
    assert len(got) == len(expected) > 2 * shm_pool.BUFFERS
    for cls, image in got:
        want_cls, want_image = expected[int(cls[0])]
        assert torch.equal(cls, want_cls) and torch.equal(image, want_image)
        assert torch.equal(image, (cls % 251).to(torch.uint8).view(-1, 1, 1, 1).expand_as(image))


@pytest.mark.timeout(240)
def test_a_worker_reuses_a_few_buffers(tar_shards):
    urls = tar_shards([200, 200, 200], size=8)
    before = set(shm_pool._received)
    got = _batches(urls, 2, "fork", keep=False)
    assert len(got) > 2 * shm_pool.BUFFERS + 2
    pools = [entry[2] for token, entry in shm_pool._received.items() if token not in before]
    assert pools and all(len(buffers) <= shm_pool.BUFFERS for buffers in pools)
