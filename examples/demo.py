"""Demo: stream deterministic augmentation parameters for a few ranks and print a short table.

Runs on built-in data (no files needed): 23 samples split over 4 ranks, as
``torchrun --nproc-per-node 4`` would see them.
"""

from __future__ import annotations

from nnh_data import DistributedRangeSplitter, get_preset, stream_distributed_augmentation_chain

TOTAL, WORLD, SHOW = 23, 4, 3


def main() -> None:
    config = get_preset("moderate")
    splitter = DistributedRangeSplitter(TOTAL, WORLD)
    print(f"{TOTAL} samples over {WORLD} ranks: {splitter.get_all_ranges()}")
    print("rank  id  rotation  bright  noise  scale  contr  seed")
    for rank in range(WORLD):
        chain = stream_distributed_augmentation_chain(TOTAL, rank, WORLD, config, base_seed=42)
        for _, p in zip(range(SHOW), chain):
            print(
                f"{rank:>4} {p['sample_id']:>3} {p['rotation']:>9.3f} {p['brightness']:>7.3f} "
                f"{p['noise']:>6.3f} {p['scale']:>6.3f} {p['contrast']:>6.3f}  {p['seed']}"
            )


if __name__ == "__main__":
    main()
