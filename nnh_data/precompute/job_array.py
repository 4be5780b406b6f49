"""Which task of an offline job this process is: explicit arguments, else the Slurm job array.

Offline tools (``nnh-precompute``, ``nnh-data convert``) scale out the way HPC users already do:
``sbatch --array=0-7`` starts eight copies of one command, each told its place by Slurm's
``SLURM_ARRAY_TASK_*`` variables; each copy then does a disjoint share of the work. Any other
launcher passes ``task_index``/``num_tasks`` itself. Arrays with a step (``--array=0-14:2``)
are counted in steps; an irregular list (``--array=1,4,5``) has no task index Slurm can
give, so it is an error naming the variable rather than two tasks doing the same share.
"""

from __future__ import annotations

from collections.abc import Mapping

from nnh_data.checks import check_int
from nnh_data.topology import env_int

__all__ = ["array_task_info"]


def array_task_info(
    task_index: int | None = None,
    num_tasks: int | None = None,
    env: Mapping[str, str] | None = None,
) -> tuple[int, int]:
    """``(task index, number of tasks)``: the arguments when given, else from a Slurm job array,
    else ``(0, 1)``.

    In a job array the index is ``(SLURM_ARRAY_TASK_ID - SLURM_ARRAY_TASK_MIN) /
    SLURM_ARRAY_TASK_STEP`` and the count ``SLURM_ARRAY_TASK_COUNT``, so ``--array=1-8`` gives
    indices 0 to 7. Outside an array, ``num_tasks`` alone is an error: every copy would do task 0.

    Example:
        >>> array_task_info(env={"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_MIN": "1",
        ...                      "SLURM_ARRAY_TASK_COUNT": "8"})
        (4, 8)
    """
    slurm_index, slurm_count = _slurm_array(env)
    num_tasks = slurm_count if num_tasks is None else num_tasks
    num_tasks = check_int("num_tasks", 1 if num_tasks is None else num_tasks, low=1)
    if task_index is None:
        task_index = slurm_index
    if task_index is None and num_tasks > 1:
        raise ValueError(
            f"num_tasks is {num_tasks} but task_index is not given and this is not a Slurm job "
            "array: pass task_index (--task-index) to each task"
        )
    return check_int("task_index", task_index or 0, low=0, high=num_tasks - 1), num_tasks


def _slurm_array(env: Mapping[str, str] | None) -> tuple[int | None, int | None]:
    """``(index, count)`` of this Slurm array task, ``(None, None)`` outside an array."""
    task_id = env_int("SLURM_ARRAY_TASK_ID", env=env)
    if task_id is None:
        return None, None
    first = env_int("SLURM_ARRAY_TASK_MIN", env=env) or 0
    step = env_int("SLURM_ARRAY_TASK_STEP", low=1, env=env) or 1
    count = env_int("SLURM_ARRAY_TASK_COUNT", low=1, env=env) or 1
    index, off_step = divmod(task_id - first, step)
    if off_step or not 0 <= index < count:
        raise ValueError(
            f"environment variable SLURM_ARRAY_TASK_ID={task_id} is not one of {count} evenly "
            f"spaced tasks from {first} by {step}: submit a range such as --array=0-{count - 1} "
            "or pass task_index and num_tasks"
        )
    return index, count
