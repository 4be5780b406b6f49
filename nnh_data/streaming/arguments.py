"""``ShardedStreamingDataset``'s arguments checked and shaped, before the dataset holds them.

What to read (:func:`open_sources`: URLs, an index or :class:`~nnh_data.order.mixing.Source`
objects, indexed here or on rank 0 under a process group, with each source's draws per epoch)
and how (the checked augmentation config, decoder, cache and precomputed table). Every check
raises a ``ValueError`` that names the argument, the rule and the value, at construction, so a
mistake never reaches a DataLoader worker.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from nnh_data.augment.params import AugmentationConfig, param_names
from nnh_data.cache.store import ShardCache
from nnh_data.checks import check_int
from nnh_data.images.decoders import DECODER_NAMES, SampleDecoder
from nnh_data.order.global_batches import PARTITIONS
from nnh_data.order.mixing import Source, plan_counts
from nnh_data.precompute.read import PrecomputedParams, load_precomputed_params
from nnh_data.shards.columnar import preload_conversions
from nnh_data.shards.index import ShardIndex, build_shard_index
from nnh_data.shards.sources import is_local
from nnh_data.topology import built_on_rank0, dist_ready

__all__ = [
    "REMOTE_READAHEAD",
    "Data",
    "cache_of",
    "checked_config",
    "checked_decode",
    "checked_global",
    "default_readahead",
    "open_sources",
    "precomputed_of",
]

REMOTE_READAHEAD = 2  # read blocks fetched ahead for remote filesystems


@dataclass(frozen=True)
class Data:
    """What a dataset reads: its sources, their indexes, the draws of each per epoch."""

    sources: list[Source]
    mixed: bool  # samples labelled with their source and repeats
    indexes: list[ShardIndex]
    counts: list[int]  # draws per epoch, per source

    @property
    def index(self) -> ShardIndex:
        """All shards, in source order."""
        if len(self.indexes) == 1:
            return self.indexes[0]
        return ShardIndex(tuple(info for i in self.indexes for info in i.shards))

    def fingerprint(self) -> str:
        """What a state checks: the shard list of one source, or of every source with its
        name and draws."""
        if not self.mixed:
            return self.indexes[0].fingerprint()
        parts = [[s.name, i.fingerprint(), c]
                 for s, i, c in zip(self.sources, self.indexes, self.counts)]  # fmt: skip
        return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]


def open_sources(
    source: Any,
    epoch_size: int | None,
    rank: int | None,
    world_size: int | None,
    defaults: dict[str, Any],
) -> Data:
    """``source`` (anything ``ShardedStreamingDataset`` takes) as :class:`Data`: each source
    indexed with ``defaults`` (format, storage options, index path, on_error) where it sets
    none, and its draws per epoch planned (:func:`~nnh_data.order.mixing.plan_counts`)."""
    sources, mixed = _as_sources(source, epoch_size)
    indexes = [_index_of(s, rank, world_size, defaults) for s in sources]
    if any(info.format != "tar" for index in indexes for info in index.shards):
        preload_conversions()  # once here, not in each DataLoader worker
    counts = plan_counts([i.total_samples for i in indexes], sources, epoch_size)
    return Data(sources, mixed, indexes, counts)


def default_readahead(index: ShardIndex) -> int:
    """Read blocks fetched ahead when the user sets none: 0 for local shards (a thread only
    adds hand-off cost), :data:`REMOTE_READAHEAD` for remote ones (judged by the first)."""
    return 0 if not index.shards or is_local(index.shards[0].url) else REMOTE_READAHEAD


def checked_global(
    global_batch_size: int | None,
    partitions: int | None,
    data: Data,
    *,
    rank_aware_params: bool,
    on_error: str,
    batch_size: int | None,
) -> tuple[int, int] | None:
    """``(global_batch_size, partitions)`` of a dataset of global batches (partitions default
    to :data:`~nnh_data.order.global_batches.PARTITIONS`), or None without; what the mode
    cannot keep is refused, saying why (the world size is checked with the split)."""
    if global_batch_size is None:
        if partitions is not None:
            raise ValueError(f"partitions={partitions!r} applies to global batches: pass "
                             "global_batch_size too, or leave partitions unset")  # fmt: skip
        return None
    size = check_int("global_batch_size", global_batch_size, low=1)
    partitions = check_int("partitions", PARTITIONS if partitions is None else partitions, low=1)
    if data.mixed:
        raise ValueError(
            "global_batch_size needs one source read once per epoch: a mix (several sources, "
            "Source objects or an epoch_size) interleaves each source's own order, whose "
            "shuffle windows the lanes of global batches cannot own; leave global_batch_size "
            "unset to mix"
        )
    if rank_aware_params:
        raise ValueError(
            "rank_aware_params=True keys the parameters by rank and world size, so a global "
            "batch would carry other parameters at another world size; leave it False with "
            "global_batch_size"
        )
    if on_error == "skip" and batch_size is None:
        raise ValueError(
            "on_error='skip' leaves unreadable samples out of a per-sample pass, which would "
            "shift every later loader batch of the worker; with global_batch_size use "
            "on_error='raise', or batch_size= (a batch then holds fewer rows)"
        )
    return size, partitions


def cache_of(cache_dir: str | os.PathLike | None, limit: int | str | None) -> ShardCache | None:
    """The node-local shard cache in ``cache_dir``, or None without one."""
    if cache_dir is None:
        if limit is not None:
            raise ValueError(
                f"cache_limit={limit!r} needs a cache_dir (a node-local folder) to limit; "
                "pass cache_dir too, or leave cache_limit=None"
            )
        return None
    if not isinstance(cache_dir, (str, os.PathLike)):
        raise ValueError(f"cache_dir must be a folder path or None, got {cache_dir!r}")
    return ShardCache(cache_dir, limit)


def precomputed_of(
    precomputed: str | os.PathLike | PrecomputedParams | None, mixed: bool
) -> PrecomputedParams | None:
    """The precomputed table ``precomputed`` names (loaded), or None; refused with mixing."""
    if precomputed is not None and mixed:
        raise ValueError(
            "precomputed parameters cover the ids of one source read once per epoch; with "
            "several sources or an epoch_size, leave precomputed=None (parameters are generated)"
        )
    if isinstance(precomputed, (str, os.PathLike)):
        return load_precomputed_params(precomputed)
    return precomputed


def checked_config(config: AugmentationConfig | None) -> AugmentationConfig | None:
    """``config`` when it is an :class:`AugmentationConfig` or None."""
    if config is not None and not isinstance(config, AugmentationConfig):
        got = type(config).__name__
        raise ValueError(f"aug_config must be an AugmentationConfig or None, got {got}")
    return config


def checked_decode(
    decode: Callable[[Any], Any] | str | Mapping[str, str] | None,
    config: AugmentationConfig | None,
) -> Callable[[Any], Any] | None:
    """``decode`` as a callable: a name of ``DECODER_NAMES``, or a mapping from field name to
    a name of ``FIELD_DECODERS``, is that :class:`SampleDecoder`; a crop decoder needs a
    config with crop parameters."""
    if isinstance(decode, str):
        if decode not in DECODER_NAMES:
            raise ValueError(
                f"decode must be one of {', '.join(map(repr, DECODER_NAMES))}, a mapping of "
                f"field names to decoder names, a callable on samples or None, got {decode!r}"
            )
        return SampleDecoder(decode)
    if isinstance(decode, Mapping):
        try:
            return SampleDecoder(decode)
        except ValueError as exc:
            raise ValueError(f"decode={dict(decode)!r}: {exc}") from None
    if decode is not None and not callable(decode):
        raise ValueError(
            f"decode must be a callable, a decoder name, a mapping of field names to decoder "
            f"names or None, got {decode!r}"
        )
    crops = isinstance(decode, SampleDecoder) and decode.crop_size is not None
    if crops and "crop_x" not in param_names(config):
        raise ValueError(
            f"decode={decode!r} crops with the samples' crop parameters, but aug_config has none: "
            "pass aug_config=get_preset('imagenet') or an AugmentationConfig with crop=True"
        )
    return decode


def _as_sources(source: Any, epoch_size: int | None) -> tuple[list[Source], bool]:
    """``source`` as a list of :class:`Source`, and whether the dataset mixes (labels its
    samples with their source and repeats): several sources, ``Source`` objects, or an
    ``epoch_size``."""
    if isinstance(source, Source):
        return [source], True
    if isinstance(source, (list, tuple)) and source and isinstance(source[0], Source):
        bad = [i for i, s in enumerate(source) if not isinstance(s, Source)]
        if bad:
            raise ValueError(f"source must be all Source objects or none, got others at {bad}")
        names = [i if s.name is None else s.name for i, s in enumerate(source)]
        if len(set(names)) < len(names):
            raise ValueError(f"source names must be distinct, got {names}")
        return list(source), True
    return [Source(source)], epoch_size is not None


def _index_of(
    source: Source, rank: int | None, world_size: int | None, defaults: dict[str, Any]
) -> ShardIndex:
    """The index of ``source``: given, built here, or built on rank 0 and broadcast under a
    process group (when rank and world size are not given)."""
    if isinstance(source.source, ShardIndex):
        return source.source
    settings = {k: getattr(source, k, None) or v for k, v in defaults.items()}
    build = functools.partial(build_shard_index, source.source, **settings)
    shared = rank is None and world_size is None and dist_ready()
    return built_on_rank0(build) if shared else build()
