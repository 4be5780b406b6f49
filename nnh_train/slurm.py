"""Slurm's compact host and task lists, expanded the way Slurm expands them.

A node list such as ``gpu-a[01-03,07],gpu-b12`` names five hosts: items are separated by commas
outside brackets, each bracket group is a comma list of numbers or ``lo-hi`` ranges whose numbers
keep the width of ``lo`` (``n[098-100]``), and several groups in one item multiply
(``rack[1-2]-n[01-02]`` is four hosts, leftmost group outermost). Text may follow a bracket
(``n[1-2]-ib``), which Slurm accepts since 23.02. The parser is stricter than Slurm on input Slurm
never writes: empty items, unbalanced brackets and whitespace raise ``ValueError`` instead of
being skipped or read as literal text.
"""

from __future__ import annotations

import itertools
import re

__all__ = ["expand_slurm_nodelist", "expand_tasks_per_node"]

# One item: literal text (no brackets, commas or spaces) and bracket groups, at least one of them.
_ITEM = re.compile(r"(?:[^\[\],\s]+|\[[^\[\]]*\])+")
# A comma outside brackets: one not followed by a ']' before the next '['.
_TOP_LEVEL_COMMA = re.compile(r",(?![^\[]*\])")
_PART = re.compile(r"\[([^\[\]]*)\]|([^\[\]]+)")
_RANGE = re.compile(r"(\d+)(?:-(\d+))?")
_TASKS = re.compile(r"(\d+)(?:\(x(\d+)\))?")


def expand_slurm_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm node list (``SLURM_JOB_NODELIST``) into host names, in Slurm's order.

    Example:
        >>> expand_slurm_nodelist("gpu-a[01-03,07],gpu-b12")
        ['gpu-a01', 'gpu-a02', 'gpu-a03', 'gpu-a07', 'gpu-b12']

    Raises:
        ValueError: when ``nodelist`` is empty or malformed, naming the offending part.
    """
    if not isinstance(nodelist, str) or not nodelist:
        raise ValueError(f"nodelist must be a non-empty string, got {nodelist!r}")
    hosts: list[str] = []
    for item in _TOP_LEVEL_COMMA.split(nodelist):
        if not _ITEM.fullmatch(item):
            raise ValueError(
                f"nodelist {nodelist!r} has a malformed item {item!r}: expected text and "
                "[...] groups, with balanced brackets and no empty item or whitespace"
            )
        choices = [
            _expand_ranges(group, nodelist) if text == "" else [text]
            for group, text in _PART.findall(item)
        ]
        hosts.extend("".join(parts) for parts in itertools.product(*choices))
    return hosts


def _expand_ranges(group: str, nodelist: str) -> list[str]:
    """``"098-100,7"`` -> ``["098", "099", "100", "7"]``: numbers keep the width of ``lo``."""
    numbers = []
    for piece in group.split(","):
        match = _RANGE.fullmatch(piece)
        if match is None or int(match[2] or match[1]) < int(match[1]):
            raise ValueError(
                f"nodelist {nodelist!r} has a bad range {piece!r} in [{group}]: "
                "expected N or N-M with N <= M"
            )
        lo, hi = match[1], match[2] or match[1]
        numbers.extend(str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1))
    return numbers


def expand_tasks_per_node(tasks_per_node: str) -> list[int]:
    """Expand ``SLURM_TASKS_PER_NODE`` into one task count per node.

    Example:
        >>> expand_tasks_per_node("2(x3),1")
        [2, 2, 2, 1]

    Raises:
        ValueError: when the value is not a comma list of ``N`` or ``N(xK)``.
    """
    counts: list[int] = []
    for piece in str(tasks_per_node).split(","):
        match = _TASKS.fullmatch(piece)
        if match is None:
            raise ValueError(
                f"SLURM_TASKS_PER_NODE must be a comma list of N or N(xK), got {tasks_per_node!r}"
            )
        counts.extend([int(match[1])] * int(match[2] or 1))
    return counts
