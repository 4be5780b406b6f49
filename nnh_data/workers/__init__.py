"""What crosses the DataLoader worker boundary: batches as tensors and packed fields
(:mod:`.handoff`) through a shared-memory ring (:mod:`.shm_ring`), large batch tensors in reused
buffers (:mod:`.batch_buffers`), and workers shielded from their rank's signals
(:mod:`.signals`)."""

from nnh_data.workers.handoff import collate_samples
from nnh_data.workers.signals import shielded_worker_init

__all__ = ["collate_samples", "shielded_worker_init"]
