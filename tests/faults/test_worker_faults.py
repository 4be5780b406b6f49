"""What a DataLoader worker cannot send to the main process: a tar member named with bytes that
are not UTF-8 (a key with lone surrogates) reaches the user as the same key with and without
workers; a batch that cannot be pickled (a ``decode`` returning a lock) and an exception that
cannot be pickled (of a class local to a function) raise an ``UnsendableError`` in the main
process naming the worker, the shard and the sample, never a hang or an empty epoch."""

from __future__ import annotations

import gc
import io
import multiprocessing.resource_tracker
import tarfile
import threading
from collections import Counter
from pathlib import Path

import pytest
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from nnh_data import ShardedStreamingDataset, build_shard_index, streaming_loader
from nnh_data.errors import UnsendableError
from nnh_data.workers.signals import shielded_worker_init

pytestmark = pytest.mark.timeout(60)
BAD = "bad\udcff\udcfe"  # the member name's bytes b"bad\xff\xfe" as nnh decodes them
UNSENDABLE = "k0002"  # the sample whose decoded value cannot be pickled


def _write(path: Path, count: int) -> Path:
    """A tar of ``count`` one-field samples, the second named with bytes that are not UTF-8."""
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT, encoding="utf-8",
                      errors="surrogateescape") as tar:  # fmt: skip
        for i in range(count):
            info = tarfile.TarInfo(f"{BAD if i == 1 else f'k{i:04d}'}.bin")
            info.size = 8
            tar.addfile(info, io.BytesIO(b"%08d" % i))
    return path


@pytest.fixture(scope="module", params=[3, 100], ids=["3-samples", "100-samples"])
def shard(request, tmp_path_factory) -> Path:
    return _write(tmp_path_factory.mktemp("names") / "shard.tar", request.param)


def _keys(loader) -> Counter:
    """The keys of the real samples ``loader`` yields in one epoch (the loader is gone after)."""
    try:
        return Counter(key for batch in loader for key, pad in _rows(batch) if not pad)
    except BaseException as exc:
        exc.__traceback__ = None  # its frames hold the loader's workers
        raise
    finally:
        del loader
        gc.collect()


@pytest.fixture(scope="module", autouse=True)
def resource_tracker() -> None:
    """multiprocessing's resource tracker, which the first spawned worker starts for the rest
    of the session, started before the suite's ``no_leaks`` counts this test's children."""
    multiprocessing.resource_tracker.ensure_running()


def _rows(batch: dict) -> zip:
    """The ``(key, pad)`` of each sample of ``batch`` (or of the one sample it is)."""
    if isinstance(batch["__key__"], str):
        return zip([batch["__key__"]], [batch["__pad__"]])
    return zip(batch["__key__"], batch["__pad__"])


def _loader(kind: str, shard: Path, workers: int, **kwargs):
    """``kind`` of loader over ``shard``, batches of 4."""
    index = build_shard_index(str(shard))
    if kind == "DataLoader":
        return DataLoader(ShardedStreamingDataset(index, **kwargs), batch_size=4,
                          num_workers=workers)  # fmt: skip
    if kind == "streaming_loader":
        return streaming_loader(ShardedStreamingDataset(index, **kwargs), 4, workers)
    batched = ShardedStreamingDataset(index, batch_size=4, **kwargs)
    if kind == "batched DataLoader":
        return DataLoader(batched, batch_size=None, num_workers=workers)
    return StatefulDataLoader(batched, batch_size=None, num_workers=workers)


LOADERS = ["DataLoader", "batched DataLoader", "streaming_loader", "StatefulDataLoader"]


@pytest.mark.parametrize("on_error", ["raise", "skip"])
@pytest.mark.parametrize("kind", LOADERS)
def test_a_key_of_bytes_that_are_not_utf8_is_the_same_with_workers(kind, on_error, shard):
    alone = _keys(_loader(kind, shard, 0, on_error=on_error))
    assert alone[BAD] == 1 and sum(alone.values()) == len(tarfile.open(shard).getmembers())
    assert _keys(_loader(kind, shard, 2, on_error=on_error)) == alone


class _Lock:
    """A decoded value that cannot be pickled."""

    def __init__(self) -> None:
        self.lock = threading.Lock()


def _decode_unsendable(sample: dict) -> dict:
    """One sample's value does not pickle; the others' are None (a nullable column: batches
    hold the list of the values)."""
    return {**sample, "value": _Lock() if sample["__key__"] == UNSENDABLE else None}


def _unsendable_loader(batched: bool, context: str, shard: Path):
    ds = ShardedStreamingDataset(build_shard_index(str(shard)), decode=_decode_unsendable)
    if batched:
        return streaming_loader(ds, 4, 2, multiprocessing_context=context)
    return DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context=context)


@pytest.mark.parametrize("context", ["fork", "spawn"])
@pytest.mark.parametrize("batched", [False, True], ids=["per-sample", "batches"])
def test_a_batch_a_worker_cannot_send_raises_naming_the_sample(batched, context, shard):
    with pytest.raises(UnsendableError) as raised:  # the loader lives in _keys alone
        _keys(_unsendable_loader(batched, context, shard))
    message = str(raised.value)
    assert "worker" in message and f"'{UNSENDABLE}'" in message and str(shard) in message
    assert "_thread.lock" in message


def _collate_raising_a_local_error(samples: list) -> None:
    class Unpicklable(Exception):  # a class local to the function: its instances cannot be sent
        pass

    raise Unpicklable(f"failed on {samples[0]['__key__']!r}")


def test_an_exception_a_worker_cannot_send_raises_in_the_main_process(shard):
    ds = ShardedStreamingDataset(build_shard_index(str(shard)))
    with pytest.raises(UnsendableError, match=r"(?s)worker \d.*Unpicklable.*failed on 'k\d{4}'"):
        _keys(DataLoader(ds, batch_size=4, num_workers=2,
                         collate_fn=_collate_raising_a_local_error))  # fmt: skip


def _init_raising_a_local_error(worker_id: int) -> None:
    class Unpicklable(Exception):  # a class local to the function: its instances cannot be sent
        pass

    raise Unpicklable(f"worker {worker_id} could not start")


@pytest.mark.parametrize("stateful", [False, True], ids=["DataLoader", "streaming_loader"])
def test_an_exception_the_users_worker_init_fn_cannot_send_raises(shard, stateful):
    ds = ShardedStreamingDataset(build_shard_index(str(shard)))
    if stateful:
        loader = streaming_loader(ds, 4, 2, worker_init_fn=_init_raising_a_local_error)
    else:
        loader = DataLoader(ds, batch_size=4, num_workers=2,
                            worker_init_fn=shielded_worker_init(_init_raising_a_local_error))
    with pytest.raises(UnsendableError, match=r"(?s)worker \d.*Unpicklable.*could not start"):
        _keys(loader)
