"""Exact evaluation results across ranks: every sample once, in dataset order.

Design. Each rank passes its per-sample results with their global sample ids; every rank gets
back all of them, sorted by id, each id once. Equalising ranks repeats samples
(``DistributedSampler`` padding, the rank-cached loader's repeats, a stream's ``__pad__``), and
a repeat has the id of its original, so keeping the first of each id removes exactly the
repeats: an evaluation over N samples reports N results. Tensors travel as raw bytes beside
their ids in a single ``all_gather`` of a buffer padded to the largest rank's count; knowing that
count takes one small ``all_gather`` first (two integers per rank), because ranks may hold
different counts (a last short batch, a stream that skipped corrupt samples) and a collective
needs one buffer size on every rank. The trade-off: two collectives instead of one, in exchange
for any counts and a dtype/shape check that fails on every rank at once instead of hanging.
Objects go through ``all_gather_object`` (pickles, for lists of strings, dicts and the like).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from nnh_data.seeding import as_sample_ids
from nnh_data.topology import group_size

__all__ = ["gather_for_metrics"]

_ID_BYTES = 8  # an int64 id, as bytes in front of each row


def gather_for_metrics(
    values: torch.Tensor | Sequence[Any], indices: torch.Tensor | np.ndarray | Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor] | tuple[list[Any], list[int]]:
    """Every rank's per-sample ``values``, ordered by sample id, each id once, on every rank.

    Call it on every rank (it is collective under ``torch.distributed``; alone it only sorts
    and removes repeats). A tensor needs the same dtype and trailing shape on every rank, even
    where it is empty: ``torch.empty(0, num_classes)``, not ``torch.tensor([])``.

    Args:
        values: a tensor with a leading sample dimension, or a list of picklable objects.
        indices: the global sample id of each value (``batch["__index__"]``, or the ids the
            sampler gave), as many as ``values``.

    Returns:
        ``(values, indices)``: for a tensor, a tensor on its device and int64 ids beside it;
        for a list, a list and a list of ints.

    Raises:
        ValueError: when ``values`` and ``indices`` differ in length (on that rank, before
            any collective), or on every rank when ranks pass tensors of different dtypes or
            trailing shapes.

    Example:
        >>> gather_for_metrics(torch.tensor([0.5, 0.7, 0.5]), [3, 1, 3])
        (tensor([0.7000, 0.5000]), tensor([1, 3]))
    """
    ids = _checked_ids(indices, values)
    if isinstance(values, torch.Tensor):
        if group_size() > 1:
            values, ids = _gathered_rows(values, ids)
        keep = torch.as_tensor(_first_of_each(ids), device=values.device)
        return values[keep], torch.as_tensor(ids, device=values.device)[keep]
    values = list(values)
    if group_size() > 1:
        values, ids = _gathered_objects(values, ids)
    keep = _first_of_each(ids)
    return [values[k] for k in keep], ids[keep].tolist()


def _checked_ids(indices: Any, values: Any) -> np.ndarray:
    """``indices`` as int64 ids, one per value; a ``ValueError`` naming the problem otherwise."""
    if isinstance(values, torch.Tensor):
        if values.dim() == 0:
            raise ValueError("values must have a leading sample dimension, got a 0-d tensor")
    elif not isinstance(values, (list, tuple)):
        raise ValueError("values must be a tensor with a leading sample dimension or a list of "
                         f"objects, got {type(values).__name__}")  # fmt: skip
    if isinstance(indices, torch.Tensor):
        indices = indices.detach().cpu().numpy()
    try:
        ids = as_sample_ids(indices)
    except ValueError as exc:
        raise ValueError(f"indices: {exc}") from None
    if ids.size != len(values):
        raise ValueError(f"indices must hold one id per value: got {ids.size} indices for "
                         f"{len(values)} values")  # fmt: skip
    return ids


def _first_of_each(ids: np.ndarray) -> np.ndarray:
    """Positions of the first occurrence of each id, in increasing id order."""
    return np.unique(ids, return_index=True)[1]


def _gathered_rows(values: torch.Tensor, ids: np.ndarray) -> tuple[torch.Tensor, np.ndarray]:
    """Every rank's rows and ids, in rank order: counts first, then one padded ``all_gather``."""
    device, world = values.device, dist.get_world_size()
    shape = f"{values.dtype} {tuple(values.shape[1:])}"
    meta = torch.tensor([len(values), zlib.crc32(shape.encode())], device=device)
    metas = [torch.empty_like(meta) for _ in range(world)]
    dist.all_gather(metas, meta)
    counts, kinds = zip(*(m.tolist() for m in metas))
    if len(set(kinds)) > 1:
        differ = [r for r, kind in enumerate(kinds) if kind != kinds[dist.get_rank()]]
        raise ValueError(f"values must have one dtype and trailing shape on every rank: this "
                         f"rank has {shape}, ranks {differ} have another")  # fmt: skip
    rows = _as_bytes(values, ids)
    buffer = torch.zeros((max(counts), rows.shape[1]), dtype=torch.uint8, device=device)
    buffer[: len(rows)] = rows
    buffers = [torch.empty_like(buffer) for _ in range(world)]
    dist.all_gather(buffers, buffer)
    block = torch.cat([b[:n] for b, n in zip(buffers, counts)])
    gathered_ids = block[:, :_ID_BYTES].contiguous().view(torch.int64).reshape(-1)
    gathered = block[:, _ID_BYTES:].contiguous().view(values.dtype)
    return gathered.reshape(len(block), *values.shape[1:]), gathered_ids.cpu().numpy()


def _as_bytes(values: torch.Tensor, ids: np.ndarray) -> torch.Tensor:
    """One uint8 row per sample: its id (8 bytes) then its values."""
    width = math.prod(values.shape[1:])
    data = values.detach().contiguous().reshape(len(values), width).view(torch.uint8)
    id_bytes = torch.from_numpy(ids).to(values.device).reshape(-1, 1).view(torch.uint8)
    return torch.cat([id_bytes, data], dim=1)


def _gathered_objects(values: list, ids: np.ndarray) -> tuple[list, np.ndarray]:
    """Every rank's objects and ids, in rank order."""
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (values, ids))
    gathered = [value for part_values, _ in parts for value in part_values]
    return gathered, np.concatenate([part_ids for _, part_ids in parts])
