"""NNHandler on 2 real gloo processes: the history of every rank equals one process's on the same
data, a NaN on one rank stops both at the same step, accumulation equals the big batch, fp16
skips agree, callbacks decide alike, predict returns N rows in order, and checkpoints move between
DDP+compile and plain models. All scenarios share one 2-process run (spawning costs the time)."""

from __future__ import annotations

import math
import os
import re
import shutil

import pytest
import torch
from torch import nn

from nnh_data import write_shards
from nnh_train.callbacks import Callback, CSVLogger, EarlyStopping, ModelCheckpoint
from nnh_train.checkpoint import load_checkpoint
from nnh_train.handler import NNHandler
from nnh_train.run_lock import LOCK_NAME, acquire_run_dirs, release_run_dirs
from tests.nnh_train.test_handler import Net, data, stream_handler
from tests.support import run_distributed

WORLD = 2
NAN_AT = 5  # the optimizer step at which rank 1's loss turns NaN
STREAM = 25  # samples in the stream: 13 per rank, one of them a pad


def make(batch_size: int, train_size: int = 48, lr: float = 0.01, optimizer=torch.optim.Adam,
         **net) -> NNHandler:  # fmt: skip
    torch.manual_seed(0)
    h = NNHandler(Net, device="cpu", dropout=0.0, **net)
    h.log_fn = lambda line: None
    h.set_optimizer(optimizer, lr=lr)
    h.set_loss_fn(nn.functional.mse_loss)
    h.add_metric("mae", lambda out, y: (out - y).abs().mean())
    h.set_train_loader(data(train_size), batch_size=batch_size, num_workers=0)
    h.set_val_loader(data(11, seed=1), batch_size=4, num_workers=0)
    return h


def summary(h: NNHandler) -> dict:
    return {
        "history": (h.train_losses, h.val_losses, h.train_metrics, h.val_metrics),
        "weights": {k: v.clone() for k, v in h.module.state_dict().items()},
        "step": h.step,
        "epoch": h.epoch,
    }


def _history(rank: int, world_size: int) -> dict:
    h = make(batch_size=4)
    h.set_scheduler(torch.optim.lr_scheduler.StepLR, interval="step", step_size=4, gamma=0.5)
    h.train(2)
    predicted = h.predict(data(11, seed=1), batch_size=4)
    sampled = h.sample(lambda module, n: (module(torch.ones(n, 4)), os.getpid()), 3)
    return {**summary(h), "predict": predicted, "sample": sampled}


def _fp16(rank: int, world_size: int) -> dict:
    h = make(batch_size=4, lr=0.05)
    h.train(2, precision="fp16")
    return {**summary(h), "scale": h._stepper.scaler.get_scale()}


def _nan(rank: int, world_size: int) -> dict:
    h = make(batch_size=4)
    calls = []

    def loss(out, y):
        calls.append(1)
        value = nn.functional.mse_loss(out, y)
        return value * math.nan if rank == 1 and len(calls) == NAN_AT + 1 else value

    h.set_loss_fn(loss)
    try:
        h.train(3)
    except FloatingPointError as exc:
        return {**summary(h), "error": str(exc)}
    return summary(h)


def _accumulation(rank: int, world_size: int) -> dict:
    h = make(batch_size=2, train_size=20, lr=0.1, optimizer=torch.optim.SGD)
    h.train(1, gradient_accumulation_steps=3)  # 5 batches per rank: groups of 3 and 2
    return summary(h)


def _callbacks(rank: int, world_size: int, folder: str) -> dict:
    h = make(batch_size=4, lr=0.0)  # nothing improves: EarlyStopping stops after patience
    h.add_callback(ModelCheckpoint(folder))
    h.add_callback(EarlyStopping("val_loss", patience=2))
    h.add_callback(CSVLogger(os.path.join(folder, "history.csv")))
    h.train(10)
    return summary(h)


def _compiled(rank: int, world_size: int, folder: str) -> dict:
    h = NNHandler.load(os.path.join(folder, "plain.pt"), Net, device="cpu", dropout=0.0)
    h.set_optimizer(torch.optim.Adam, lr=0.01)
    h.set_loss_fn(nn.functional.mse_loss)
    h.set_train_loader(data(48), batch_size=4, num_workers=0)
    h.log_fn = lambda line: None
    start = summary(h)
    h.train(2, compile="aot_eager")
    h.save(os.path.join(folder, "ddp_compiled.pt"))
    return {"start": start, **summary(h)}


