"""The original NNHandler's basic MNIST example (notebooks/mnist_basic_example.ipynb of
github.com/rouzib/NNHandler), cell by cell, with only its imports and its data source changed:
``from src.nn_handler import ...`` -> ``from nnh_train import ...``, and torchvision's MNIST
(which needs the network and torchvision) -> ``SyntheticMNIST``, the same shapes and types (one
28x28 channel normalised like the notebook's transform, integer labels 0-9). Every other line is
the notebook's; the last cell (``model.model_code``) fails with a message naming the nnh
replacement. tests/nnh_train/test_compat.py runs it.
"""
# ruff: noqa: B018, E402, E501, UP008, UP031 - the notebook's lines as they are

# ----------------------------------------------------------------------------- imports (changed)
import logging

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.utils.data import Dataset

from nnh_train import LoggingMode, ModelType, NNHandler


# ----------------------------------------------------------------------------- data source (new)
class SyntheticMNIST(Dataset):
    """MNIST's shapes without a download: class c is a bright 6x6 square at one of ten places,
    over noise, normalised with MNIST's mean and std as the notebook's transform does."""

    def __init__(self, train: bool) -> None:
        count = 2048 if train else 512
        g = torch.Generator().manual_seed(0 if train else 1)
        self.targets = torch.randint(0, 10, (count,), generator=g)
        images = torch.rand(count, 1, 28, 28, generator=g) * 0.3
        for i, c in enumerate(self.targets.tolist()):
            row, col = 2 + 12 * (c // 5), 2 + 5 * (c % 5)
            images[i, 0, row : row + 6, col : col + 6] = 1.0
        self.data = (images - 0.1307) / 0.3081

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.data[i], int(self.targets[i])


# ----------------------------------------------------------------------------- 1. the network
class Net(nn.Module):
    def __init__(self):
        super(Net, self).__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = x.view(-1, 320)
        x = F.relu(self.fc1(x))
        x = F.dropout(x, training=self.training)
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


# ----------------------------------------------------------------------------- 2. the data
device = torch.device('cuda' if torch.cuda.is_available() else 'cpu')

training_data = SyntheticMNIST(train=True)  # was datasets.MNIST(root=..., train=True, ...)

test_data = SyntheticMNIST(train=False)  # was datasets.MNIST(root=..., train=False, ...)

# ----------------------------------------------------------------------------- 3. the handler
model = NNHandler(Net, model_type=ModelType.CLASSIFICATION, device=device, logger_mode=LoggingMode.FILE, logger_filename="notebooks/models/training.log", logger_level=logging.INFO, save_model_code=False)
model.set_optimizer(optim.Adamax, lr=0.01)
model.set_loss_fn(nn.functional.nll_loss)
model.auto_save(1, "notebooks/models", "model_epoch_{epoch:02d}.pth", overwrite=True)
model.set_train_loader(training_data, batch_size=1024, shuffle=True)
model.set_val_loader(test_data, batch_size=1024, shuffle=False)

# ----------------------------------------------------------------------------- 4. train
model.train(5, validate_every=1)

# ----------------------------------------------------------------------------- 5. load
torch.load("notebooks/models/model_epoch_05.pth", weights_only=False).keys()

device = torch.device('cuda' if torch.cuda.is_available() else 'cpu')
model = NNHandler.load("notebooks/models/model_epoch_05.pth", device)

# ----------------------------------------------------------------------------- 6. plot
model.plot_losses(True)

from matplotlib import pyplot as plt

# Plot n samples from the validation dataset with their predictions
n = 20
test_loader = torch.utils.data.DataLoader(test_data, batch_size=n, shuffle=True)
data_iter = iter(test_loader)
images, labels = data_iter.__next__()

# Get predictions
model.eval()
with torch.no_grad():
    images = images.to(device)
    outputs = model(images)

_, predicted = torch.max(outputs, 1)

plt.figure(figsize=(5, n // 5 * 2))
for index in range(n):
    plt.subplot(n // 5, 5, index + 1)
    plt.axis('off')
    plt.imshow(images[index].cpu().numpy().squeeze(), cmap='gray_r')
    plt.title('%i' % predicted[index])

plt.tight_layout()

model.model_code
