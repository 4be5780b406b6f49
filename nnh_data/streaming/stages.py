"""One pass of the streaming dataset as a chain of generator stages, WebDataset style.

plan -> read -> assemble [-> mix] -> parameters -> count, each a plain function over iterables:

- plan (:func:`read_plan`, :func:`pad_plan`): the read blocks ``(shard, start, stop, concat
  start)`` that cover a worker's epoch positions: the windows they touch, in concat order, in
  pieces of bounded size; then one block per pad.
- read: each block fetched (in a read-ahead thread) and decoded into rows: :mod:`nnh_data.
  columns` columns (unreadable samples flagged in :data:`SKIPPED`); a :class:`Rows` says how
  to cut, join, take and label them, as Arrow arrays for batches or as Python values for
  samples built at hand-out.
- assemble (:func:`assemble`): per window, the rows of the concat range it covers taken in
  epoch order, as a :class:`Part` with its labels (``__index__``, ``__pad__``).
- mix (:func:`mix`, several sources only): rows of the sources' part streams interleaved in
  the order of the mixed epoch (in a per-sample pass, as samples: each source's built from its
  own parts, then put in that order at hand-out).
- parameters (:func:`with_parameters`): each part's augmentation parameters, as columns, in
  one call per part.
- count (:func:`hand_out_samples`, :func:`hand_out_rows`, :func:`hand_out_batches`): items
  handed to the loader one at a time (sample dicts, or rows of columns for a loader that
  collates them itself) or in batches, their progress counted in a :class:`Progress` (the
  resume state).

A window's samples are handed out from a stack, so counting costs nothing per sample.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from itertools import chain, compress, islice, repeat
from typing import Any

import numpy as np

from nnh_data.columns import (
    Columns,
    as_list,
    columns_of,
    concat,
    constant,
    cut,
    num_rows,
    rows_of,
    take,
)
from nnh_data.order.epoch import EpochOrder, Intervals

__all__ = [
    "COLUMNS",
    "GROUP",
    "LEFT_OUT",
    "Decoding",
    "SKIPPED",
    "VALUE_COLUMNS",
    "Part",
    "Progress",
    "Rows",
    "assemble",
    "deferred",
    "hand_out_batches",
    "hand_out_rows",
    "hand_out_samples",
    "mix",
    "window_groups",
    "with_parameters",
]

SKIPPED = "__skipped__"  # column flagging the rows of unreadable samples, in columns
_ABSENT_ROWS = "__absent__"  # column flagging the rows that lack a field of other rows
_ABSENT = object()  # the value of such a field there
GROUP = 1024  # positions assembled per part without shuffle
# Samples built at a time in a per-sample pass. Two dicts a sample (itself and ``__aug__``): a
# slice of 256 stays under the cyclic collector's threshold (700 new objects), where one of
# 1,024 set off ~3 collections that found every sample alive, moved them to older
# generations and led to full collections (1-3 us a sample in all, when decode frees them).
_SLICE = 256
_DONE = object()  # the bottom of a hand-out stack
LEFT_OUT = object()  # what a ``finish`` function returns for an item it leaves out


def _label_columns(rows: Columns, name: str, value: Any) -> Columns:
    rows[name] = [value] * num_rows(rows)
    return rows


def _label_arrow(rows: Columns, name: str, value: Any) -> Columns:
    """:func:`_label_columns` for batches: text (a shard's URL) as an Arrow column
    (:func:`constant`), which a batch packs without a Python object per row."""
    rows[name] = constant(value, num_rows(rows))
    return rows


def _columns_of_samples(samples: list) -> Columns:
    cols = columns_of([s or {} for s in samples])
    if None in samples:
        cols[SKIPPED] = [s is None for s in samples]
    return cols


def _value_columns_of_samples(samples: list) -> Columns:
    """:func:`_columns_of_samples` for samples built again at hand-out: a field that a sample
    lacks is :data:`_ABSENT` there and its row flagged in :data:`_ABSENT_ROWS`, so the sample
    comes out without it (tar samples of different fields)."""
    readable = [s or {} for s in samples]
    names = dict.fromkeys(chain.from_iterable(readable))
    lacking = [len(s) < len(names) for s in readable]
    if not any(lacking):
        return _columns_of_samples(samples)
    cols = {name: [s.get(name, _ABSENT) for s in readable] for name in names}
    cols[_ABSENT_ROWS] = lacking
    if None in samples:
        cols[SKIPPED] = [s is None for s in samples]
    return cols


def _joined_values(parts: list[Columns]) -> Columns:
    """The parts' rows one after the other (:func:`concat`); a field that some parts
    lack (shards of other columns) is :data:`_ABSENT` in their rows, which are flagged in
    :data:`_ABSENT_ROWS`, so that their samples are built without it."""
    names = dict.fromkeys(chain.from_iterable(parts))
    for name in (SKIPPED, _ABSENT_ROWS):
        names.pop(name, None)
    if all(len(names.keys() - part.keys()) == 0 for part in parts):
        return concat(parts)
    filled = []
    for part in parts:
        n, lacking = num_rows(part), names.keys() - part.keys()
        absent = {name: [_ABSENT] * n for name in lacking}
        filled.append({**part, **absent, _ABSENT_ROWS: [bool(lacking)] * n} if lacking else part)
    return concat(filled)


@dataclass(frozen=True)
class Rows:
    """How a stage handles one kind of rows (columns for batches, or for samples)."""

    size: Callable[[Any], int]
    cut: Callable[[Any, int, int], Any]
    join: Callable[[list], Any]
    take: Callable[[Any, np.ndarray], Any]
    label: Callable[[Any, str, Any], Any]  # set a constant field in every (readable) row
    from_samples: Callable[[list], Any]  # from a list of sample dicts (None: unreadable)
    arrow: bool = False  # Parquet columns kept as Arrow arrays, not lists of Python values
    interleave: bool = False  # mixed at hand-out: samples built per source, then interleaved


COLUMNS = Rows(
    size=num_rows,
    cut=cut,
    join=concat,
    take=take,
    label=_label_arrow,
    from_samples=_columns_of_samples,
    arrow=True,
)


def _taken_values(columns: Columns, indices: np.ndarray) -> Columns:
    """Rows ``indices`` of columns of Python values, as tuples (numpy columns stay numpy):
    the cyclic collector stops tracking a tuple of untracked values (bytes, text, numbers) the
    first time it meets it, where it walks a list again at each collection that the list
    outlives (the rows of a mixed part of several windows outlive several)."""
    positions = indices.tolist()
    return {
        name: _taken_values(col, indices) if isinstance(col, dict) else
        col[indices] if isinstance(col, np.ndarray) else
        tuple(map(as_list(col).__getitem__, positions))
        for name, col in columns.items()
    }  # fmt: skip


# Columns of Python values, built into samples at hand-out (per-sample passes): converting a
# block's values while it is in cache, then gathering references, beats a dict per row read
# and held in a window (fewer objects for the cyclic collector to walk, too).
VALUE_COLUMNS = replace(COLUMNS, join=_joined_values, take=_taken_values, label=_label_columns,
                        from_samples=_value_columns_of_samples, arrow=False,
                        interleave=True)  # fmt: skip


@dataclass
class Part:
    """Rows in hand-out order with their labels (columns such as ``__index__`` and
    ``__pad__``), the ids their parameters are keyed by, and those parameters."""

    rows: Any
    labels: Columns
    keys: np.ndarray
    params: Columns | None = None


@dataclass
class Progress:
    """Items of a worker's range handed out: those before the current window plus those
    popped off its stack (see :func:`hand_out_samples`)."""

    consumed: int = 0
    stack: list = field(default_factory=list)
    window: int = 0

    def start_window(self, stack: list) -> None:
        """Count the current window as handed out; ``stack`` is the next one."""
        self.consumed = self.handed_out()
        self.stack, self.window = stack, max(0, len(stack) - 1)

    def handed_out(self) -> int:
        return self.consumed + self.window - max(0, len(self.stack) - 1)


# ---------------------------------------------------------------- assemble


def window_groups(positions: Intervals, size: int) -> Iterator[np.ndarray]:
    """Sorted ``positions`` cut at multiples of ``size``: one array per window they touch.

    Example:
        >>> [g.tolist() for g in window_groups([(1, 3), (4, 6)], 4)]
        [[1, 2], [4, 5]]
    """
    pending: list[np.ndarray] = []
    current = -1
    for a, b in positions:
        while a < b:
            w = a // size
            end = min(b, (w + 1) * size)
            if w != current and pending:
                yield np.concatenate(pending)
                pending = []
            current = w
            pending.append(np.arange(a, end, dtype=np.int64))
            a = end
    if pending:
        yield np.concatenate(pending)


class _Cursor:
    """The rows of a stream of ``(concat start, rows)`` blocks, taken by increasing concat
    ranges and let go of once taken."""

    def __init__(self, blocks: Iterator[tuple[int, Any]], rows: Rows) -> None:
        self._blocks, self._ops = blocks, rows
        self._lo = self._len = 0
        self._rows: Any = []

    def take(self, lo: int, hi: int) -> Any:
        ops, pieces = self._ops, []
        while lo < hi:
            if lo >= self._lo + self._len:
                self._lo, self._rows = next(self._blocks)
                self._len = ops.size(self._rows)
                continue
            assert lo >= self._lo, "read blocks must follow the windows in order"
            stop = min(hi, self._lo + self._len)
            pieces.append(ops.cut(self._rows, lo - self._lo, stop - self._lo))
            lo = stop
        self._rows = ops.cut(self._rows, lo - self._lo, self._len)
        self._len -= lo - self._lo
        self._lo = lo
        return pieces[0] if len(pieces) == 1 else ops.join(pieces)

    def skip_to(self, hi: int) -> None:
        """Let go of the blocks before concat position ``hi``: the rows a window read that no
        position needed (the blocks after them are the next stage's)."""
        while self._lo + self._len < hi:
            self._lo, self._rows = next(self._blocks)
            self._len = self._ops.size(self._rows)


def assemble(
    decoded: Iterator[tuple[int, Any]],
    order: EpochOrder,
    positions: Intervals,
    window: int,
    num_pads: int,
    rows: Rows,
    part_size: int = GROUP,
) -> Iterator[Part]:
    """Parts in hand-out order from the decoded blocks of :mod:`nnh_data.order.blocks` (read,
    then pads; ``(concat start, rows)`` each): one per window of ``positions`` (without
    shuffle, per ``part_size`` positions), then one per pad, labelled with ``__index__`` (the
    global ids) and ``__pad__``."""
    cursor = _Cursor(decoded, rows)
    for group in window_groups(positions, window or part_size):
        concat = order.concat_positions(group)
        low, high = int(concat.min()), int(concat.max()) + 1
        taken = cursor.take(low, high)
        if window or high - low != concat.size:  # not the rows as read (sorted without shuffle)
            taken = rows.take(taken, concat - low)
        ids = order.ids_at_concat(concat)
        yield Part(taken, {"__index__": ids, "__pad__": np.zeros(ids.size, bool)}, ids)
    if positions:  # the pads' blocks follow the whole windows read_plan read
        size = window or 1
        cursor.skip_to(min(-(-positions[-1][1] // size) * size, order.total))
    for _ in range(num_pads):
        concat, block = next(decoded)
        ids = order.ids_at_concat(np.array([concat], dtype=np.int64))
        yield Part(block, {"__index__": ids, "__pad__": np.ones(1, bool)}, ids)


# ---------------------------------------------------------------- mix


@dataclass(frozen=True)
class _Taken:
    """Rows ``rows`` at ``indices``, not gathered yet: a source's window assembled for
    :func:`mix` (:func:`deferred`), which gathers each row once, into the mixed order."""

    rows: Any
    indices: np.ndarray


def deferred(rows: Rows) -> Rows:
    """``rows`` whose take is left to :func:`mix`: the rows of the sources it mixes are then
    gathered once, from the blocks as read, not into each source's order first. Rows mixed
    at hand-out (``interleave``) are taken as one source's are: each source's samples are
    built from them in its own order."""
    return rows if rows.interleave else replace(rows, take=_Taken)


_Span = tuple[Part, int, int]  # rows ``[a, b)`` of a part


class _PartCursor:
    """The rows of a stream of parts, taken ``n`` at a time as spans ``(part, a, b)`` (rows
    ``[a, b)`` of ``part``): nothing is cut or copied."""

    def __init__(self, parts: Iterator[Part]) -> None:
        self._parts = parts
        self._part: Part | None = None
        self._at = 0

    def take(self, n: int) -> list[_Span]:
        spans = []
        while n:
            if self._part is None:
                self._part, self._at = next(self._parts), 0
            part, a = self._part, self._at
            b = self._at = min(part.keys.size, a + n)
            if b > a:
                spans.append((part, a, b))
                n -= b - a
            if b == part.keys.size:  # let go of a part taken whole
                self._part = None
        return spans


def mix(streams: list[Iterator[Part]], chunks: Iterable[np.ndarray], rows: Rows) -> Iterator[Part]:
    """Parts whose rows come from several part ``streams``: each of ``chunks`` gives the
    stream of every row of one part, in order (each stream is read in its own order). The
    streams' rows may be :func:`deferred`: each row is then gathered once, here. Rows that
    ``interleave`` are left in the streams' parts, and interleaved as samples at hand-out
    (:func:`hand_out_samples`).

    Example:
        >>> a = iter([Part({"x": [1, 2, 3]}, {"__index__": np.arange(3)}, np.arange(3))])
        >>> b = iter([Part({"x": [10, 20]}, {"__index__": np.arange(2)}, np.arange(2))])
        >>> [p.rows["x"] for p in mix([a, b], [np.array([0, 1, 0]), np.array([1, 0])], COLUMNS)]
        [[1, 10, 2], [20, 3]]
    """
    cursors = [_PartCursor(iter(s)) for s in streams]
    build = _interleaved_part if rows.interleave else _mixed_part
    for sources in chunks:
        yield build(cursors, sources, rows)


def _spans(cursors: list[_PartCursor], sources: np.ndarray) -> list[list[_Span]]:
    """Per source, the spans of the rows that ``sources`` draws (in draw order)."""
    counts = np.bincount(sources, minlength=len(cursors)).tolist()  # np.unique: ~25x the time
    return [cursor.take(n) if n else [] for cursor, n in zip(cursors, counts)]


def _mixed_part(cursors: list[_PartCursor], sources: np.ndarray, rows: Rows) -> Part:
    """The rows ``sources`` draws, in its order: their blocks joined, then one take."""
    blocks, picks, labels, keys, offset = [], [], [], [], 0
    for part, a, b in chain.from_iterable(_spans(cursors, sources)):
        taken = part.rows
        block, at = (taken.rows, taken.indices[a:b]) if isinstance(taken, _Taken) \
            else (taken, np.arange(a, b))  # fmt: skip
        blocks.append(block)
        picks.append(at + offset)
        offset += rows.size(block)
        labels.append(cut(part.labels, a, b))
        keys.append(part.keys[a:b])
    where = np.empty(sources.size, dtype=np.int64)  # row i of the part is span row where[i]
    where[np.argsort(sources, kind="stable")] = np.arange(sources.size)
    joined = blocks[0] if len(blocks) == 1 else rows.join(blocks)
    taken = rows.take(joined, np.concatenate(picks)[where])
    return Part(taken, take(concat(labels), where), np.concatenate(keys)[where])


@dataclass(frozen=True)
class _Interleaved:
    """A mixed part's rows left in the sources' parts, for a per-sample pass: per slice of at
    most ``_SLICE`` hand-out rows, the spans that hold them, by source (each in draw order);
    ``local[i]``: the place of hand-out row ``i`` among its slice's span rows; ``names``: the
    fields, in the order samples hold them. The part's keys are in span order; its labels are
    its spans' parts'."""

    slices: list[list[_Span]]
    local: np.ndarray
    names: list[str]


def _interleaved_part(cursors: list[_PartCursor], sources: np.ndarray, rows: Rows) -> Part:
    """The rows ``sources`` draws as an :class:`_Interleaved` part: nothing is joined or
    gathered; at hand-out each source's samples are built from its own parts, as one source's
    are, and put in the mixed order by reference (one per sample, where a gather of rows is
    one per column, and each gathered column is freed, and walked by the cyclic collector)."""
    per_slice = [_spans(cursors, sources[a : a + _SLICE]) for a in range(0, sources.size, _SLICE)]
    slices = [list(chain.from_iterable(by_source)) for by_source in per_slice]
    group = np.arange(sources.size) // _SLICE
    local = np.empty(sources.size, dtype=np.int64)
    local[np.argsort(group * len(cursors) + sources, kind="stable")] = np.arange(sources.size)
    local -= group * _SLICE
    # the fields in the order of their first source, as a join of the sources' rows has them
    names = dict.fromkeys(chain.from_iterable(
        span[0].rows for s in range(len(cursors)) for by_source in per_slice
        for span in by_source[s]))  # fmt: skip
    for name in (SKIPPED, _ABSENT_ROWS):
        names.pop(name, None)
    keys = np.concatenate([part.keys[a:b] for part, a, b in chain.from_iterable(slices)])
    return Part(_Interleaved(slices, local, list(names)), {}, keys)


# ---------------------------------------------------------------- parameters


def with_parameters(
    parts: Iterable[Part], params: Callable[[np.ndarray], Columns]
) -> Iterator[Part]:
    """Each part with ``params(part.keys)``: its parameters as columns."""
    for part in parts:
        part.params = params(part.keys)
        yield part


# ---------------------------------------------------------------- count


@dataclass(frozen=True)
class Decoding:
    """How :func:`hand_out_samples` finishes samples with a ``decode`` function: ``function``
    on each sample; ``timed`` in its place in the windows where ``timing()`` says so (the
    stats time one part in a few); ``failed(sample, exc)`` is what an exception of either
    becomes: it raises, or returns :data:`LEFT_OUT`. The functions run with no wrapper
    around each call: a user's function costs what it costs in a plain loop."""

    function: Callable[[dict], Any]
    failed: Callable[[dict, Exception], Any]
    timed: Callable[[dict], Any] | None = None
    timing: Callable[[], bool] = bool  # bool() is False: never timed


def hand_out_samples(
    parts: Iterable[Part],
    progress: Progress,
    finish: Callable[[dict], Any] | Decoding | None,
    skipped: Callable[[dict], None],
) -> Iterator[Any]:
    """The samples of ``parts`` (sample lists, or columns built into samples here), each with
    its labels (``__index__``, ``__pad__``, and for mixed sources ``__source__`` and
    ``__repeat__``) and ``__aug__`` (its parameters as a dict), passed through ``finish``
    unless it is None (it returns :data:`LEFT_OUT` to leave one out; a :class:`Decoding`
    also says what its exceptions become). An unreadable sample (a ``None`` row, or a row
    flagged :data:`SKIPPED`) is reported to ``skipped`` with its labels when its turn comes."""
    decoding = Decoding(finish, _raise) if callable(finish) else finish
    for samples, unreadable in chain.from_iterable(map(_sample_slices, parts)):
        stack = [_DONE]
        stack += reversed(samples)
        progress.start_window(stack)
        if decoding is None and not unreadable:
            del samples  # the stack holds the samples, and lets go of each as it is handed out
            yield from iter(stack.pop, _DONE)
            continue
        if decoding is not None and not unreadable:
            yield from _decoded(samples, stack, decoding)
            continue
        del samples
        function = None if decoding is None else _function(decoding)
        unreadable = iter(unreadable)
        for sample in iter(stack.pop, _DONE):
            if sample is None:
                skipped(next(unreadable))
            elif function is None:
                yield sample
            elif (sample := _finished_one(function, decoding.failed, sample)) is not LEFT_OUT:
                yield sample
    progress.start_window([])


def _decoded(samples: list, stack: list, decoding: Decoding) -> Iterator[Any]:
    """The window's samples popped off ``stack`` (``samples``, in order) through the decoding
    function, mapped in C (no Python frame per sample but the function's own); after an
    exception, ``decoding.failed`` of the sample that raised (the last one popped), then on
    (a StopIteration, which ends the map, as a RuntimeError saying so)."""
    popped = iter(stack.pop, _DONE)
    kept = functools.partial(operator.is_not, LEFT_OUT)
    function = _function(decoding)
    while True:
        try:
            yield from filter(kept, map(function, popped))
            if not stack:  # _DONE popped: the window's end
                return
            # map took a StopIteration of the function for its own end
            exc: Exception = RuntimeError("the decode function raised StopIteration")
        except Exception as raised:
            exc = raised
        if (out := decoding.failed(samples[len(samples) - len(stack)], exc)) is not LEFT_OUT:
            yield out


def _function(decoding: Decoding) -> Callable[[dict], Any]:
    """The function a window is finished with: timed, where the decoding says so."""
    return decoding.timed if decoding.timed is not None and decoding.timing() else decoding.function


def _finished_one(function: Callable[[dict], Any], failed: Callable, sample: dict) -> Any:
    try:
        return function(sample)
    except Exception as exc:
        return failed(sample, exc)


def _raise(sample: dict, exc: Exception) -> Any:
    raise exc


def _sample_slices(part: Part) -> Iterator[tuple[list, list[dict]]]:
    """The part's samples built from its columns with their labels and ``__aug__``, ``None``
    where unreadable, and what ``skipped`` is told of each unreadable one, in order: in slices
    of at most ``_SLICE`` rows, each column read in place or converted by slice,
    so that few dicts and values are alive at once (less for the cyclic collector to walk, a
    mixed part being several windows) and each slice's values are in cache when it is built."""
    if isinstance(part.rows, _Interleaved):
        yield from _interleaved_slices(part)
        return
    cols = dict(part.rows)
    flags, lacking = cols.pop(SKIPPED, None), cols.pop(_ABSENT_ROWS, None)
    labels = part.labels
    cols.update({"__index__": labels["__index__"], "__pad__": labels["__pad__"],
                    "__aug__": part.params, **labels})  # fmt: skip
    names, whole = list(cols), part.keys.size <= _SLICE  # whole: one slice, no iterators
    values = [c if isinstance(c, (np.ndarray, dict)) else as_list(c) if whole else
              iter(as_list(c)) for c in cols.values()]  # fmt: skip
    flags, lacking = (() if f is None else iter(f) for f in (flags, lacking))
    told = _told(labels)
    for start in range(0, part.keys.size, _SLICE):
        stop = min(start + _SLICE, part.keys.size)
        samples = rows_of(names, [_slice(v, start, stop) for v in values])
        n = stop - start
        missing = _finished(samples, islice(lacking, n), islice(flags, n))
        yield samples, [{k: _item(labels[k][start + i]) for k in told} for i in missing]


def _interleaved_slices(part: Part) -> Iterator[tuple[list, list[dict]]]:
    """:func:`_sample_slices` of an :class:`_Interleaved` part: per slice, each span's samples
    built from its part's columns (each source's in its own order, as one source's are), then
    put in hand-out order."""
    rows, at = part.rows, 0
    for start, spans in zip(range(0, part.keys.size, _SLICE), rows.slices):
        built: list = []
        told: dict[int, dict] = {}
        for span in spans:
            n = span[2] - span[1]
            samples, missing = _span_samples(rows.names, span, _slice(part.params, at, at + n))
            told.update((len(built) + i, label) for i, label in missing)
            built += samples
            at += n
        local = rows.local[start : start + len(built)].tolist()
        in_order = [told[j] for j in local if j in told] if told else []
        yield list(map(built.__getitem__, local)), in_order


def _span_samples(
    names: list[str], span: _Span, params: list[dict]
) -> tuple[list, list[tuple[int, dict]]]:
    """The samples of ``span`` (fields ``names``, then its labels and ``params`` as
    ``__aug__``), ``None`` where unreadable, and the place and label of each unreadable one."""
    part, a, b = span
    values, labels = part.rows, part.labels
    absent = [name for name in names if name not in values]
    columns = {name: repeat(_ABSENT) if name in absent else _slice(values[name], a, b)
               for name in names}  # fmt: skip
    cut = {k: _slice(v, a, b) for k, v in labels.items()}
    columns.update({"__index__": cut["__index__"], "__pad__": cut["__pad__"], "__aug__": params,
                    **cut})  # fmt: skip
    samples = rows_of(list(columns), list(columns.values()))
    flags, lacking = (_slice(values[k], a, b) if k in values else ()
                      for k in (SKIPPED, _ABSENT_ROWS))  # fmt: skip
    missing = _finished(samples, repeat(True) if absent else lacking, flags)
    told = _told(labels)
    return samples, [(i, {k: _item(labels[k][a + i]) for k in told}) for i in missing]


def _told(labels: Columns) -> list[str]:
    """The labels ``skipped`` is told of an unreadable sample: its id, and its source when
    mixing."""
    return ["__index__", "__source__"] if "__source__" in labels else ["__index__"]


def _finished(samples: list, lacking: Iterable, flags: Iterable) -> list[int]:
    """``samples`` without the fields absent from the rows ``lacking`` flags, ``None`` at the
    rows ``flags`` flags (unreadable): the positions of those."""
    for i in compress(range(len(samples)), lacking):
        samples[i] = {k: v for k, v in samples[i].items() if v is not _ABSENT}
    missing = list(compress(range(len(samples)), flags))
    for i in missing:
        samples[i] = None
    return missing


def _slice(values: Any, start: int, stop: int) -> Iterable:
    """Rows ``[start, stop)`` of a column as Python values: of a numpy column (a label), of
    parameters (one dict per row: ``__aug__``), the next of an iterator over the rows, or of
    a list or tuple (itself when whole)."""
    if isinstance(values, np.ndarray):
        return values[start:stop].tolist()
    if isinstance(values, dict):
        return rows_of(list(values), [c[start:stop].tolist() for c in values.values()])
    if isinstance(values, Iterator):
        return islice(values, stop - start)
    return values if start == 0 and stop == len(values) else values[start:stop]


def _item(value: Any) -> Any:
    """A numpy scalar as a Python value."""
    return value.item() if isinstance(value, np.generic) else value


def hand_out_rows(
    parts: Iterable[Part], progress: Progress, skipped: Callable[[dict], None]
) -> Iterator[tuple[Columns, int]]:
    """The rows of column ``parts`` one at a time, as ``(columns, i)``: row ``i`` of a part's
    columns, which hold its rows, the labels and ``__aug__`` in the order a sample of
    :func:`hand_out_samples` has its fields. Counted and skipped as that function does, without
    building a dict per row: for a loader that collates the rows itself
    (:func:`nnh_data.workers.handoff.collate_rows`)."""
    for part in parts:
        labels = part.labels
        columns = {**part.rows, "__index__": labels["__index__"], "__pad__": labels["__pad__"],
                   "__aug__": part.params, **labels}  # fmt: skip
        flags = columns.pop(SKIPPED, None)
        n = num_rows(labels)
        stack = [_DONE]
        stack += zip(repeat(columns), range(n - 1, -1, -1))
        del part, labels
        progress.start_window(stack)
        if flags is None:
            yield from iter(stack.pop, _DONE)
            continue
        for row in iter(stack.pop, _DONE):
            if flags[row[1]]:
                skipped(_row_label(columns, row[1]))
            else:
                yield row
    progress.start_window([])


def _row_label(columns: Columns, i: int) -> dict:
    """What ``skipped`` is told of row ``i``: its id, and its source when mixing."""
    label = {"__index__": int(columns["__index__"][i])}
    if "__source__" in columns:
        label["__source__"] = columns["__source__"][i]
    return label


def hand_out_batches(
    parts: Iterable[Part], size: int, progress: Progress, finish: Callable[[Columns], Any]
) -> Iterator[Any]:
    """Batches of ``size`` consecutive rows of ``parts`` (the last may be short), each with
    its labels and ``__aug__`` columns, passed through ``finish`` (:data:`LEFT_OUT` leaves it
    out)."""
    pending: list[Columns] = []
    count = 0
    for part in parts:
        pending.append({**part.rows, **part.labels, "__aug__": part.params})
        count += num_rows(part.rows)
        if count < size:
            continue
        rows, start = concat(pending), 0
        while count - start >= size:
            batch = finish(cut(rows, start, start + size))
            start += size
            progress.consumed += size
            if batch is not LEFT_OUT:
                yield batch
        pending = [cut(rows, start, count)] if start < count else []
        count -= start
    if count:
        batch = finish(concat(pending))
        progress.consumed += count
        if batch is not LEFT_OUT:
            yield batch
