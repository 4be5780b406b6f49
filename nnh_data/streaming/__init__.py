"""The streaming dataset and its loader: every sample once per epoch, equal batches per rank.

:mod:`.dataset` holds :class:`ShardedStreamingDataset` (settings, epoch, resume state); a pass
is the chain of generator stages of :mod:`.stages` over the parts that :mod:`.source_reader`
reads (through :mod:`.readahead`), with :mod:`.error_policy` deciding what an unreadable sample
does and :mod:`.stats` counting where the time goes; :mod:`.loader` sets up the
``StatefulDataLoader`` that cuts worker ranges in whole batches.
"""

from nnh_data.order.resume import merge_states, state_from_loader
from nnh_data.streaming.dataset import ShardedStreamingDataset, streaming_dataset_of
from nnh_data.streaming.loader import streaming_loader

__all__ = [
    "ShardedStreamingDataset",
    "merge_states",
    "state_from_loader",
    "streaming_dataset_of",
    "streaming_loader",
]
