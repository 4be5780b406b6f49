"""One process per local device, with errors that reach the caller.

``ParallelExecutor`` and ``parallelize_on_gpus`` start one spawned process per GPU, or one CPU
process without CUDA, and raise as soon as a worker raises or dies (its traceback or exit code
in the message). ``parallel_on_all_devices`` is the single-process alternative, through
DataParallel.
"""

from __future__ import annotations

import functools
import os
import pickle
import tempfile
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.multiprocessing as mp

from nnh_data.checks import check_int
from nnh_train.errors import WorkerError

__all__ = ["ParallelExecutor", "WorkerError", "parallel_on_all_devices", "parallelize_on_gpus"]

F = TypeVar("F", bound=Callable[..., Any])
_GRACE_S = 5.0  # how long the other workers get to exit once one has failed
_TARGET = "_nnh_parallel_target"  # attribute holding the function a parallelize wrapper runs


class ParallelExecutor:
    """Run a function once per local GPU, each call in its own spawned worker process.

    Without CUDA one worker runs on the CPU, so the same code runs (and is tested) anywhere.
    Workers are spawned, so the function and its arguments must pickle: define the function at
    module level. Each ``run`` starts fresh workers, so a crashed worker never poisons the next.

    Example:
        >>> def square_sum(x, *, device):
        ...     return float((x.to(device) ** 2).sum())
        >>> with ParallelExecutor() as executor:
        ...     results = executor.run(square_sum, torch.arange(4.0))  # one result per device
    """

    def __init__(self, num_gpus: int | None = None, pass_device: bool = True) -> None:
        self.devices = _worker_devices(num_gpus)
        self.pass_device = pass_device

    def __enter__(self) -> ParallelExecutor:
        return self

    def __exit__(self, *exc_info: object) -> None:
        return None

    def run(self, func: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """``func(*args, device=d, **kwargs)`` (``device`` only with ``pass_device``) on every
        device ``d``; the results, moved to the CPU, in device order.

        Raises:
            WorkerError: as soon as a worker raises (with its traceback) or dies (with its exit
                code or signal); the other workers are stopped.
        """
        with tempfile.TemporaryDirectory(prefix="nnh-executor-") as folder:
            work = (func, args, kwargs, self.devices, self.pass_device, folder)
            context = mp.start_processes(
                _work, args=work, nprocs=len(self.devices), join=False, start_method="spawn"
            )
            try:
                while not context.join(grace_period=_GRACE_S):
                    pass
            except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
                device = self.devices[exc.error_index]
                name = getattr(func, "__qualname__", repr(func))
                raise WorkerError(f"{name} failed in the worker for {device}: {exc}") from exc
            finally:
                for process in context.processes:
                    if process.is_alive():  # only when interrupted (KeyboardInterrupt)
                        process.kill()
            return [_read_result(folder, i, device) for i, device in enumerate(self.devices)]


def _worker_devices(num_gpus: int | None) -> list[torch.device]:
    if num_gpus is not None:
        check_int("num_gpus", num_gpus, low=1)
    if not torch.cuda.is_available():
        if num_gpus not in (None, 1):
            warnings.warn(f"num_gpus={num_gpus} but CUDA is not available: one CPU worker runs",
                          RuntimeWarning, stacklevel=3)
        return [torch.device("cpu")]
    count = torch.cuda.device_count()
    wanted = count if num_gpus is None else check_int("num_gpus", num_gpus, low=1, high=count)
    return [torch.device("cuda", index) for index in range(wanted)]


def _work(index: int, func: Callable[..., Any], args: Any, kwargs: Any,
          devices: list[torch.device], pass_device: bool, folder: str) -> None:
    """One worker: run on ``devices[index]`` and pickle the CPU copy of the result to a file
    (a file, not a queue: a large result in a pipe would block the worker's exit)."""
    device = devices[index]
    if device.type == "cuda":
        torch.cuda.set_device(device)
    target = getattr(func, _TARGET, func)
    result = target(*args, device=device, **kwargs) if pass_device else target(*args, **kwargs)
    with open(os.path.join(folder, f"{index}.pkl"), "wb") as fh:
        pickle.dump(_to_cpu(result), fh)


def _read_result(folder: str, index: int, device: torch.device) -> Any:
    path = os.path.join(folder, f"{index}.pkl")
    if not os.path.exists(path):
        raise WorkerError(f"the worker for {device} exited with code 0 but returned nothing "
                          "(os._exit or sys.exit in the function?)")
    with open(path, "rb") as fh:
        return pickle.load(fh)


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(item) for item in obj)
    if isinstance(obj, dict):
        return {key: _to_cpu(value) for key, value in obj.items()}
    return obj


def parallelize_on_gpus(num_gpus: int | None = None, pass_device: bool = True
                        ) -> Callable[[Callable[..., Any]], Callable[..., list[Any]]]:
    """Make a module-level function run through :class:`ParallelExecutor` when called.

    Example:
        >>> @parallelize_on_gpus()
        ... def double(x, *, device):
        ...     return x.to(device) * 2
        >>> double(torch.ones(3))  # one tensor per GPU, or one from the CPU without CUDA
    """

    def decorator(func: Callable[..., Any]) -> Callable[..., list[Any]]:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> list[Any]:
            # The worker imports the wrapper by name (it is what the module holds) and runs
            # the function it carries, instead of starting workers again.
            return ParallelExecutor(num_gpus, pass_device).run(wrapper, *args, **kwargs)

        setattr(wrapper, _TARGET, func)
        return wrapper

    return decorator


class _FunctionModule(torch.nn.Module):
    """A parameter-free module whose forward is ``func``, for DataParallel."""

    def __init__(self, func: Callable[..., Any]) -> None:
        super().__init__()
        self.func = func

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.func(*args, **kwargs)


def parallel_on_all_devices(func: F) -> F:
    """Split the decorated function's tensor arguments over all GPUs with DataParallel.

    Inputs go on ``cuda:0``; each GPU runs ``func`` on its slice of the batch (so ``func`` must
    create tensors on its inputs' device) and the outputs are gathered on ``cuda:0``. With fewer
    than two GPUs (or on the CPU) ``func`` simply runs.

    Example:
        >>> @parallel_on_all_devices
        ... def embed(batch):
        ...     return batch @ torch.ones(batch.shape[1], 4, device=batch.device)
    """

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if torch.cuda.device_count() < 2:
            return func(*args, **kwargs)
        return torch.nn.DataParallel(_FunctionModule(func))(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
