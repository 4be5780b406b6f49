"""Run an IterableDataset as each DataLoader worker in turn, in this process.

``simulated(ds, workers, monkeypatch)`` is what ``DataLoader(ds, num_workers=workers)`` yields
(workers one after the other instead of interleaved): the dataset discovers its worker through
``nnh_data.streaming.get_worker_info``, patched here. Fast enough for large test grids; a few
tests run real workers and check they agree.
"""

from __future__ import annotations

import types

import nnh_data.streaming as streaming


def simulated(ds, workers: int, monkeypatch) -> list:
    """Items of ``ds`` as ``workers`` DataLoader workers (0: the main process) yield them."""
    if workers == 0:
        return list(ds)
    out = []
    for k in range(workers):
        info = types.SimpleNamespace(id=k, num_workers=workers)
        with monkeypatch.context() as patch:
            patch.setattr(streaming, "get_worker_info", lambda info=info: info)
            out += list(ds)
    return out
