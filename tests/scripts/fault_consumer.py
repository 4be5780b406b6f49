"""A training loop's data side for the fault tests: reads a remote streaming dataset through
``streaming_loader`` (2 workers) and, after every batch, saves the keys delivered so far with
the loader's state, atomically, so that a SIGKILL leaves the last pair that belongs together.
With ``resume``, it starts from that pair. Each worker writes its pid to ``<out>.pids/``.

argv[1]: JSON {"source", "storage_options", "cache_dir" (or null), "out", "resume", "pause"}
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import time

from nnh_data import ShardedStreamingDataset, streaming_loader


def keys_of(batch: list[dict]) -> list[str]:
    return [sample["__key__"] for sample in batch if not sample["__pad__"]]


def main(args: dict) -> None:
    out, pids = args["out"], args["out"] + ".pids"
    os.makedirs(pids, exist_ok=True)

    def record_pid(worker: int) -> None:
        open(os.path.join(pids, str(os.getpid())), "w").close()

    ds = ShardedStreamingDataset(args["source"], storage_options=args["storage_options"],
                                 seed=5, shuffle_window=8, cache_dir=args["cache_dir"])  # fmt: skip
    loader = streaming_loader(ds, 4, 2, collate_fn=keys_of, worker_init_fn=record_pid)
    keys: list[str] = []
    if args["resume"]:
        with open(out, "rb") as f:
            saved = pickle.load(f)
        keys = saved["keys"]
        loader.load_state_dict(saved["state"])
    for batch in loader:
        keys += batch
        _save(out, {"keys": keys, "state": loader.state_dict(), "done": False})
        time.sleep(args["pause"])
    _save(out, {"keys": keys, "state": loader.state_dict(), "done": True})


def _save(path: str, value: dict) -> None:
    with open(path + ".tmp", "wb") as f:
        pickle.dump(value, f)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
