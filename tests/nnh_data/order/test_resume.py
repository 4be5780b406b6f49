"""The resume protocol as pure functions: states made, checked, matched, merged, resumed."""

from __future__ import annotations

import pytest

from nnh_data.order.epoch import remaining
from nnh_data.order.resume import (
    STATE_VERSION,
    check_matches,
    check_state,
    make_state,
    merge_states,
    next_base,
    pass_base,
    pass_start,
    state_from_loader,
)

SETTINGS = {"seed": 3, "total": 20, "window": 4, "uneven": "pad", "shards": "f",
            "batch_size": None, "unit": 1}  # fmt: skip


def state(worker: int, count: int, *, num_workers: int = 2, world_size: int = 2, **over) -> dict:
    made = make_state(SETTINGS, epoch=1, base=[(0, 20)], world_size=world_size,
                      num_workers=num_workers, worker=worker, handed_out=count)  # fmt: skip
    return {**made, **over}


def test_make_state_records_settings_layout_and_one_count():
    made = state(1, 4)
    assert made["version"] == STATE_VERSION and made["epoch"] == 1
    assert {k: made[k] for k in SETTINGS} == SETTINGS
    assert made["base"] == [[0, 20]] and made["consumed"] == [None, 4]


@pytest.mark.parametrize(
    ("broken", "message"),
    [
        ("not a dict", "must be a dict"),
        ({"version": 1}, "missing"),
        ({**state(0, 1), "version": 9}, "version"),
        ({**state(0, 1), "consumed": [None, None]}, "consumed"),
        ({**state(0, 1), "consumed": [1]}, "consumed"),
        ({**state(0, 1), "num_workers": 0}, "num_workers"),
        ({**state(0, 1), "batch_size": 0}, "batch_size"),
        # what an edited or damaged state holds: each refused, the field named
        ({**state(0, 1), "world_size": -1}, r"state\['world_size'\] must be in \[1, inf\), got -1"),
        ({**state(0, 1), "epoch": 3.0}, r"state\['epoch'\] must be an integer, got float 3.0"),
        ({**state(0, 1), "epoch": -1}, r"state\['epoch'\] must be in \[0, "),
        ({**state(0, 1), "epoch": True}, r"state\['epoch'\] must be an integer, got bool"),
        ({**state(0, 1), "seed": "3"}, r"state\['seed'\] must be an integer"),
        ({**state(0, 1), "total": -5}, r"state\['total'\]"),
        ({**state(0, 1), "window": None}, r"state\['window'\]"),
        ({**state(0, 1), "uneven": "wrap"}, r"state\['uneven'\] must be one of 'pad', 'drop'"),
        ({**state(0, 1), "shards": None}, r"state\['shards'\] must be .*strict=False"),
        ({**state(0, 1), "shards": 7}, r"state\['shards'\] must be"),
        ({k: v for k, v in state(0, 1).items() if k != "shards"}, r"missing keys \['shards'\]"),
        ({k: v for k, v in state(0, 1).items() if k != "unit"}, r"missing keys \['unit'\]"),
        ({**state(0, 1), "resumed_by": "me"}, r"unknown keys \['resumed_by'\]"),
        ({**state(0, 1), "unit": 0}, r"state\['unit'\]"),
        ({**state(0, 1), "batch_size": 4, "unit": 1}, r"state\['unit'\] must equal"),
        ({**state(0, 1), "base": None}, r"state\['base'\] must be a list"),
        ({**state(0, 1), "base": [[0, 20, 3]]}, r"state\['base'\] must be a list of \[lo, hi\]"),
        ({**state(0, 1), "base": [[-1, 20]]}, r"state\['base'\]\[0\]\[0\] must be in \[0, 19\]"),
        ({**state(0, 1), "base": [[0, 21]]}, r"state\['base'\]\[0\]\[1\] must be in \[1, 20\]"),
        ({**state(0, 1), "base": [[5, 5]]}, r"state\['base'\]\[0\]\[1\]"),
        ({**state(0, 1), "base": [[8, 12], [2, 4]]}, r"state\['base'\]\[1\]\[0\] must be in \[12"),
        ({**state(0, 1), "consumed": [-1, None]}, r"state\['consumed'\]\[0\] must be in \[0, 5\]"),
        ({**state(0, 1), "consumed": [6, None]}, r"state\['consumed'\]\[0\] must be in \[0, 5\]"),
        ({**state(0, 1), "consumed": [1.5, None]}, r"state\['consumed'\]\[0\] must be an int"),
        ({**state(0, 1), "consumed": "12"}, r"state\['consumed'\] must be a list"),
    ],
)
def test_check_state_names_what_is_wrong(broken, message):
    with pytest.raises(ValueError, match=message):
        check_state(broken)


def test_check_state_accepts_what_state_dicts_hold():
    for made in (state(0, 0), state(1, 5), {**state(0, 0, world_size=1), "consumed": [10, 10]},
                 {**state(0, 0), "base": [], "consumed": [0, 0]},
                 {**state(0, 2), "base": [[3, 9], [9, 11], [15, 20]]}):  # fmt: skip
        assert check_state(made) == made


