"""Counter-based random numbers keyed by (base seed, rank, world size, epoch, depth).

Every number is a pure function of its inputs, so any sample's numbers can be computed directly,
in any order, in any process, on any machine, with no shared state. No ``hash()``, no global
``random``. The algorithm, precisely enough to re-implement (all arithmetic mod 2**64):

``mix64(z)`` is the SplitMix64 finalizer, a bijection on 64-bit integers::

    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    z =  z ^ (z >> 31)

With ``G = 0x9E3779B97F4A7C15``:

1. Stream key. Start from ``k = mix64(domain)``, ``domain`` = 1 for the plain stream (fields
   ``base_seed, epoch, depth``) and 2 for the rank-aware stream (fields ``base_seed, rank,
   world_size, epoch, depth``); fold each field ``v`` in that order: ``k = mix64((k + G) ^ v)``.
2. Sample seed. ``h = mix64(k ^ mix64(sample_id + G))``. Both steps are bijections, so two ids
   of one stream never share a seed. The public hex seed is ``format(h, "016x")``.
3. Draw ``j`` (``j = 0, 1, ...``) of a sample: ``u_j = mix64(h + (j + 1) * G)`` (SplitMix64's
   outputs seeded with ``h``), turned into a float in ``[0, 1)`` as ``(u_j >> 11) * 2**-53``.

Scalars and arrays go through the same numpy code, so they agree to the bit.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from nnh_data.checks import check_int

__all__ = [
    "ALGORITHM_VERSION",
    "GOLDEN",
    "MASK64",
    "MIX1",
    "MIX2",
    "MAX_SAMPLE_ID",
    "RankAwareSeedGenerator",
    "as_sample_ids",
    "mix64",
    "fold_key",
    "keyed_seeds",
    "mix64_int",
    "premixed_ids",
    "sample_seeds",
    "seed_hex",
    "stream_key",
    "uniform_draws",
]

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
MIX1, MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # SplitMix64 multipliers
_M1, _M2 = np.uint64(MIX1), np.uint64(MIX2)
_DOMAIN_PLAIN = 1
_DOMAIN_RANK_AWARE = 2
MAX_SAMPLE_ID = (1 << 63) - 1  # ids travel as int64 (torch collation); 2**63 ids is plenty
ALGORITHM_VERSION = 1  # of the numbers above; bumped by any change of output (stored tables)


def mix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64 finalizer applied in place to a uint64 array; returns the array."""
    tmp = np.empty_like(z)  # one scratch buffer instead of a temporary per shift
    for shift, mult in ((30, _M1), (27, _M2)):
        np.right_shift(z, np.uint64(shift), out=tmp)
        z ^= tmp
        z *= mult
    np.right_shift(z, np.uint64(31), out=tmp)
    z ^= tmp
    return z


def mix64_int(z: int) -> int:
    """``mix64`` of one Python int (the stream keys): plain int arithmetic, no array round trip."""
    z = ((z ^ (z >> 30)) * MIX1) & MASK64
    z = ((z ^ (z >> 27)) * MIX2) & MASK64
    return z ^ (z >> 31)


# cached: streaming asks for the same few keys once per window
@functools.lru_cache(maxsize=1024, typed=True)
def stream_key(
    base_seed: int,
    epoch: int,
    depth: int,
    rank: int | None = None,
    world_size: int | None = None,
) -> int:
    """The 64-bit key of a stream: plain when ``rank`` is None, else rank-aware."""
    base_seed = check_int("base_seed", base_seed, low=0, high=MASK64)
    epoch = check_int("epoch", epoch, low=0, high=MASK64)
    depth = check_int("augmentation_depth", depth, low=1, high=MASK64)
    if rank is None:
        domain, fields = _DOMAIN_PLAIN, (base_seed, epoch, depth)
    else:
        world_size = check_int("world_size", world_size, low=1, high=MASK64)
        rank = check_int("rank", rank, low=0, high=world_size - 1)
        domain, fields = _DOMAIN_RANK_AWARE, (base_seed, rank, world_size, epoch, depth)
    return fold_key(mix64_int(domain), fields)


def fold_key(key: int, fields: Sequence[int]) -> int:
    """``key`` with each of ``fields`` folded in: ``key = mix64((key + G) ^ field)``, the one
    key derivation of every stream (parameters, order)."""
    for value in fields:
        key = mix64_int(((key + GOLDEN) & MASK64) ^ value)
    return key


