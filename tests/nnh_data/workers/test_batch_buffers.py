"""Reused batch buffers (nnh_data.workers.batch_buffers): a buffer is written again only after every
tensor over it was let go of (in the receiving process, or in the main process without
workers); batches a loop keeps stay as they were; buffers are reused, a few per process; a
tensor that leaves a worker some other way retires its buffer."""

from __future__ import annotations

import gc
import os
import threading
from pathlib import Path

import pytest
import torch

from nnh_data import ShardedStreamingDataset, streaming_loader
from nnh_data.workers import batch_buffers, shm_ring
from nnh_data.workers.handoff import collate_decoded

SIDE = 96  # a decoded sample of 96x96x3 uint8 (27 KiB): batches of 48 are 1.3 MiB


def decode_image(sample: dict) -> dict:
    """A decoded "image" whose every byte tells the sample it came from."""
    g = int(sample["cls"])
    return {"image": torch.full((SIDE, SIDE, 3), g % 251, dtype=torch.uint8), "cls": g}


def test_a_buffer_is_written_again_only_after_the_receiver_lets_go():
    pool = batch_buffers.Pool()
    shape = (batch_buffers.MIN_BYTES,)
    first = pool.tensor(shape, torch.uint8)
    first.fill_(7)
    received = batch_buffers.rebuild(*pool.placed(first))
    pointer = first.data_ptr()
    del first
    held = [pool.tensor(shape, torch.uint8) for _ in range(batch_buffers.BUFFERS - 1)]
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


def test_a_batch_the_worker_keeps_is_not_written_over():
    pool = batch_buffers.Pool()
    shape = (batch_buffers.MIN_BYTES,)
    kept = pool.tensor(shape, torch.uint8).fill_(5)  # a collate_fn keeping the last batch
    received = batch_buffers.rebuild(*pool.placed(kept))
    del received  # the receiver gives the buffer back
    made = [pool.tensor(shape, torch.uint8) for _ in range(batch_buffers.BUFFERS)]
    for tensor in made:
        if tensor is not None:
            tensor.fill_(9)
    assert torch.equal(kept, torch.full(shape, 5, dtype=torch.uint8))
    del kept
    assert pool.tensor(shape, torch.uint8) is not None  # let go of: in use again


def test_a_tensor_that_leaves_another_way_retires_its_buffer():
    pool = batch_buffers.Pool()
    shape = (batch_buffers.MIN_BYTES,)
    lost = pool.tensor(shape, torch.uint8)
    storage = lost.untyped_storage()  # as torch's pickler would share the segment itself
    del lost
    fresh = pool.tensor(shape, torch.uint8)
    assert fresh.untyped_storage().data_ptr() != storage.data_ptr()


def test_a_buffer_retired_while_a_tensor_is_being_made_is_not_handed_out(monkeypatch):
    pool = batch_buffers.Pool()
    shape = (batch_buffers.MIN_BYTES,)
    lost = [pool.tensor(shape, torch.uint8)]  # pickled by torch on the feeder thread
    pick = batch_buffers._pick

    def freed_meanwhile(*args):  # the feeder thread drops it now: its finalizer runs
        lost.clear()
        return pick(*args)

    monkeypatch.setattr(batch_buffers, "_pick", freed_meanwhile)
    made = pool.tensor(shape, torch.uint8)
    assert made is not None and pool.placed(made) is not None


def test_a_give_back_never_writes_to_a_file_opened_meanwhile(monkeypatch, tmp_path):
    pool = batch_buffers.Pool()
    received = _sent(pool)
    other, write = [], os.write

    def forgotten_meanwhile(fd, data):  # another thread lets go of the worker, opens a file
        batch_buffers._forget(pool.token)
        other.append(open(tmp_path / "other", "wb"))  # noqa: SIM115
        try:
            os.fstat(fd)
        except OSError:  # closed: the file opened may get its number (made so here)
            os.dup2(other[0].fileno(), fd)
        return write(fd, data)

    monkeypatch.setattr(os, "write", forgotten_meanwhile)
    del received  # the finalizer gives the buffer back
    monkeypatch.undo()
    other[0].close()
    assert (tmp_path / "other").read_bytes() == b""