def test_check_state_fills_what_older_versions_left_out_when_not_strict():
    old = {k: v for k, v in state(0, 1).items() if k not in ("batch_size", "unit", "shards")}
    with pytest.raises(ValueError, match="strict=False"):
        check_state(old)
    checked = check_state(old, strict=False)
    assert (checked["batch_size"], checked["unit"], checked["shards"]) == (None, 1, None)
    with pytest.raises(ValueError, match=r"no shard fingerprint.*strict=False"):
        check_matches(checked, SETTINGS)
    with pytest.warns(UserWarning, match="no shard fingerprint"):
        check_matches(checked, SETTINGS, strict=False)


def test_check_matches_refuses_a_worker_state_of_another_world_size():
    check_matches(check_state(state(0, 1)), SETTINGS, world_size=2)
    with pytest.raises(ValueError, match=r"state\['world_size'\] is 2 but this dataset has "
                       r"world_size=4.*merge"):  # fmt: skip
        check_matches(check_state(state(0, 1)), SETTINGS, world_size=4)
    merged = {**state(0, 0), "consumed": [2, 3]}  # every count: resumes with any world size
    check_matches(check_state(merged), SETTINGS, world_size=4)


@pytest.mark.parametrize("key", ["seed", "total", "window", "uneven", "shards"])
def test_check_matches_refuses_another_dataset(key):
    other = {**SETTINGS, key: "other"}
    with pytest.raises(ValueError, match=key):
        check_matches(check_state(state(0, 1)), other)


def test_merge_states_joins_worker_counts_and_refuses_disagreement():
    assert merge_states([state(0, 3), state(1, 5)])["consumed"] == [3, 5]
    with pytest.raises(ValueError, match="cover every worker"):
        merge_states([state(0, 3)])
    with pytest.raises(ValueError, match="disagree on worker 0"):
        merge_states([state(0, 3), state(0, 4)])
    with pytest.raises(ValueError, match="differ in 'epoch'"):
        merge_states([state(0, 3), state(1, 5, epoch=2)])
    with pytest.raises(ValueError, match="at least one"):
        merge_states([])


def test_state_from_loader_reads_both_loader_shapes():
    plain = {"dataset_state": make_state(SETTINGS, epoch=0, base=[(0, 20)], world_size=1,
                                         num_workers=1, worker=0, handed_out=7)}  # fmt: skip
    assert state_from_loader(plain)["consumed"] == [7]
    workers = {k: {"dataset_state": state(k, 2 + k)} for k in range(2)}
    loader = {"_snapshot": {"_worker_snapshots": workers}, "_steps_since_snapshot": 0}
    assert state_from_loader(loader)["consumed"] == [2, 3]
    with pytest.raises(ValueError, match="snapshot_every_n_steps"):
        state_from_loader({**loader, "_steps_since_snapshot": 1})


@pytest.mark.parametrize(
    ("consumed", "expected"),
    [
        ([0, 0], [(0, 20)]),
        ([5, 5], [(5, 10), (15, 20)]),
        ([5, 0], [(5, 20)]),
        ([10, 10], []),
    ],
)
def test_next_base_is_what_no_worker_handed_out(consumed, expected):
    merged = {**state(0, 0, num_workers=2, world_size=1), "consumed": consumed}
    assert next_base(merged, 20, "pad") == expected
    assert next_base(merged, 20, "pad") == remaining([(0, 20)], 1, 2, "pad", consumed)
    assert next_base(None, 20, "pad") == [(0, 20)]


def test_pass_base_keeps_a_worker_states_own_layout():
    assert pass_base(state(0, 3), 20, "pad") == [(0, 20)]
    assert pass_base(None, 20, "pad") == [(0, 20)]


LAYOUT = {"total": 20, "uneven": "pad", "world_size": 2, "num_workers": 2, "unit": 1}


@pytest.mark.parametrize(
    ("loaded", "worker", "expected"),
    [
        (None, 0, ([(0, 20)], 0)),
        (state(1, 3), 1, ([(0, 20)], 3)),
        ({**state(0, 0, world_size=1), "consumed": [5, 0]}, 1, ([(5, 20)], 0)),
    ],
)
def test_pass_start_table(loaded, worker, expected):
    assert pass_start(loaded, worker=worker, **LAYOUT) == expected


@pytest.mark.parametrize(
    ("loaded", "worker", "layout"),
    [
        (state(1, 3), 0, {}),
        (state(1, 3), 1, {"num_workers": 3}),
        (state(1, 3), 1, {"world_size": 4}),
        (state(1, 3), 1, {"unit": 8}),
    ],
)
def test_pass_start_refuses_a_worker_state_of_another_layout(loaded, worker, layout):
    with pytest.raises(ValueError, match="merge the workers' states"):
        pass_start(loaded, worker=worker, **{**LAYOUT, **layout})
