"""Plain PyTorch's ``(image, label)`` batches: ``model_input_format="input_target"`` feeds
``model(image)`` and ``loss_func(batch, output)``; a CNN trains through auto_accelerate on 2 gloo
ranks as it does serially, its forward unchanged."""

import pytest
import torch
from torch import nn

from atorch.auto import auto_accelerate, run_model
from atorch.errors import AtorchConfigError
from tests.helpers.dist import run_distributed
from tests.helpers.models import global_mean

STEPS, BATCH, LR = 3, 8, 0.1


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(4 * 4 * 4, 3))


def images() -> torch.utils.data.TensorDataset:
    gen = torch.Generator().manual_seed(3)
    return torch.utils.data.TensorDataset(torch.randn(64, 1, 8, 8, generator=gen), torch.randint(0, 3, (64,), generator=gen))


def loss_func(batch, output):
    return nn.functional.cross_entropy(output, batch[1])


def _serial() -> list[float]:
    model = cnn()
    optim = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for _, (x, y) in zip(range(STEPS), torch.utils.data.DataLoader(images(), batch_size=BATCH)):
        loss = loss_func((x, y), model(x))
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def _accelerated(load_strategy) -> dict:
    status, result, _ = auto_accelerate(cnn(), torch.optim.SGD, images(), loss_func, optim_args={"lr": LR},
                                        dataloader_args={"batch_size": BATCH}, model_input_format="input_target",
                                        load_strategy=load_strategy)
    losses = []
    for _, batch in zip(range(STEPS), result.dataloader):
        loss = result.loss_func(batch, run_model(result.model, batch, "input_target"))
        result.backward(loss)
        result.step()
        losses.append(global_mean(loss.detach()))
    return {"status": status, "losses": losses}


def _both() -> dict:
    return {name: _accelerated(strategy) for name, strategy in
            (("ddp", ["parallel_mode"]), ("zero1", ["parallel_mode", "zero1"]))}


def test_image_label_batches_train_a_cnn_as_serial_on_2_ranks():
    reference = _serial()
    for rank, runs in enumerate(run_distributed(_both, 2)):
        for name, run in runs.items():
            assert run["status"], (rank, name)
            for got, want in zip(run["losses"], reference):
                assert abs(got - want) <= 1e-5 * abs(want), (rank, name, run["losses"], reference)


def test_formats_are_checked_before_anything_is_built():
    with pytest.raises(AtorchConfigError, match="'input_target' model\\(batch\\[0\\]\\)"):
        auto_accelerate(cnn(), torch.optim.SGD, images(), loss_func, model_input_format="input_targets")
    with pytest.raises(AtorchConfigError, match="takes \\(input, target\\) batches"):
        run_model(cnn(), {"image": torch.zeros(1, 1, 8, 8)}, "input_target")
    assert run_model(cnn(), (torch.zeros(2, 1, 8, 8), torch.zeros(2)), "input_target").shape == (2, 3)
