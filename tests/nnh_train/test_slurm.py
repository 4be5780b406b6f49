"""Slurm host and task lists: against ``scontrol show hostnames``, tables, and round-trips."""

from __future__ import annotations

import itertools
import shutil
import subprocess

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nnh_train import expand_slurm_nodelist, expand_tasks_per_node

# Node lists that this Slurm (22.05) also expands: the reference is its own parser.
SLURM_TABLE = [
    "vm",
    "node001",
    "node[001-004,007]",
    "n[098-100]",
    "n[8-10]",
    "n[01-100]",
    "n[0-0002]",
    "rack[1-2]-n[01-02]",
    "gpu-a[01-03,07],gpu-b12",
    "a[1]b[2]",
    "n[3,1,2],m[1-2,2]",
    "host.example.org,n[1-2]",
]

# Text after a bracket: Slurm 23.02+ accepts it, this Slurm version does not.
SUFFIX_TABLE = {
    "n[1-2]-ib": ["n1-ib", "n2-ib"],
    "gpu[01-02]-ib0,login": ["gpu01-ib0", "gpu02-ib0", "login"],
    "r[1-2]c[3]-x": ["r1c3-x", "r2c3-x"],
    "n[1-2].example.org": ["n1.example.org", "n2.example.org"],
}

MALFORMED = ["", "a,,b", ",a", "a,", "n[1-2", "n1-2]", "n[5-3]", "n[]", "n[[1]]", "a b",
             "n[1-]", "n[-1]", "n[a-b]", "n[1,,2]", "n[1-2-3]"]


def _scontrol_hostnames(nodelist: str) -> list[str]:
    done = subprocess.run(["scontrol", "show", "hostnames", nodelist],
                          capture_output=True, text=True, timeout=10, check=True)
    return done.stdout.split()


@pytest.mark.skipif(shutil.which("scontrol") is None, reason="scontrol is not installed "
                    "(run ../shared/slurm/start-local-slurm.sh to install Slurm)")
@pytest.mark.parametrize("nodelist", SLURM_TABLE)
def test_expansion_matches_scontrol(nodelist):
    assert expand_slurm_nodelist(nodelist) == _scontrol_hostnames(nodelist)


@pytest.mark.parametrize(("nodelist", "hosts"), SUFFIX_TABLE.items())
def test_text_after_a_bracket(nodelist, hosts):
    assert expand_slurm_nodelist(nodelist) == hosts


@pytest.mark.parametrize("nodelist", MALFORMED)
def test_malformed_lists_raise(nodelist):
    with pytest.raises(ValueError, match="nodelist"):
        expand_slurm_nodelist(nodelist)


_text = st.text("abcxyz-.", min_size=1, max_size=4).filter(lambda t: not t[0].isdigit())
_range = st.tuples(st.integers(0, 120), st.integers(0, 5), st.integers(0, 3))  # lo, count, pad


@st.composite
def _item(draw):
    """One item as its parts: literal strings and bracket groups of (lo, hi, width) ranges."""
    parts = [draw(_text)]
    for _ in range(draw(st.integers(0, 2))):
        ranges = [(lo, lo + n, len(str(lo)) + pad) for lo, n, pad in draw(st.lists(_range,
                                                                                   min_size=1,
                                                                                   max_size=3))]
        parts.append(ranges)
        if draw(st.booleans()):
            parts.append(draw(_text))
    return parts


def _render(parts) -> str:
    return "".join(
        p if isinstance(p, str)
        else "[" + ",".join(f"{lo:0{w}d}" + (f"-{hi}" if hi > lo else "") for lo, hi, w in p) + "]"
        for p in parts
    )


def _hosts(parts) -> list[str]:
    choices = [[p] if isinstance(p, str)
               else [f"{n:0{w}d}" for lo, hi, w in p for n in range(lo, hi + 1)] for p in parts]
    return ["".join(c) for c in itertools.product(*choices)]


@given(st.lists(_item(), min_size=1, max_size=3))
def test_round_trip_of_rendered_lists(items):
    nodelist = ",".join(_render(parts) for parts in items)
    assert expand_slurm_nodelist(nodelist) == [h for parts in items for h in _hosts(parts)]


@given(st.lists(st.from_regex(r"[a-z][a-z0-9.-]{0,8}", fullmatch=True), min_size=1, max_size=5))
def test_plain_host_names_come_back_as_given(hosts):
    assert expand_slurm_nodelist(",".join(hosts)) == hosts


@pytest.mark.parametrize(
    ("value", "counts"),
    [("4", [4]), ("2(x3),1", [2, 2, 2, 1]), ("1,3(x2)", [1, 3, 3]), ("8(x1)", [8])],
)
def test_tasks_per_node(value, counts):
    assert expand_tasks_per_node(value) == counts


@pytest.mark.parametrize("value", ["", "2(x)", "2x3", "(x2)", "2,,1", "-1"])
def test_malformed_tasks_per_node_raise(value):
    with pytest.raises(ValueError, match="SLURM_TASKS_PER_NODE"):
        expand_tasks_per_node(value)