def test_ended_workers_are_let_go_of_while_others_forget_theirs(monkeypatch):
    pools = [batch_buffers.Pool() for _ in range(3)]
    for pool, pid in zip(pools, [1, 2**22]):  # a live process, one that ended
        pool.token = (pid, 0)
        _sent(pool)
    alive = batch_buffers.process_alive

    def forgetting(pid):  # a finalizer on another thread lets go of the first worker
        batch_buffers._forget(pools[0].token)
        return alive(pid)

    monkeypatch.setattr(batch_buffers, "process_alive", forgetting)
    _sent(pools[2])
    assert pools[1].token not in batch_buffers._received
    assert pools[2].token in batch_buffers._received
    batch_buffers._forget(pools[2].token)


def _sent(pool: batch_buffers.Pool) -> torch.Tensor:
    """A tensor the pool made, as the receiving process gets it."""
    return batch_buffers.rebuild(*pool.placed(pool.tensor((batch_buffers.MIN_BYTES,), torch.uint8)))


def test_a_tensor_transposed_in_place_arrives_as_it_is():
    pool = batch_buffers.Pool()
    made = pool.tensor((4, 512, 1024), torch.uint8)
    made.copy_(torch.arange(made.numel(), dtype=torch.uint8).view(made.shape))
    made.transpose_(1, 2)  # a collate_fn's channel-first, in place: not contiguous
    placed = pool.placed(made)
    got = made if placed is None else batch_buffers.rebuild(*placed)
    assert torch.equal(got, made)


