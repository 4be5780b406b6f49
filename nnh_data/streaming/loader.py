"""``streaming_loader``: the DataLoader set-up under which a ``ShardedStreamingDataset`` keeps
every promise with workers.

A plain ``DataLoader(ds, batch_size=B, num_workers=W)`` cuts each worker's range into its own
batches, so it yields up to ``W`` short batches and more batches than its ``len()`` (which
``OneCycleLR(total_steps=...)`` trusts); and the dataset object in the main process never sees
the workers' progress. This helper tells the dataset the loader's batch size, so worker ranges
are cut in whole batches (``len(loader)`` is exact, at most one short batch per rank), and
returns torchdata's ``StatefulDataLoader``, whose ``state_dict()`` holds every worker's
position. Persistent workers are on by default with workers: the dataset shares its epoch with
them, so ``set_epoch`` reaches them. Workers ignore the signals meant for their rank
(:mod:`nnh_data.workers.signals`).
"""

from __future__ import annotations

import warnings
from typing import Any

from torchdata.stateful_dataloader import StatefulDataLoader

from nnh_data.checks import check_int
from nnh_data.streaming.dataset import ShardedStreamingDataset
from nnh_data.workers.handoff import collate_decoded, collate_rows
from nnh_data.workers.signals import shielded_worker_init

__all__ = ["streaming_loader"]

_REFUSED = ("shuffle", "sampler", "batch_sampler")


def streaming_loader(
    dataset: ShardedStreamingDataset, batch_size: int, num_workers: int = 0, **loader_kwargs: Any
) -> StatefulDataLoader:
    """A ``StatefulDataLoader`` over ``dataset`` yielding batches of ``batch_size`` samples.

    Per-sample datasets are collated by the loader; a dataset built with ``batch_size`` must
    have this same batch size (it yields the batches itself). ``loader_kwargs`` go to
    ``StatefulDataLoader`` (``persistent_workers`` defaults to ``num_workers > 0``).

    Example:
        >>> loader = streaming_loader(ds, batch_size=64, num_workers=4)  # doctest: +SKIP
        >>> steps = epochs * len(loader)  # exact                         # doctest: +SKIP
        >>> state = loader.state_dict()   # resume with loader.load_state_dict(state)
    """
    if not isinstance(dataset, ShardedStreamingDataset):
        raise ValueError(
            f"dataset must be a ShardedStreamingDataset, got {type(dataset).__name__}"
        )
    batch_size = check_int("batch_size", batch_size, low=1)
    num_workers = check_int("num_workers", num_workers, low=0)
    refused = [name for name in _REFUSED if name in loader_kwargs]
    if refused:
        raise ValueError(
            f"loader_kwargs must not set {refused}: the dataset orders and splits its samples"
        )
    if dataset.batch_size is None:
        dataset.set_loader_batch_size(batch_size)
        loader_batch: int | None = batch_size
    elif dataset.batch_size != batch_size:
        raise ValueError(
            f"batch_size is {batch_size} but the dataset yields batches of "
            f"{dataset.batch_size}: pass batch_size={dataset.batch_size}"
        )
    else:
        loader_batch = None
    loader_kwargs.setdefault("persistent_workers", num_workers > 0)
    iterated: Any = dataset
    if loader_batch is not None and "collate_fn" not in loader_kwargs:
        if dataset.decode is None:  # rows collated from their columns: no dict per sample
            iterated, loader_kwargs["collate_fn"] = dataset.loader_view(), collate_rows
        else:
            loader_kwargs["collate_fn"] = collate_decoded
    loader_kwargs["worker_init_fn"] = shielded_worker_init(loader_kwargs.get("worker_init_fn"))
    with warnings.catch_warnings():  # torchdata 0.11 calls torch.set_vital, which warns
        warnings.filterwarnings("ignore", "'set_vital' is deprecated", UserWarning)
        return StatefulDataLoader(
            iterated, batch_size=loader_batch, num_workers=num_workers, **loader_kwargs
        )
