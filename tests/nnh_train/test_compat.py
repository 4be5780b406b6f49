"""Code written for the original NNHandler: its basic MNIST example runs with only its imports
and data source changed (tests/scripts/nnhandler_mnist_basic.py), and each ported call works or
fails naming the nnh replacement."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from nnh_data import RankCache, ShardedStreamingDataset
from nnh_train import DataLoaderType, LoggingMode, ModelType, NNHandler
from nnh_train.checkpoint import load_checkpoint
from tests.support import ROOT, SCRIPTS, Net, data

MNIST = SCRIPTS / "nnhandler_mnist_basic.py"


class Recorder(nn.Linear):
    """Records the keyword arguments it was built with."""

    built_with: dict = {}

    def __init__(self, **kwargs) -> None:
        Recorder.built_with = kwargs
        super().__init__(4, 1)


def trainable(h: NNHandler) -> NNHandler:
    h.log_fn = lambda line: None
    h.set_optimizer(torch.optim.SGD, lr=0.05)
    h.set_loss_fn(nn.functional.mse_loss)
    h.set_train_loader(data(16), batch_size=8, num_workers=0)
    h.set_val_loader(data(8, seed=1), batch_size=8, num_workers=0)
    return h


@pytest.mark.timeout(180)
def test_the_original_mnist_example_runs_with_imports_and_data_changed(tmp_path):
    env = {**os.environ, "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg",
           "PYTHONPATH": str(ROOT)}  # fmt: skip
    done = subprocess.run([sys.executable, str(MNIST)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=150)  # fmt: skip
    last = done.stderr.strip().splitlines()[-1]
    final = len(MNIST.read_text().splitlines())  # the script's last line: model.model_code
    assert done.returncode == 1, done.stderr[-3000:]
    assert f"line {final}, in <module>\n    model.model_code" in done.stderr, done.stderr[-3000:]
    assert last.startswith("AttributeError: NNHandler.model_code")
    assert "NNHandler.load(path)" in last
    assert "plot not shown" in done.stderr  # plot_losses(True) without a display
    models = tmp_path / "notebooks" / "models"
    assert sorted(p.name for p in models.glob("*.pth")) == ["model_epoch_05.pth"]  # overwrite
    log = (models / "training.log").read_text()
    assert [f"epoch {e}/5:" in log for e in range(1, 6)] == [True] * 5
    state = load_checkpoint(models / "model_epoch_05.pth")
    assert state["model_class"] == "__main__:Net" and state["model_kwargs"] == {}
    val = state["history"]["val_losses"]
    assert len(val) == 5 and val[-1] < val[0] / 4  # it learned


def test_original_constructor_options_never_reach_the_model(tmp_path, capsys):
    path = tmp_path / "logs" / "run.log"
    h = NNHandler(Recorder, device="cpu", model_type="regression", logger_mode=LoggingMode.BOTH,
                  logger_filename=str(path), logger_level=logging.INFO, save_model_code=False,
                  ddp_kwargs=None, use_distributed=False, hidden=3)  # fmt: skip
    assert Recorder.built_with == {"hidden": 3}
    h.log_fn("hello")
    assert "hello" in path.read_text() and "hello" in capsys.readouterr().out
    refused = {
        "model_type": (ModelType.GENERATIVE, "batches \\(x, x\\)"),
        "save_model_code": (True, "NNHandler.load\\(path\\) builds it again"),
        "logger_mode": ("syslog", "logger_mode must be a LoggingMode or one of 'console'"),
    }
    for name, (value, message) in refused.items():
        with pytest.raises(ValueError, match=message):
            NNHandler(Recorder, device="cpu", use_distributed=False, **{name: value})


def test_load_as_the_original_guide_writes_it(tmp_path):
    h = trainable(NNHandler(Net, device="cpu", use_distributed=False, dropout=0.0))
    h.train(1)
    h.save(tmp_path / "a.pt")
    for loaded in (NNHandler.load(tmp_path / "a.pt"), NNHandler.load(tmp_path / "a.pt", "cpu"),
                   NNHandler.load(tmp_path / "a.pt", device=torch.device("cpu")),
                   NNHandler.load(tmp_path / "a.pt", Net, dropout=0.0)):  # fmt: skip
        assert isinstance(loaded.module, Net) and loaded.epoch == 1
        assert all(torch.equal(a, b) for a, b in zip(loaded.module.parameters(),
                                                     h.module.parameters()))  # fmt: skip
    other = trainable(NNHandler(Net, device="cpu", use_distributed=False, dropout=0.0))
    assert other.load(tmp_path / "a.pt") is other and other.epoch == 1  # into this handler
    built = NNHandler(Net(dropout=0.0), device="cpu", use_distributed=False)
    built.save(tmp_path / "built.pt")
    with pytest.raises(ValueError, match="records a built model.*NNHandler.load\\("):
        NNHandler.load(tmp_path / "built.pt")
    state = load_checkpoint(tmp_path / "a.pt")
    torch.save({**state, "model_class": "not_imported_anywhere:Net"}, tmp_path / "b.pt")
    with pytest.raises(ValueError, match="not imported in this process: import not_imported_"):
        NNHandler.load(tmp_path / "b.pt", "cpu")


def test_mode_switches_and_call():
    h = NNHandler(Net, device="cpu", use_distributed=False)
    assert h.eval() is h and not h.module.training
    assert h.train() is h and h.module.training
    h.train(False)
    assert not h.module.training
    h.eval(activate=False)
    assert h.module.training
    x = torch.randn(3, 4)
    with torch.no_grad():
        assert torch.equal(h.eval()(x), h.module(x))
    with pytest.raises(ValueError, match="train needs epochs"):
        h.train(max_steps=3)


def test_plots_as_the_original_calls_them(tmp_path):
    h = trainable(NNHandler(Net, device="cpu", use_distributed=False))
    h.train(2)
    with pytest.warns(RuntimeWarning, match="plot not shown: .*'agg' has no display"):
        h.plot_losses(True)  # the original: log_y_scale=True, shown
    h.plot_losses(save_path=tmp_path / "a" / "loss.png")
    h.plot_metrics(False, save_path=tmp_path / "metrics.png")  # no metric: nothing
    assert (tmp_path / "a" / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert not (tmp_path / "metrics.png").exists()


def test_auto_save_every_interval_and_the_last_epoch(tmp_path):
    h = trainable(NNHandler(Net, device="cpu", use_distributed=False))
    h.auto_save(2, tmp_path, "m_{epoch}_{val_loss:.3f}")
    h.train(5)
    saved = sorted(p.name for p in tmp_path.glob("*.pth"))
    assert [name.split("_")[1] for name in saved] == ["2", "4", "5"]
    assert load_checkpoint(tmp_path / saved[-1])["epoch"] == 5
    h.auto_save(1, tmp_path / "o", "last", overwrite=True)
    h.train(7)
    assert [p.name for p in (tmp_path / "o").glob("*.pth")] == ["last.pth"]
    h.auto_save(1, tmp_path, "{nope}")
    with pytest.raises(ValueError, match="auto_save name '\\{nope\\}' cannot be filled"):
        h.train(8)


def test_loader_arguments_of_the_original():
    h = NNHandler(Net, device="cpu", use_distributed=False)
    h.set_train_loader(data(8), batch_size=4, shuffle=False, num_workers=0)
    assert not h.train_loader.sampler.shuffle
    h.set_val_loader(data(8), batch_size=4, shuffle=True, num_workers=0)
    assert h.val_loader.sampler.shuffle
    h.set_train_loader(data(8), batch_size=4, num_workers=0,
                       dataloader_type=DataLoaderType.RANK_CACHED)  # fmt: skip
    assert isinstance(h.train_loader.dataset, RankCache)


def test_streaming_shuffle_is_the_datasets(tar_shards):
    h = NNHandler(Net, device="cpu", use_distributed=False)
    with pytest.raises(ValueError, match="ShardedStreamingDataset\\(..., shuffle=\\)"):
        h.set_train_loader(ShardedStreamingDataset(tar_shards([4])), batch_size=2, shuffle=True)


def test_original_names_without_a_counterpart_say_what_replaces_them():
    h = NNHandler(Net, device="cpu", use_distributed=False)
    with pytest.raises(AttributeError, match="compile_model .* handler.train\\(epochs, compile"):
        h.compile_model()
    with pytest.raises(AttributeError, match="object has no attribute 'no_such_thing'"):
        h.no_such_thing  # noqa: B018
    with pytest.raises(ValueError, match="SDE sample\\(shape, steps\\) is not in nnh"):
        h.sample((16, 1, 28, 28), 100)
    assert h.train_metrics_history is h.train_metrics
    assert h.count_parameters() == sum(p.numel() for p in h.module.parameters())
    h.seed = 7
    first = torch.rand(2)
    h.seed = 7
    assert torch.equal(first, torch.rand(2)) and h.seed == 7


def test_names_importable_where_the_original_documents_put_them():
    from nnh_train.ddp_decorators import (  # the DDP utilities document
        ParallelExecutor,
        parallel_on_all_devices,
        parallelize_on_gpus,
    )
    from nnh_train.ddp_init import _should_use_distributed

    assert callable(ParallelExecutor) and callable(parallelize_on_gpus)
    assert callable(parallel_on_all_devices)
    assert _should_use_distributed(use_distributed_flag=False) is False
    assert NNHandler.ModelType is ModelType and NNHandler.LoggingMode is LoggingMode


def test_original_train_options_are_honoured_or_refused_by_name():
    h = trainable(NNHandler(Net, device="cpu", use_distributed=False))
    with pytest.warns(UserWarning, match="use_amp=True needs CUDA"):
        h.train(1, validate_every=1, use_amp=True, seed=3, progress_bar=True)
    with pytest.raises(ValueError, match="gradient_clipping_norm=1.0.*does not clip"):
        h.train(2, gradient_clipping_norm=1.0)
    with pytest.raises(ValueError, match="progress_bar=False.*TQDM_DISABLE=1"):
        h.train(2, progress_bar=False)
    with pytest.raises(TypeError, match="unexpected keyword arguments \\['epoch_count'\\]"):
        h.train(2, epoch_count=3)
    assert h.epoch == 1