def test_a_tensor_made_to_require_grad_in_place_still_does():
    pool = batch_buffers.Pool()
    made = pool.tensor((batch_buffers.MIN_BYTES // 4,), torch.float32).zero_().requires_grad_()
    placed = pool.placed(made)
    assert (made if placed is None else batch_buffers.rebuild(*placed)).requires_grad


def test_other_tensors_are_not_placed():
    pool = batch_buffers.Pool()
    assert pool.placed(torch.zeros(3)) is None
    made = pool.tensor((batch_buffers.MIN_BYTES,), torch.uint8)
    assert pool.placed(made) is not None and pool.placed(made) is None  # sent once


def test_the_main_process_reuses_a_buffer_once_the_batch_over_it_is_freed():
    local = batch_buffers.LocalBuffers()
    shape = (512, 1024)
    first = local.tensor(shape, torch.int16)
    first.fill_(3)
    row, pointer = first[1], first.data_ptr()
    del first
    others = [local.tensor(shape, torch.int16) for _ in range(batch_buffers.BUFFERS - 1)]
    assert local.tensor(shape, torch.int16) is None  # a row of the first still holds its buffer
    assert torch.equal(row, torch.full((1024,), 3, dtype=torch.int16))
    del row
    gc.collect()
    again = local.tensor(shape, torch.int16)
    assert again is not None and again.data_ptr() == pointer
    del others


def test_a_tensor_with_another_view_is_not_placed():
    pool = batch_buffers.Pool()
    made = pool.tensor((batch_buffers.MIN_BYTES,), torch.uint8)
    view = made[1:]  # torch would send it on its own, over the same segment
    assert pool.placed(made) is None
    del made
    fresh = pool.tensor((batch_buffers.MIN_BYTES,), torch.uint8)
    assert fresh.untyped_storage().data_ptr() != view.untyped_storage().data_ptr()  # retired


def collate_with_view(samples: list) -> dict:
    """A user's collate_fn adding a channel-first view of the images."""
    batch = collate_decoded(samples)
    batch["chw"] = batch["image"].permute(0, 3, 1, 2)
    return batch


@pytest.mark.timeout(120)
def test_a_kept_view_sent_beside_its_batch_stays_as_it_was(tar_shards):
    ds = ShardedStreamingDataset(tar_shards([150, 150, 150], size=8), decode=decode_image, seed=3)
    loader = streaming_loader(ds, 48, num_workers=2, collate_fn=collate_with_view,
                              multiprocessing_context="fork")  # fmt: skip
    kept = [(batch["cls"], batch["chw"]) for batch in loader]  # the images let go of
    assert len(kept) > 2 * batch_buffers.BUFFERS
    for cls, chw in kept:
        assert torch.equal(chw, (cls % 251).to(torch.uint8).view(-1, 1, 1, 1).expand_as(chw))


def test_threads_collating_at_once_get_buffers_of_their_own(monkeypatch):
    local = batch_buffers.LocalBuffers()
    local.tensor((batch_buffers.MIN_BYTES,), torch.uint8)  # one buffer, free again
    both, pick = threading.Barrier(2, timeout=1), batch_buffers._pick

    def picked_together(*args):  # two main-process loaders, in two threads
        number = pick(*args)
        try:
            both.wait()
        except threading.BrokenBarrierError:
            pass
        return number

    monkeypatch.setattr(batch_buffers, "_pick", picked_together)
    made, errors = [], []

    def make() -> None:
        try:
            made.append(local.tensor((batch_buffers.MIN_BYTES,), torch.uint8))
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=make) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert errors == [] and len({t.data_ptr() for t in made}) == 2


def decode_pair(sample: dict) -> tuple:
    """A decoded sample as a tuple: the batch is a list, which torch pickles itself."""
    image = decode_image(sample)
    return image["image"], image["cls"]


@pytest.mark.timeout(120)
def test_batches_that_leave_as_torch_sends_them_stay_as_they_were(tar_shards):
    ds = ShardedStreamingDataset(tar_shards([150, 150, 150], size=8), decode=decode_pair, seed=3)
    loader = streaming_loader(ds, 48, num_workers=2, multiprocessing_context="fork")
    kept = [(images, cls) for _ in range(2) for images, cls in loader]  # each buffer retired
    assert len(kept) > 2 * batch_buffers.BUFFERS
    for images, cls in kept:
        assert torch.equal(images, (cls % 251).to(torch.uint8).view(-1, 1, 1, 1).expand_as(images))


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
    assert len(got) == len(expected) > 2 * batch_buffers.BUFFERS
    again = _batches(urls, 0, None, keep=True)  # without workers: the main process's buffers
    assert all(torch.equal(c, e[0]) and torch.equal(i, e[1])
               for (c, i), e in zip(again, expected.values(), strict=True))  # fmt: skip
    for cls, image in got:
        want_cls, want_image = expected[int(cls[0])]
        assert torch.equal(cls, want_cls) and torch.equal(image, want_image)
        assert torch.equal(image, (cls % 251).to(torch.uint8).view(-1, 1, 1, 1).expand_as(image))


@pytest.mark.timeout(240)
def test_a_worker_reuses_a_few_buffers(tar_shards, monkeypatch):
    urls = tar_shards([200, 200, 200], size=8)
    rebuilt, pools, rebuild = [], {}, batch_buffers.rebuild

    def counted(*args):  # the worker's buffers this process holds after each batch
        rebuilt.append(args)
        tensor = rebuild(*args)
        pools[args[0]] = len(batch_buffers._received[args[0]][2])
        return tensor

    monkeypatch.setattr(batch_buffers, "rebuild", counted)
    got = _batches(urls, 2, "fork", keep=False)
    assert len(got) > 2 * batch_buffers.BUFFERS + 2
    assert pools and all(n <= batch_buffers.BUFFERS for n in pools.values())
    assert len(rebuilt) > len(pools) * batch_buffers.BUFFERS  # more batches than buffers
    gc.collect()  # the loader and its workers' handles
    assert not set(pools) & set(batch_buffers._received)  # let go of with the loader


def decode_image_only(sample: dict) -> dict:
    return {"image": decode_image(sample)["image"]}  # nothing for the ring (workers.shm_ring)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("decode", [decode_image_only, decode_image], ids=["buffers", "ring"])
def test_ended_workers_leave_no_segment_under_file_system_sharing(tar_shards, tmp_path, decode):
    pids = tmp_path / "pids"
    ds = ShardedStreamingDataset(tar_shards([144, 144], size=8), decode=decode)
    strategy = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")  # named in /dev/shm, refcounted
    try:
        for _ in range(3):  # new workers every epoch
            loader = streaming_loader(ds, 48, num_workers=2, persistent_workers=False,
                                      multiprocessing_context="fork",
                                      worker_init_fn=lambda _: _note_pid(pids))  # fmt: skip
            assert sum(1 for _ in loader) > 2
            del loader
            gc.collect()
    finally:
        torch.multiprocessing.set_sharing_strategy(strategy)
    # the workers whose segments this process still maps (the last epoch's, and those it let go
    # of only when a newer worker's first batch comes)
    mapped = {token[0] for token in [*batch_buffers._received, *shm_ring._received]}
    ended = set(pids.read_text().split()) - {str(pid) for pid in mapped}
    assert len(ended) >= 4  # (one of the last may be let go of already)
    left = [n for n in os.listdir("/dev/shm") if n.split("_")[:2] in [["torch", p] for p in ended]]
    assert left == []


def _note_pid(path: Path) -> None:
    with open(path, "a") as f:
        f.write(f"{os.getpid()}\n")