def _stream(rank: int, world_size: int, folder: str, urls: list[str]) -> list:
    seen: list = []
    h = stream_handler(urls, seen=seen)
    h.train(1, max_steps=2)  # 10 of the rank's 13 samples
    h.save(os.path.join(folder, "stream.pt"))
    return seen


def _frozen(rank: int, world_size: int) -> dict:
    """Epoch figures of a model that does not change (lr 0), over 47 training and 11 validation
    samples: both need pads on one rank, from DistributedSampler or from the rank cache."""
    figures = {}
    for cache in (False, True):
        h = make(batch_size=4, train_size=47, lr=0.0)
        h.set_train_loader(data(47), batch_size=4, cache=cache, num_workers=0)
        h.set_val_loader(data(11, seed=1), batch_size=4, cache=cache, num_workers=0)
        h.train(1)
        figures[cache] = (h.train_losses[0], h.val_losses[0])
    return figures


def _unused_parameters_flag(rank: int, world_size: int) -> dict:
    found = {}
    for value in ("1", "no", "maybe"):
        os.environ["DDP_FIND_UNUSED_PARAMETERS"] = value
        try:
            found[value] = NNHandler(nn.Linear(2, 1), device="cpu").model.find_unused_parameters
        except ValueError as exc:
            found[value] = str(exc)
    os.environ["DDP_FIND_UNUSED_PARAMETERS"] = "no"
    found["argument"] = NNHandler(nn.Linear(2, 1), device="cpu",
                                  find_unused_parameters=True).model.find_unused_parameters
    del os.environ["DDP_FIND_UNUSED_PARAMETERS"]
    return found


class HalfUsed(nn.Module):
    """A model with a parameter that no loss ever uses."""

    def __init__(self) -> None:
        super().__init__()
        self.used, self.unused = nn.Linear(4, 1), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def _unused_parameters(rank: int, world_size: int) -> dict:
    """DDP's error names the handler's switch; with it, the same model trains."""
    found = {}
    for flag in (None, True):
        torch.manual_seed(0)
        h = NNHandler(HalfUsed, device="cpu", find_unused_parameters=flag)
        h.log_fn = lambda line: None
        h.set_optimizer(torch.optim.SGD, lr=0.1)
        h.set_loss_fn(nn.functional.mse_loss)
        h.set_train_loader(data(16), batch_size=4, num_workers=0)
        try:
            h.train(1)
            found[flag] = h.step
        except RuntimeError as exc:
            found[flag] = str(exc)
    return found


def _outcome(h: NNHandler, epochs: int) -> str:
    """``h.train(epochs)``'s error and where it stopped, or "trained"."""
    try:
        h.train(epochs)
    except RuntimeError as exc:
        return f"{type(exc).__name__}: {exc} (step {h.step}, epoch {h.epoch})"
    return "trained"


def _locked(rank: int, world_size: int, folder: str) -> str:
    """A run on a folder another process holds: refused on every rank."""
    h = make(batch_size=4)
    h.add_callback(ModelCheckpoint(folder))
    return _outcome(h, 1)


