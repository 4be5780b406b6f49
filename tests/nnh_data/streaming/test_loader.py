"""streaming_loader and DataLoader workers: exact len(), set_epoch reaching persistent workers
(fork and spawn, plain DataLoader and StatefulDataLoader), state taken where it is visible, no
warning of torchdata's at a loader's start."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

import pytest
import torch
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from nnh_data import ShardedStreamingDataset, streaming_loader
from tests.support import ROOT

pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("ignore::UserWarning")]


def _ids(batches) -> list[int]:
    return [int(i) for b in batches for i in b["__index__"]]


@pytest.mark.parametrize(
    ("world", "workers", "batch"), [(1, 2, 8), (3, 2, 4), (2, 3, 5), (4, 0, 3)]
)
def test_len_is_the_batches_it_yields(tar_shards, world, workers, batch):
    urls = tar_shards([7, 5, 9, 3])
    seen = Counter()
    lengths = set()
    for rank in range(world):
        ds = ShardedStreamingDataset(urls, rank=rank, world_size=world, seed=3, shuffle_window=4)
        loader = streaming_loader(ds, batch, num_workers=workers, persistent_workers=False)
        batches = list(loader)
        assert len(batches) == len(loader)
        assert sum(len(b["__index__"]) < batch for b in batches) <= 1  # one short batch
        lengths.add(len(batches))
        seen.update(i for b in batches for i, p in zip(b["__index__"], b["__pad__"]) if not p)
    assert len(lengths) == 1  # equal batch counts per rank
    assert sorted(int(i) for i in seen.elements()) == list(range(24))


def test_plain_dataloader_len_is_the_hazard_the_helper_fixes(tar_shards):
    """The issue's case: DataLoader(ds, batch_size=8, num_workers=2) over 20 samples."""
    ds = ShardedStreamingDataset(tar_shards([20]), seed=0)
    loader = streaming_loader(ds, 8, num_workers=2)
    assert len(loader) == 3 and sorted(len(b["__index__"]) for b in loader) == [4, 8, 8]


@pytest.mark.parametrize("context", ["fork", "spawn"])
@pytest.mark.parametrize("stateful", [False, True])
def test_set_epoch_reaches_persistent_workers(tar_shards, context, stateful):
    ds = ShardedStreamingDataset(tar_shards([6, 6]), seed=1, shuffle_window=4)
    kind = StatefulDataLoader if stateful else DataLoader
    loader = kind(ds, batch_size=4, num_workers=2, persistent_workers=True,
                  multiprocessing_context=context)  # fmt: skip
    orders, augs = [], []
    for epoch in range(3):
        ds.set_epoch(epoch)
        batches = list(loader)
        ids = _ids(batches)
        assert sorted(ids) == list(range(12))
        orders.append(ids)
        assert all(int(e) == epoch for b in batches for e in b["__aug__"]["epoch"])
        augs.append(
            {i: float(r) for b in batches for i, r in zip(_ids([b]), b["__aug__"]["rotation"])}
        )
    assert len({tuple(o) for o in orders}) == 3
    assert augs[0][0] != augs[1][0] != augs[2][0]


def test_state_of_the_main_process_after_workers_is_refused(tar_shards):
    ds = ShardedStreamingDataset(tar_shards([10]), seed=0)
    list(DataLoader(ds, batch_size=4, num_workers=2))
    with pytest.raises(RuntimeError, match="StatefulDataLoader"):
        ds.state_dict()
    list(ds)  # iterated here: the main process knows its progress again
    assert ds.state_dict()["consumed"] == [10]


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_state_resumes_exactly(tar_shards, workers):
    urls = tar_shards([9, 4, 11])
    full = _ids(streaming_loader(ShardedStreamingDataset(urls, seed=2), 4, num_workers=workers))
    ds = ShardedStreamingDataset(urls, seed=2)
    loader = streaming_loader(ds, 4, num_workers=workers)
    it = iter(loader)
    head = _ids([next(it) for _ in range(3)])
    state = loader.state_dict()
    del it
    resumed = streaming_loader(ShardedStreamingDataset(urls, seed=2), 4, num_workers=workers)
    resumed.load_state_dict(state)
    tail = _ids(resumed)
    assert head + tail == full or sorted(head + tail) == sorted(full)
    assert sorted(head + tail) == list(range(24)) and not set(head) & set(tail)


