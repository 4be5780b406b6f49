"""Run an IterableDataset as each DataLoader worker in turn, in this process.

``simulated(ds, workers, monkeypatch)`` is what ``DataLoader(ds, num_workers=workers)`` yields
(workers one after the other instead of interleaved): the dataset discovers its worker through
:func:`nnh_data.topology.worker_info`, which the ``WORKER``/``NUM_WORKERS`` environment
variables override. Fast enough for large test grids; a few tests run real workers and check
they agree.
"""

from __future__ import annotations


def simulated(ds, workers: int, monkeypatch) -> list:
    """Items of ``ds`` as ``workers`` DataLoader workers (0: the main process) yield them."""
    if workers == 0:
        return list(ds)
    out = []
    for k in range(workers):
        with monkeypatch.context() as patch:
            patch.setenv("WORKER", str(k))
            patch.setenv("NUM_WORKERS", str(workers))
            out += list(ds)
    return out
