"""NNHandler in one process: exact resume, gradient accumulation, NaN stop, precision, plots,
streaming data, argument errors. The multi-process behaviour is in test_handler_ddp.py and
test_handler_preempt.py."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from nnh_data import ShardedStreamingDataset, SharedEpochDataset
from nnh_train.callbacks import CSVLogger
from nnh_train.handler import NNHandler
from tests.support import Net, data


def handler(train=None, batch_size: int = 8, seed: int = 0, **loader_kwargs) -> NNHandler:
    torch.manual_seed(seed)
    h = NNHandler(Net, device="cpu", use_distributed=False)
    h.log_fn = lambda line: None
    h.set_optimizer(torch.optim.Adam, lr=0.01)
    h.set_scheduler(torch.optim.lr_scheduler.StepLR, interval="step", step_size=5, gamma=0.9)
    h.set_loss_fn(nn.functional.mse_loss)
    h.add_metric("mae", lambda out, y: (out - y).abs().mean())
    if isinstance(train, DataLoader):
        h.set_train_loader(train)
    else:
        h.set_train_loader(data(40) if train is None else train, batch_size=batch_size,
                           num_workers=0, **loader_kwargs)  # fmt: skip
    h.set_val_loader(data(11, seed=1), batch_size=4, num_workers=0)
    return h


def weights(h: NNHandler) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in h.module.state_dict().items()}


def assert_same_run(a: NNHandler, b: NNHandler) -> None:
    wa, wb = weights(a), weights(b)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert (a.train_losses, a.val_losses, a.train_metrics, a.step) == (
        b.train_losses, b.val_losses, b.train_metrics, b.step,
    )  # fmt: skip


def shuffled_loader() -> DataLoader:
    """A user's DataLoader whose RandomSampler draws its order from the global generator."""
    return DataLoader(data(40), batch_size=8, shuffle=True)


@pytest.mark.parametrize("make_train", [None, shuffled_loader], ids=["distributed", "shuffle"])
@pytest.mark.parametrize("stop_at", [3, 10])  # mid-epoch 0, and the end of epoch 1 (5 per epoch)
def test_resume_is_bitwise_the_uninterrupted_run(tmp_path, make_train, stop_at):
    make = (lambda: None) if make_train is None else make_train
    whole = handler(make())
    whole.train(3)
    first = handler(make())
    first.train(3, max_steps=stop_at)
    first.save(tmp_path / "ckpt.pt")
    torch.manual_seed(123)  # the resumed process starts from other generator states
    resumed = handler(make(), seed=99)
    resumed.train(3, resume=tmp_path / "ckpt.pt")
    assert_same_run(whole, resumed)
    assert len(resumed.train_losses) == 3 and len(resumed.val_losses) == 3


def test_train_after_max_steps_continues_where_it_stopped():
    whole = handler()
    whole.train(3)
    stepped = handler()
    stepped.train(3, max_steps=7)  # mid-epoch 1
    torch.rand(5)  # the caller's own use of the generator does not shift the run
    stepped.train(3)
    assert_same_run(whole, stepped)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])  # fp16: the scaler skips differ
def test_gradient_accumulation_equals_one_big_batch(precision):
    # 40 samples in batches of 4, groups of 3: 12, 12, 12 and a short last group of 4
    train = data(40)
    accumulated = handler(DataLoader(train, batch_size=4))
    one_batch = handler(DataLoader(train, batch_size=12))
    for h in (accumulated, one_batch):
        h.module.body[2].p = 0.0  # no dropout: both runs must see the same function
        h.scheduler = None
    accumulated.train(1, gradient_accumulation_steps=3, precision=precision)
    one_batch.train(1, precision=precision)
    assert accumulated.step == one_batch.step == 4
    tolerance = 1e-6 if precision == "fp32" else 2e-2
    for name, value in weights(one_batch).items():
        torch.testing.assert_close(weights(accumulated)[name], value, atol=tolerance, rtol=0)
    assert accumulated.train_losses[0] == pytest.approx(one_batch.train_losses[0], rel=1e-5)


def test_non_finite_loss_stops_before_the_optimizer_step():
    h = handler()
    calls = []

    def loss(out, y):
        calls.append(1)
        value = nn.functional.mse_loss(out, y)
        return value * math.inf if len(calls) == 4 else value

    h.set_loss_fn(loss)
    h.train(1, max_steps=3)
    before = weights(h)
    with pytest.raises(FloatingPointError, match=r"step 3 .*rank\(s\) \[0\] \(rank 0: (inf|nan)\)"):
        h.train(2)
    assert h.step == 3 and all(torch.equal(before[k], v) for k, v in weights(h).items())