class _TakenAway(Callback):
    """On rank 0, as epoch 1 starts: the run folder deleted (``rm -rf``) and another run's lock
    file made in it again."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def on_epoch_begin(self, handler) -> None:
        if handler.rank == 0 and handler.epoch == 1:
            shutil.rmtree(self.folder)
            os.makedirs(self.folder)
            with open(os.path.join(self.folder, LOCK_NAME), "w") as f:
                f.write("pid 1 on host elsewhere, since now")


def _taken(rank: int, world_size: int, folder: str) -> str:
    """A run whose folder another run took under it: stopped on every rank at that epoch's
    end, before its CSVLogger writes."""
    run = os.path.join(folder, "taken")
    h = make(batch_size=4)
    h.add_callback(CSVLogger(os.path.join(run, "metrics.csv")))
    h.add_callback(_TakenAway(run))
    return _outcome(h, 3)


def _scenarios(rank: int, world_size: int, folder: str, urls: list[str], locked: str) -> dict:
    return {
        "locked": _locked(rank, world_size, locked),
        "taken": _taken(rank, world_size, folder),
        "unused": _unused_parameters_flag(rank, world_size),
        "frozen": _frozen(rank, world_size),
        "stream": _stream(rank, world_size, folder, urls),
        "history": _history(rank, world_size),
        "fp16": _fp16(rank, world_size),
        "nan": _nan(rank, world_size),
        "accumulation": _accumulation(rank, world_size),
        "callbacks": _callbacks(rank, world_size, folder),
        "compiled": _compiled(rank, world_size, folder),
        "unused_error": _unused_parameters(rank, world_size),  # last: DDP's reducer is left broken
    }


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("handler-ddp")
    plain = NNHandler(Net, device="cpu", use_distributed=False, dropout=0.0)  # no DDP, no compile
    plain.save(path / "plain.pt")
    return str(path)


@pytest.fixture(scope="module")
def urls(tmp_path_factory) -> list[str]:
    path = tmp_path_factory.mktemp("stream")
    samples = ({"__key__": f"{g:06d}", "bin": bytes([g % 7] * 16)} for g in range(STREAM))
    write_shards(samples, f"{path}/s-%06d.tar", max_count=9)
    return sorted(str(p) for p in path.glob("s-*.tar"))


@pytest.fixture(scope="module")
def locked(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("locked"))


@pytest.fixture(scope="module")
def reports(folder, urls, locked) -> list[dict]:
    acquire_run_dirs([locked])  # this process holds it while the ranks try
    try:
        return run_distributed(_scenarios, WORLD, folder, urls, locked, timeout=150)
    finally:
        release_run_dirs([locked])


def flat(history: tuple) -> list[list[float]]:
    train, val, train_metrics, val_metrics = history
    return [train, val, *train_metrics.values(), *val_metrics.values()]


def assert_weights_close(a: dict, b: dict, atol: float) -> None:
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=0)


def assert_ranks_equal(runs: list[dict]) -> None:
    first, second = runs
    assert first["history"] == second["history"] and first["step"] == second["step"]
    assert all(torch.equal(first["weights"][k], v) for k, v in second["weights"].items())


@pytest.mark.timeout(200)
def test_history_is_identical_on_every_rank_and_equals_one_process(reports):
    runs = [r["history"] for r in reports]
    assert_ranks_equal(runs)
    alone = make(batch_size=8)
    alone.set_scheduler(torch.optim.lr_scheduler.StepLR, interval="step", step_size=4, gamma=0.5)
    alone.train(2)
    for got, expected in zip(flat(runs[0]["history"]), flat(summary(alone)["history"])):
        assert got == pytest.approx(expected, rel=1e-5)
    assert_weights_close(runs[0]["weights"], summary(alone)["weights"], atol=1e-5)


@pytest.mark.timeout(200)
def test_predict_returns_every_row_once_in_dataset_order_on_rank_0(reports):
    x, _ = data(11, seed=1).tensors
    model = Net(dropout=0.0)
    model.load_state_dict(reports[0]["history"]["weights"])
    with torch.no_grad():
        expected = model(x)
    torch.testing.assert_close(reports[0]["history"]["predict"], expected)
    assert reports[1]["history"]["predict"] is None


@pytest.mark.timeout(200)
def test_sample_runs_on_rank_0_and_returns_everywhere(reports):
    (out0, pid0), (out1, pid1) = (r["history"]["sample"] for r in reports)
    assert pid0 == pid1 and torch.equal(out0, out1) and out0.shape == (3, 1)


@pytest.mark.timeout(200)
def test_fp16_scaler_decisions_agree(reports):
    assert_ranks_equal([r["fp16"] for r in reports])
    assert reports[0]["fp16"]["scale"] == reports[1]["fp16"]["scale"]
    assert all(math.isfinite(v) for v in reports[0]["fp16"]["history"][0])


@pytest.mark.timeout(200)
def test_nan_on_one_rank_stops_every_rank_at_that_step(reports):
    runs = [r["nan"] for r in reports]
    assert_ranks_equal(runs)
    for run in runs:
        assert run["step"] == NAN_AT
        assert f"step {NAN_AT} " in run["error"] and "rank(s) [1] (rank 1: nan)" in run["error"]
    assert runs[0]["error"] == runs[1]["error"]


@pytest.mark.timeout(200)
def test_accumulation_with_a_short_group_equals_the_big_batch(reports):
    runs = [r["accumulation"] for r in reports]
    assert_ranks_equal(runs)
    assert runs[0]["step"] == 2
    big = make(batch_size=12, train_size=20, lr=0.1, optimizer=torch.optim.SGD)  # 12 then 8
    big.train(1)
    assert_weights_close(runs[0]["weights"], summary(big)["weights"], atol=1e-6)


@pytest.mark.timeout(200)
def test_callbacks_decide_alike_on_every_rank(reports, folder):
    runs = [r["callbacks"] for r in reports]
    assert_ranks_equal(runs)
    assert runs[0]["epoch"] == 3  # lr 0: no improvement after epoch 1, patience 2
    assert load_checkpoint(os.path.join(folder, "best.pt"))["epoch"] == 1
    assert load_checkpoint(os.path.join(folder, "last.pt"))["epoch"] == 3
    rows = open(os.path.join(folder, "history.csv")).read().splitlines()
    assert len(rows) == 4  # rank 0 alone wrote: a header and 3 epochs


@pytest.mark.timeout(200)
def test_checkpoints_move_between_plain_and_ddp_compiled_models(reports, folder):
    plain = NNHandler(Net, device="cpu", use_distributed=False, dropout=0.0)
    first = load_checkpoint(os.path.join(folder, "plain.pt"))["model"]
    for name, value in reports[0]["compiled"]["start"]["weights"].items():
        assert torch.equal(value, first[name])  # plain -> DDP + compile
    saved = load_checkpoint(os.path.join(folder, "ddp_compiled.pt"))
    assert sorted(saved["model"]) == sorted(plain.module.state_dict())  # no prefixes
    with pytest.warns(RuntimeWarning, match="world_size=2, not 1: random generator states"):
        plain.load_state(os.path.join(folder, "ddp_compiled.pt"))  # DDP + compile -> plain
    assert_ranks_equal([reports[0]["compiled"], reports[1]["compiled"]])
    for name, value in reports[0]["compiled"]["weights"].items():
        assert torch.equal(plain.module.state_dict()[name], value)
    assert plain.epoch == 2 and reports[0]["compiled"]["step"] == 12


@pytest.mark.timeout(200)
def test_stream_checkpoint_resumes_with_another_world_size(reports, folder, urls, capsys):
    seen = reports[0]["stream"] + reports[1]["stream"]
    assert len(seen) == 20  # 2 steps of 5 on each rank
    rest: list = []
    alone = stream_handler(urls, seen=rest)
    capsys.readouterr()
    with pytest.warns(RuntimeWarning, match="world_size=2, not 1"):
        alone.train(1, resume=os.path.join(folder, "stream.pt"))
    real = sorted(index for index, pad in seen + rest if not pad)
    assert real == list(range(STREAM))  # the rest of the epoch, each sample once
    # Alone, the epoch is 5 batches and 1 is left: the progress starts at 4 (not at 2, the
    # batches each of the 2 ranks had done), one line a batch.
    assert re.findall(r"epoch 1/1 batch (\d+)/5 ", capsys.readouterr().err) == ["5"]


@pytest.mark.timeout(200)
def test_epoch_figures_leave_out_pads_of_both_loaders(reports):
    torch.manual_seed(0)
    model = Net(dropout=0.0)  # the weights make() starts from
    with torch.no_grad():
        expected = [nn.functional.mse_loss(model(x), y).item()
                    for x, y in (data(47).tensors, data(11, seed=1).tensors)]  # fmt: skip
    for report in reports:
        for cache, figures in report["frozen"].items():
            assert figures == pytest.approx(expected, rel=1e-6), f"cache={cache}"


@pytest.mark.timeout(200)
def test_find_unused_parameters_from_the_environment(reports):
    found = reports[0]["unused"]
    assert found["1"] is True and found["no"] is False
    assert (
        "DDP_FIND_UNUSED_PARAMETERS must be one of" in found["maybe"]
        and "'maybe'" in found["maybe"]
    )
    assert found["argument"] is True  # the argument wins over the environment


@pytest.mark.timeout(200)
def test_an_unused_parameter_error_names_the_handlers_switch(reports):
    for report in reports:
        error, steps = report["unused_error"][None], report["unused_error"][True]
        assert "NNHandler(..., find_unused_parameters=True)" in error
        assert "DDP_FIND_UNUSED_PARAMETERS=1" in error
        assert steps == 2  # 16 samples, 8 per rank, batches of 4


@pytest.mark.timeout(200)
def test_a_run_on_a_folder_another_run_holds_is_refused_on_every_rank(reports, locked):
    for report in reports:
        assert report["locked"].startswith("RankError: ")  # raised on rank 0, on every rank
        assert f"run directory '{locked}' is in use by another run (pid {os.getpid()}" in (
            report["locked"]
        )
        assert report["locked"].endswith("(step 0, epoch 0)")


@pytest.mark.timeout(200)
def test_a_run_whose_folder_another_run_took_stops_on_every_rank(reports, folder):
    for report in reports:
        assert report["taken"].startswith("RankError: ")  # found on rank 0, raised on every rank
        assert "was deleted while this run held it, and another run has used it since (pid 1 " \
            "on host elsewhere" in report["taken"]
        assert report["taken"].endswith("(step 12, epoch 2)")
    assert sorted(os.listdir(os.path.join(folder, "taken"))) == [LOCK_NAME]  # no row written
