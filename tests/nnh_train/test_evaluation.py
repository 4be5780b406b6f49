"""Scoring (nnh_train/evaluation.py): a batch's figures without its pads, sums over a loader,
predictions with their sample ids, and eval mode restored, in one process."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from nnh_train.evaluation import Scorer, eval_mode, predictions, run_on_rank0
from tests.support import Net, data

CPU = torch.device("cpu")


def mae(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out - y).abs().mean()


def scorer(**metrics) -> Scorer:
    return Scorer(nn.functional.mse_loss, metrics, CPU, nullcontext)


def test_figures_leave_the_pads_out():
    out, y = torch.tensor([[1.0], [2.0], [9.0]]), torch.tensor([[0.0], [0.0], [0.0]])
    pads = torch.tensor([False, False, True])
    value = nn.functional.mse_loss(out, y).double().reshape(1)  # over all three
    got = scorer(mae=mae).figures(value, out, y, pads)
    assert got.dtype == torch.float64 and got.tolist() == [2.5, 1.5]  # over the first two
    assert scorer().figures(value, out, y, None) is value  # no pads, no metrics: as given


@pytest.mark.parametrize("value", [0.5, torch.tensor(0.5), torch.tensor([0.5])])
def test_metric_values_are_float64_whatever_a_metric_returns(value):
    got = scorer(m=lambda out, y: value).metric_values(torch.zeros(1), torch.zeros(1))
    assert got.dtype == torch.float64 and got.tolist() == [0.5]
    assert scorer().metric_values(torch.zeros(1), torch.zeros(1)).shape == (0,)


def test_loader_sums_over_real_samples_of_a_padded_rank():
    # 5 samples on 2 ranks: rank 1 gets samples 1, 3 and a pad (a repeat of 0)
    x, y = data(5).tensors
    sampler = DistributedSampler(TensorDataset(x, y), num_replicas=2, rank=1, shuffle=False)
    loader = DataLoader(TensorDataset(x, y), sampler=sampler, batch_size=2)
    model = Net(dropout=0.5).train()
    sums = scorer(mae=mae).loader_sums(model, loader, epoch=3)
    assert model.training and sampler.epoch == 3
    with torch.no_grad():
        model.eval()
        out, real = model(x[[1, 3]]), y[[1, 3]]
    expected = [nn.functional.mse_loss(out, real).item() * 2, 2.0, mae(out, real).item() * 2]
    assert sums.tolist() == pytest.approx(expected, rel=1e-6)


def test_predictions_in_loader_order_with_their_ids():
    x = torch.randn(7, 4)
    model = Net(dropout=0.5)
    outputs, ids = predictions(model, DataLoader(TensorDataset(x), batch_size=3), CPU,
                               nullcontext, distributed=False)  # fmt: skip
    with torch.no_grad():
        torch.testing.assert_close(outputs, model.eval()(x))
    assert ids.tolist() == list(range(7))


def test_eval_mode_restores_the_mode_even_after_an_error():
    model = nn.Dropout().train()
    with pytest.raises(KeyError), eval_mode(model):
        assert not model.training
        raise KeyError
    assert model.training
    with eval_mode(model.eval()):
        pass
    assert not model.training


def test_run_on_rank0_in_eval_mode_without_gradients():
    model = nn.Dropout().train()
    seen = run_on_rank0(model, lambda m, a, b=0: (m.training, torch.is_grad_enabled(), a + b),
                        (1,), {"b": 2}, distributed=False)  # fmt: skip
    assert seen == (False, False, 3) and model.training
    with pytest.raises(ValueError, match=r"fn must be a function of the module, got \(3, 4\)"):
        run_on_rank0(model, (3, 4), (), {}, distributed=False)
