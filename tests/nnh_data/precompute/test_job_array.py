"""nnh_data.precompute.job_array: the task index and count from arguments or Slurm's array
variables."""

from __future__ import annotations

import pytest

from nnh_data.precompute.job_array import array_task_info


def slurm(task_id: int, first: int, count: int, step: int | None = None) -> dict[str, str]:
    env = {"SLURM_ARRAY_TASK_ID": str(task_id), "SLURM_ARRAY_TASK_MIN": str(first),
           "SLURM_ARRAY_TASK_COUNT": str(count)}  # fmt: skip
    return env if step is None else {**env, "SLURM_ARRAY_TASK_STEP": str(step)}


@pytest.mark.parametrize(
    ("args", "env", "expected"),
    [
        ((None, None), {}, (0, 1)),
        ((2, 4), {}, (2, 4)),
        ((None, None), slurm(0, 0, 8), (0, 8)),
        ((None, None), slurm(5, 1, 8), (4, 8)),  # --array=1-8
        ((None, None), slurm(6, 0, 4, step=2), (3, 4)),  # --array=0-6:2
        ((1, None), slurm(5, 1, 8), (1, 8)),  # an argument wins over its variable
        ((None, 2), slurm(1, 0, 8), (1, 2)),
    ],
)
def test_task_from_arguments_then_slurm_then_alone(args, env, expected):
    assert array_task_info(*args, env=env) == expected


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        ((None, 3), {}, "num_tasks is 3 but task_index is not given"),
        ((3, 3), {}, r"task_index must be in \[0, 2\], got 3"),
        ((None, 0), {}, r"num_tasks must be in \[1, inf\), got 0"),
        ((None, None), slurm(7, 1, 3), "SLURM_ARRAY_TASK_ID=7 is not one of 3 evenly spaced"),
        ((None, None), slurm(3, 0, 4, step=2), "SLURM_ARRAY_TASK_ID=3 is not one of 4"),
        ((None, None), {"SLURM_ARRAY_TASK_ID": "x"}, "SLURM_ARRAY_TASK_ID must be an integer"),
    ],
)
def test_bad_task_settings_are_named(args, env, message):
    with pytest.raises(ValueError, match=message):
        array_task_info(*args, env=env)


def test_the_process_environment_by_default(monkeypatch):
    for name, value in slurm(12, 10, 5).items():
        monkeypatch.setenv(name, value)
    assert array_task_info() == (2, 5)
