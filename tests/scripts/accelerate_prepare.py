"""Launched by ``accelerate launch --multi_gpu --num_processes 2 ... SHARDS``: nnh loaders passed
to ``accelerator.prepare()``, the mistake users make. Each case prints one JSON line per rank:

- ``dispatch``: Accelerate's default for an IterableDataset (rank 0 reads and dispatches);
- ``shard``: ``DataLoaderConfiguration(dispatch_batches=False)`` (``IterableDatasetShard``);
- ``shard_wrapped``: the same around a user's pass-through dataset, which hides the wrapper
  from nnh: the epoch runs and the audit judges it;
- ``cached``: the map-style rank-cached loader (``BatchSamplerShard``), judged by the audit.
"""

from __future__ import annotations

import json
import os
import sys

from accelerate import Accelerator, DataLoaderConfiguration
from torch.utils.data import DataLoader, IterableDataset

from nnh_data import ShardedStreamingDataset, create_rank_cached_dataloader, streaming_loader
from nnh_data.audit.epoch_audit import EpochAudit
from nnh_data.errors import ExactlyOnceError

BATCH = 16


class PassThrough(IterableDataset):
    """A user's dataset around nnh's (say, one that tokenizes): it yields what nnh yields."""

    def __init__(self, dataset: ShardedStreamingDataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __iter__(self):
        yield from self.dataset


def loader_of(case: str, dataset: ShardedStreamingDataset):
    if case == "shard_wrapped":
        return DataLoader(PassThrough(dataset), batch_size=BATCH)
    if case == "cached":
        kwargs = {"batch_size": BATCH, "num_workers": 0}
        return create_rank_cached_dataloader(dataset, kwargs, "cpu", log_fn=len)[0]
    return streaming_loader(dataset, BATCH, num_workers=1)


def run(case: str, source: str) -> dict:
    config = DataLoaderConfiguration(dispatch_batches=None if case == "dispatch" else False)
    accelerator = Accelerator(cpu=True, dataloader_config=config)
    dataset = ShardedStreamingDataset(source, seed=0, shuffle_window=64)
    audit = EpochAudit(dataset)
    loader = accelerator.prepare(loader_of(case, dataset))
    out = {"case": case, "rank": accelerator.process_index, "consumed": 0}
    try:
        for batch in loader:
            audit.update(batch)
            out["consumed"] += len(batch["__index__"])
        audit.verify()
    except (RuntimeError, ExactlyOnceError) as exc:
        out.update(error=type(exc).__name__, message=str(exc))
    return out


def main(source: str) -> None:
    for case in ("dispatch", "shard", "shard_wrapped", "cached"):
        os.write(1, (json.dumps(run(case, source)) + "\n").encode())  # one write per line
    # the group torn down before exit, as Accelerate asks: left to interpreter exit, gloo can
    # abort the process ("terminate called without an active exception")
    Accelerator(cpu=True).end_training()


if __name__ == "__main__":
    main(sys.argv[1])
