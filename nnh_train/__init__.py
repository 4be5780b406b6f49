"""nnh_train: DDP plumbing and a minimal trainer.

The same script runs under ``python``, ``torchrun`` and ``srun``, on CPU (gloo) or GPU (nccl), and
an error on one rank stops every rank with the real cause instead of a collective timeout.
"""

from nnh_train.callbacks import (
    Callback,
    CSVLogger,
    EarlyStopping,
    ModelCheckpoint,
    TensorBoardLogger,
)
from nnh_train.checkpoint import load_checkpoint, save_checkpoint
from nnh_train.compat import DataLoaderType, LoggingMode, ModelType
from nnh_train.dd_helpers import (
    aggregate_loss,
    aggregate_metrics,
    broadcast_data,
    broadcast_if_ddp,
    create_distributed_loader,
    create_rank_cached_dataloader,
    gather_for_metrics,
    gather_to_rank0,
)
from nnh_train.ddp_decorators import on_rank
from nnh_train.ddp_init import DEFAULT_TIMEOUT, DistInfo, get_dist_info, initialize_ddp
from nnh_train.errors import (
    CheckpointError,
    NNHError,
    RankError,
    RunDirLockedError,
    WorkerError,
)
from nnh_train.handler import PREEMPTED_EXIT_CODE, NNHandler
from nnh_train.parallel import ParallelExecutor, parallel_on_all_devices, parallelize_on_gpus
from nnh_train.slurm import expand_slurm_nodelist, expand_tasks_per_node

__all__ = [
    "DEFAULT_TIMEOUT",
    "PREEMPTED_EXIT_CODE",
    "CSVLogger",
    "Callback",
    "CheckpointError",
    "DataLoaderType",
    "DistInfo",
    "EarlyStopping",
    "LoggingMode",
    "ModelCheckpoint",
    "ModelType",
    "NNHError",
    "NNHandler",
    "ParallelExecutor",
    "RankError",
    "RunDirLockedError",
    "TensorBoardLogger",
    "WorkerError",
    "aggregate_loss",
    "aggregate_metrics",
    "broadcast_data",
    "broadcast_if_ddp",
    "create_distributed_loader",
    "create_rank_cached_dataloader",
    "expand_slurm_nodelist",
    "expand_tasks_per_node",
    "gather_for_metrics",
    "gather_to_rank0",
    "get_dist_info",
    "initialize_ddp",
    "load_checkpoint",
    "on_rank",
    "parallel_on_all_devices",
    "parallelize_on_gpus",
    "save_checkpoint",
]