def test_bad_arguments(tar_shards):
    ds = ShardedStreamingDataset(tar_shards([4]), batch_size=2)
    with pytest.raises(ValueError, match="pass batch_size=2"):
        streaming_loader(ds, 3)
    with pytest.raises(ValueError, match="must not set"):
        streaming_loader(ds, 2, shuffle=True)
    with pytest.raises(ValueError, match="ShardedStreamingDataset"):
        streaming_loader(list(range(3)), 2)
    batches = list(streaming_loader(ds, 2))
    assert [len(b["__index__"]) for b in batches] == [2, 2]
    assert isinstance(batches[0]["__aug__"]["seed"], torch.Tensor)


LOADER_RUN = """
import sys
from nnh_data import ShardedStreamingDataset, streaming_loader

urls, workers, context = sys.argv[1].split(","), int(sys.argv[2]), sys.argv[3]
for epoch in range(2):  # a persistent loader, then a new one: each start
    ds = ShardedStreamingDataset(urls, seed=0)
    context_kwargs = {"multiprocessing_context": context} if workers else {}
    loader = streaming_loader(ds, 4, num_workers=workers, **context_kwargs)
    print(sum(len(b["__index__"]) for b in loader))
"""


@pytest.mark.parametrize(("workers", "context"), [(0, "-"), (2, "fork"), (2, "spawn")])
def test_no_torchdata_warning_at_loader_start(tar_shards, workers, context):
    """torchdata 0.11's StatefulDataLoader calls the deprecated torch.set_vital: not ours to
    show. Every warning is shown here (-W always), in the main process and the workers."""
    urls = ",".join(tar_shards([6, 5]))
    done = subprocess.run(
        [sys.executable, "-W", "always", "-c", LOADER_RUN, urls, str(workers), context],
        cwd=ROOT, capture_output=True, text=True, timeout=100,
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout.split() == ["11", "11"], done.stderr[-3000:]
    assert "set_vital" not in done.stderr, done.stderr[-3000:]


NO_PANDAS_RUN = """
import sys
from multiprocessing import util
from nnh_data import ShardedStreamingDataset, streaming_loader
def at_exit(_):  # a worker tells, as it ends, whether it imported pandas
    util.Finalize(None, lambda: print("pandas" in sys.modules, flush=True), exitpriority=100)
urls, batch_size, workers = sys.argv[1].split(","), sys.argv[2], int(sys.argv[3])
ds = ShardedStreamingDataset(urls, batch_size=None if batch_size == "-" else int(batch_size))
loader = streaming_loader(ds, 4, num_workers=workers, worker_init_fn=at_exit,
                          persistent_workers=False)
print(sum(len(b["__index__"]) for b in loader), "pandas" in sys.modules, flush=True)
"""


@pytest.mark.parametrize(("batch_size", "workers"), [("-", 0), ("-", 2), ("4", 0)])
def test_a_tar_pass_does_not_import_pandas(tar_shards, batch_size, workers):
    """pyarrow imports pandas at its first ``pa.array`` (0.2 s of CPU and tens of MB in each
    DataLoader worker): the tar path makes its Arrow arrays without it."""
    urls = ",".join(tar_shards([6, 5]))
    done = subprocess.run([sys.executable, "-c", NO_PANDAS_RUN, urls, batch_size, str(workers)],
                          cwd=ROOT, capture_output=True, text=True, timeout=100)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(done.stdout.split()) == ["11"] + ["False"] * (1 + workers), done.stdout