def as_sample_ids(sample_ids: object) -> np.ndarray:
    """Validate ``sample_ids`` (an int or array-like of ints in [0, 2**63)) as a 1-D int64 array."""
    ids = np.atleast_1d(np.asarray(sample_ids))
    if ids.ndim != 1 or not (ids.dtype.kind in "iu" or ids.size == 0):
        raise ValueError(
            f"sample_ids must be an integer or a 1-D array of integers, got {sample_ids!r}"
        )
    if ids.size and (ids.min() < 0 or ids.max() > MAX_SAMPLE_ID):
        bad = ids[(ids < 0) | (ids > MAX_SAMPLE_ID)][0]
        raise ValueError(f"sample_ids must be in [0, {MAX_SAMPLE_ID}], got {bad}")
    return ids.astype(np.int64, copy=False)


def sample_seeds(key: int, sample_ids: np.ndarray) -> np.ndarray:
    """Per-sample 64-bit seeds ``h`` (step 2) of a validated int64 id array."""
    return keyed_seeds(key, premixed_ids(sample_ids))


def premixed_ids(sample_ids: np.ndarray) -> np.ndarray:
    """``mix64(sample_id + G)``: the half of step 2 that no key enters (computed once for ids
    hashed under many keys, as the window permutations of :mod:`nnh_data.order.epoch` are)."""
    z = sample_ids.astype(np.uint64)
    z += np.uint64(GOLDEN)
    return mix64(z)


def keyed_seeds(key: int, premixed: np.ndarray) -> np.ndarray:
    """The seeds ``h`` of ids whose :func:`premixed_ids` are ``premixed`` (left unchanged)."""
    z = premixed ^ np.uint64(key)
    return mix64(z)


def uniform_draws(
    seeds: np.ndarray, count: int, scales: Sequence[float] | None = None
) -> np.ndarray:
    """Draws ``0..count-1`` (step 3) of every seed: a ``(count, n)`` float64 array in [0, 1).

    Row ``j`` is multiplied by ``scales[j]`` when given, folded into the conversion:
    ``(u >> 11) * (s * 2**-53)`` equals ``s * ((u >> 11) * 2**-53)`` to the bit, since scaling
    by a power of two is exact.
    """
    steps = (np.arange(1, count + 1, dtype=np.uint64) * np.uint64(GOLDEN))[:, None]
    z = steps + seeds[None, :]
    mix64(z)
    z >>= np.uint64(11)
    out = z.astype(np.float64)
    factors = np.ones(count) if scales is None else np.asarray(scales, dtype=np.float64)
    out *= (factors * 2.0**-53)[:, None]
    return out


def seed_hex(seed: int) -> str:
    """The public form of a sample seed: 16 lowercase hex digits, usable as ``int(s, 16)``."""
    return format(int(seed), "016x")


class RankAwareSeedGenerator:
    """Hex seed of a (sample id, rank) pair, unique per (base_seed, sample_id, rank, world_size).

    The seed is the one ``gen_distributed_augmentation_params`` reports for the same inputs.

    Example:
        >>> gen = RankAwareSeedGenerator(base_seed=42, world_size=4)
        >>> import random; random.seed(int(gen.generate_seed(7, rank=1), 16))
    """

    def __init__(
        self,
        base_seed: int = 0,
        world_size: int = 1,
        *,
        epoch: int = 0,
        augmentation_depth: int = 1,
    ) -> None:
        self.base_seed = check_int("base_seed", base_seed, low=0, high=MASK64)
        self.world_size = check_int("world_size", world_size, low=1)
        self.epoch = check_int("epoch", epoch, low=0, high=MASK64)
        self.augmentation_depth = check_int("augmentation_depth", augmentation_depth, low=1)

    def key(self, rank: int) -> int:
        """The stream key of ``rank``."""
        return stream_key(
            self.base_seed, self.epoch, self.augmentation_depth, rank, self.world_size
        )

    def generate_seed(self, sample_id: int, rank: int = 0) -> str:
        """Lowercase hex seed of ``sample_id`` as seen by ``rank``."""
        ids = as_sample_ids(check_int("sample_id", sample_id, low=0, high=MAX_SAMPLE_ID))
        return seed_hex(sample_seeds(self.key(rank), ids)[0])
