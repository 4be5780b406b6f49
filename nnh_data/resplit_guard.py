"""Training frameworks' loader wrappers that would split a rank's share a second time, stopped
where they call into nnh.

nnh's loaders hand each rank its own share of the epoch. Wrappers that frameworks put around
a loader to shard it (Accelerate's ``prepare()``, Lightning's ``use_distributed_sampler``) would
then keep 1/N of that share on each rank, silently: the loss curve looks normal while most of
the data is never read. The known wrappers call an nnh dataset's ``__iter__``/``set_epoch`` or
an nnh sampler's ``__iter__`` directly, so those check their caller (one frame up) and raise
at once with the fix. A wrapper further up (a user's own dataset between them) is not seen
here; :class:`~nnh_data.audit.epoch_audit.EpochAudit` catches that case at the epoch's end. The
trade-off: a look at one frame per ``iter()``, against a run that would otherwise train on a part
of its data without a word.
"""

from __future__ import annotations

import sys

__all__ = ["check_caller"]

_ACCELERATE_FIX = (
    "nnh's loaders give each rank its own share already: do not pass them to "
    "accelerator.prepare(). Prepare the model and optimizer only, iterate the nnh loader on "
    "every rank, move each batch with accelerate.utils.send_to_device(batch, "
    "accelerator.device), and checkpoint the loader with "
    "accelerator.register_for_checkpointing(loader)"
)
_WRAPPERS = {
    ("accelerate", "IterableDatasetShard"): (
        "Accelerate's prepare() wrapped an nnh dataset in IterableDatasetShard "
        "(dispatch_batches=False), which keeps 1/N of each rank's share", _ACCELERATE_FIX),
    ("accelerate", "DataLoaderDispatcher"): (
        "Accelerate's prepare() made a DataLoaderDispatcher of an nnh loader (its default for "
        "an IterableDataset): rank 0 would read only its own share and slice it over the ranks",
        _ACCELERATE_FIX),
    ("lightning", "_DatasetSamplerWrapper"): (
        "Lightning wrapped the rank-cached loader's sampler in a DistributedSamplerWrapper "
        "(use_distributed_sampler=True), which keeps 1/N of each rank's share",
        "the rank-cached loader splits the data over the ranks itself: pass "
        "Trainer(use_distributed_sampler=False)"),
}  # fmt: skip
_PACKAGES = {"accelerate": "accelerate", "lightning": "lightning",
             "pytorch_lightning": "lightning", "lightning_fabric": "lightning"}  # fmt: skip


def check_caller() -> None:
    """Raise ``RuntimeError`` when the function calling this one was called by a framework
    wrapper that shards its loader again (see the module's docstring)."""
    frame = sys._getframe(2)
    # only a framework's frame: before Python 3.13, reading f_locals keeps a copy of the
    # caller's locals in its frame (a training loop's dropped batches) until it returns
    if frame.f_globals.get("__name__", "").split(".")[0] not in _PACKAGES:
        return
    owner = frame.f_locals.get("self")
    if owner is None:
        return
    cls = type(owner)  # not owner.__class__: Accelerate's loaders pose as their base loader
    package = _PACKAGES.get(cls.__module__.split(".")[0])
    known = _WRAPPERS.get((package, cls.__name__))
    if known is not None:
        what, fix = known
        raise RuntimeError(f"{what}. Fix: {fix}.")
