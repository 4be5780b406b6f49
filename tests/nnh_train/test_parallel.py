"""nnh_train.parallel: ParallelExecutor, parallelize_on_gpus and parallel_on_all_devices on
this machine's devices (one spawned CPU worker without CUDA), including workers that raise,
exit, crash or return nothing, results moved to the CPU, and bad arguments."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from nnh_train.errors import WorkerError
from nnh_train.parallel import ParallelExecutor, parallel_on_all_devices, parallelize_on_gpus

CUDA = torch.cuda.is_available()
WORKER_DEVICES = (
    [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    if CUDA else [torch.device("cpu")]
)


def _scaled_sum(x: torch.Tensor, factor: float = 1.0, *, device: torch.device) -> dict:
    return {"sum": (x.to(device) * factor).sum(), "device": str(device), "pid": os.getpid()}


def _raise_in_worker(*, device: torch.device) -> None:
    raise KeyError("worker went wrong")


def _exit_hard(*, device: torch.device) -> None:
    os._exit(3)


def _segfault(*, device: torch.device) -> None:
    os.kill(os.getpid(), signal.SIGSEGV)


@parallelize_on_gpus(pass_device=False)
def _doubled(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@pytest.mark.timeout(60)
def test_parallel_executor_runs_one_cpu_worker_per_run():
    with ParallelExecutor() as executor:
        assert executor.devices == WORKER_DEVICES
        results = executor.run(_scaled_sum, torch.arange(4.0), factor=2.0)
    assert [r["device"] for r in results] == [str(d) for d in WORKER_DEVICES]
    first = results[0]
    assert first["sum"].item() == 12.0 and first["sum"].device.type == "cpu"
    assert first["pid"] != os.getpid()
    assert [t.tolist() for t in _doubled(torch.ones(2))] == [[2.0, 2.0]] * len(WORKER_DEVICES)


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("func", "expected"),
    [
        (_raise_in_worker, "KeyError: 'worker went wrong'"),
        (_exit_hard, "exit code 3"),
        (_segfault, "SIGSEGV"),
    ],
)
def test_parallel_executor_raises_when_a_worker_fails(func, expected):
    message = f"{func.__name__} failed in the worker for {WORKER_DEVICES[0]}"
    with pytest.raises(WorkerError, match=message) as info:
        ParallelExecutor().run(func)
    assert expected in str(info.value)


@pytest.mark.skipif(CUDA, reason="checks the CPU fallback")
def test_parallel_executor_on_cpu_warns_that_gpus_are_ignored():
    with pytest.warns(RuntimeWarning, match="num_gpus=2 but CUDA is not available"):
        assert ParallelExecutor(num_gpus=2).devices == [torch.device("cpu")]
    with pytest.raises(ValueError, match="num_gpus"):
        ParallelExecutor(num_gpus=0)


@pytest.mark.skipif(torch.cuda.device_count() > 1, reason="checks the fallback below 2 GPUs")
def test_parallel_on_all_devices_runs_directly_below_two_gpus():
    @parallel_on_all_devices
    def double(batch: torch.Tensor) -> torch.Tensor:
        return batch * 2

    assert double(torch.ones(3)).tolist() == [2.0, 2.0, 2.0]
    assert double.__name__ == "double"


def _nested(*, device: torch.device) -> dict:
    return {"t": (torch.ones(2, device=device), [torch.zeros(1, device=device)]), "n": 1}


def _return_nothing(*, device: torch.device) -> None:
    os._exit(0)


@pytest.mark.timeout(90)
def test_results_come_back_on_the_cpu_in_their_containers_and_a_silent_exit_is_named():
    executor = ParallelExecutor()
    (result, *_) = executor.run(_nested)
    assert result["n"] == 1 and isinstance(result["t"], tuple)
    assert [t.device.type for t in (result["t"][0], *result["t"][1])] == ["cpu", "cpu"]
    with pytest.raises(WorkerError, match=r"exited with code 0 but returned nothing"):
        executor.run(_return_nothing)


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "2"])
def test_num_gpus_is_checked(bad):
    with pytest.raises(ValueError, match="num_gpus must be"):
        ParallelExecutor(num_gpus=bad)


def test_ddp_decorators_keeps_the_names_ported_code_imports():
    from nnh_train import ddp_decorators, parallel

    for name in ("ParallelExecutor", "parallelize_on_gpus", "parallel_on_all_devices"):
        assert getattr(ddp_decorators, name) is getattr(parallel, name)