def test_history_logs_csv_and_plots(tmp_path):
    h = handler()
    h.add_callback(CSVLogger(tmp_path / "history.csv"))
    h.train(4, validate_every=2)
    assert len(h.train_losses) == 4 and h.val_epochs == [2, 4] and len(h.val_metrics["mae"]) == 2
    lines = (tmp_path / "history.csv").read_text().splitlines()
    assert lines[0].split(",")[:6] == [
        "epoch",
        "step",
        "train_loss",
        "train_mae",
        "val_loss",
        "val_mae",
    ]
    assert len(lines) == 5 and lines[1].split(",")[4] == ""  # no validation in epoch 1
    assert h.epoch_logs["samples_per_s"] > 0 and 0 <= h.epoch_logs["data_wait"] <= 1
    h.plot_losses(tmp_path / "losses.png")
    h.plot_metrics(tmp_path / "metrics.png")
    for name in ("losses.png", "metrics.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_validation_leaves_out_distributed_sampler_pads():
    # one process: the val loss over 11 samples is the plain mean, batches of 4 (4, 4, 3)
    h = handler()
    h.train(1)
    x, y = data(11, seed=1).tensors
    with torch.no_grad():
        h.module.eval()
        expected = nn.functional.mse_loss(h.module(x), y).item()
    assert h.val_losses[0] == pytest.approx(expected, rel=1e-6)


class FromField(nn.Linear):
    """A linear model on the ``x`` field of dict batches."""

    def forward(self, batch: dict) -> torch.Tensor:
        return super().forward(batch["x"])


def stream_handler(
    urls: list[str], seed: int = 0, seen: list | None = None, num_workers: int = 0
) -> NNHandler:
    """A linear model regressing each sample's id from its payload, on a stream of ``urls``;
    ``seen`` collects the (id, pad) of every sample trained on."""
    torch.manual_seed(seed)
    h = NNHandler(FromField(16, 1), device="cpu")
    h.log_fn = lambda line: None
    h.set_optimizer(torch.optim.SGD, lr=0.01)

    def loss(out: torch.Tensor, batch: dict) -> torch.Tensor:
        if seen is not None:
            seen.extend(zip(batch["__index__"].tolist(), batch["__pad__"].tolist()))
        return (out.squeeze(1) - batch["__index__"].float()).pow(2).mean()

    h.set_loss_fn(loss)
    dataset = ShardedStreamingDataset(urls, seed=3, decode=as_features)
    h.set_train_loader(dataset, batch_size=5, num_workers=num_workers)
    return h


def as_features(sample: dict) -> dict:
    """A dict sample as the model sees it: its 16 payload bytes as floats."""
    return {**sample, "x": torch.frombuffer(bytearray(sample["bin"]), dtype=torch.uint8).float()}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [0, 2])
def test_streaming_dataset_resumes_mid_epoch(tar_shards, tmp_path, workers):
    urls = tar_shards([7, 9, 8])
    whole = stream_handler(urls, num_workers=workers)
    whole.train(2)
    first = stream_handler(urls, num_workers=workers)
    first.train(2, max_steps=7)  # epoch 1, batch 2 of 5
    first.save(tmp_path / "ckpt.pt")
    resumed = stream_handler(urls, seed=5, num_workers=workers)
    resumed.train(2, resume=tmp_path / "ckpt.pt")
    assert_same_run(whole, resumed)


def test_argument_errors():
    h = NNHandler(nn.Linear(2, 1), device="cpu", use_distributed=False)
    with pytest.raises(ValueError, match="set_optimizer, set_loss_fn, set_train_loader"):
        h.train(1)
    with pytest.raises(ValueError, match="set_scheduler needs an optimizer"):
        h.set_scheduler(torch.optim.lr_scheduler.StepLR, step_size=1)
    h.set_optimizer(torch.optim.SGD, lr=0.1)
    h.set_loss_fn(nn.functional.mse_loss)
    h.set_train_loader(data(8), batch_size=4, num_workers=0)
    with pytest.raises(
        ValueError, match="precision must be one of 'fp32', 'bf16', 'fp16', got 'fp8'"
    ):
        h.train(1, precision="fp8")
    with pytest.raises(ValueError, match="interval must be one of 'epoch', 'step'"):
        h.set_scheduler(torch.optim.lr_scheduler.StepLR, interval="batch", step_size=1)
    with pytest.raises(ValueError, match="batch_size must be an integer"):
        h.set_val_loader(data(8))
    with pytest.raises(ValueError, match="model keyword arguments"):
        NNHandler(nn.Linear(2, 1), device="cpu", use_distributed=False, bias=False)
    with pytest.raises(ValueError, match="name must be one of"):
        h.history("val_acc")


def test_a_loss_class_is_refused_at_the_call():
    h = NNHandler(nn.Linear(2, 1), device="cpu", use_distributed=False)
    fix = r"class CrossEntropyLoss: .*set_loss_fn\(CrossEntropyLoss\(\)\)"
    with pytest.raises(ValueError, match=fix):
        h.set_loss_fn(nn.CrossEntropyLoss)


def test_predict_over_a_plain_dataloader_in_one_process_keeps_its_order():
    h = NNHandler(Net, device="cpu", use_distributed=False, dropout=0.0)
    x = torch.randn(10, 4)
    got = h.predict(DataLoader(TensorDataset(x), batch_size=3))
    with torch.no_grad():
        torch.testing.assert_close(got, h.module(x))


class EpochAware(TensorDataset):
    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch


def test_a_dataloader_whose_workers_miss_set_epoch_is_warned_about():
    h = NNHandler(Net, device="cpu", use_distributed=False)
    ds = EpochAware(*data(8).tensors)
    with pytest.warns(RuntimeWarning, match=r"persistent workers keep the epoch.*SharedEpoch"):
        h.set_train_loader(DataLoader(ds, batch_size=4, num_workers=1, persistent_workers=True))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        h.set_train_loader(DataLoader(SharedEpochDataset(ds), batch_size=4, num_workers=1,
                                      persistent_workers=True))  # fmt: skip
        h.set_train_loader(ds, batch_size=4, num_workers=1)  # wrapped by the handler
    assert isinstance(h.train_loader.dataset, SharedEpochDataset)


def test_a_streaming_loader_with_persistent_workers_is_not_warned_about(tar_shards):
    """``streaming_loader`` hands its loader a view of the dataset; set_epoch reaches the
    workers through it, so the persistent-workers warning does not apply."""
    from nnh_data import streaming_loader

    h = stream_handler(tar_shards([7, 9, 8]))
    loader = streaming_loader(ShardedStreamingDataset(tar_shards([5], name="other")), 4,
                              num_workers=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        h.set_train_loader(loader)
