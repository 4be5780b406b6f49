"""The optimizer step (nnh_train/train_step.py) in one process: precision and its scaler, a
group of batches equal to one batch of its samples, the row it sends, and the optimizer step.
Under DDP (no_sync, the gather, fp16 skips agreeing) it is tested in test_handler_ddp.py."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from torch import nn

from nnh_train.evaluation import Scorer
from nnh_train.preemption import SignalFlag
from nnh_train.train_step import TrainStep

CPU = torch.device("cpu")


def stepper(model: nn.Module) -> TrainStep:
    return TrainStep(model, CPU, distributed=False, world_size=1)


def scorer(**metrics) -> Scorer:
    return Scorer(nn.functional.mse_loss, metrics, CPU, nullcontext)


def test_precision_sets_autocast_and_keeps_one_scaler_across_calls():
    step = stepper(nn.Linear(2, 1))
    step.configure("fp16", compile=False)
    scaler = step.scaler
    step.configure("fp16", compile=False)
    assert isinstance(scaler, torch.amp.GradScaler) and step.scaler is scaler
    step.configure("bf16", compile=False)
    assert step.scaler is None
    with step.autocast():
        assert step.model(torch.ones(1, 2)).dtype == torch.bfloat16
    step.configure("fp32", compile=False)
    assert step.autocast is nullcontext


def grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def test_a_group_is_one_batch_of_its_samples_and_sends_its_row():
    x, y = torch.randn(5, 2), torch.randn(5, 1)
    pads = torch.tensor([False, True])
    torch.manual_seed(0)
    grouped, whole = nn.Linear(2, 1), nn.Linear(2, 1)
    whole.load_state_dict(grouped.state_dict())
    group = [((x[:3], y[:3]), 3, None), ((x[3:], y[3:]), 2, pads)]  # sample 4 is a pad
    signal = SignalFlag()
    signal.received = 10
    rows = stepper(grouped).forward_backward(group, scorer(), signal)()
    nn.functional.mse_loss(whole(x), y).backward()
    for a, b in zip(grads(grouped), grads(whole)):
        torch.testing.assert_close(a, b)
    (trained, loss, count, flag), = rows
    with torch.no_grad():
        real = nn.functional.mse_loss(whole(x[:4]), y[:4]).item()
    assert trained == pytest.approx(nn.functional.mse_loss(whole(x), y).item(), rel=1e-6)
    assert loss == pytest.approx(real, rel=1e-6) and (count, flag) == (4.0, 1.0)


def test_the_optimizer_step_zeroes_gradients_then_steps_the_scheduler():
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model(torch.ones(1, 2)).sum().backward()
    before = model.weight.detach().clone()
    stepper(model).optimizer_step(optimizer, scheduler)
    assert torch.equal(model.weight.detach(), before - 1.0)
    assert model.weight.grad is None and optimizer.param_groups[0]["lr"] == 0.5
    stepper(model).optimizer_step(optimizer, None)
    assert optimizer.param_groups[0]["lr"] == 0.5
