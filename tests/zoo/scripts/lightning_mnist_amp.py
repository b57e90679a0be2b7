"""Lightning's demo MNIST classifier (``lightning.pytorch.demos``: the convolutional ``Net`` and the
``_MNIST`` dataset, as shipped in the ``lightning`` wheel) trained with ``lightning.Fabric`` in
``16-mixed`` precision: fp16 autocast and a ``GradScaler`` on the GPU (``fabric.backward`` scales the
loss, the optimizer step unscales and skips non-finite steps). Fabric's own CPU rule turns
``16-mixed`` into ``bf16-mixed`` there, without a scaler.

``python lightning_mnist_amp.py DATA_DIR`` (``DATA_DIR/MNIST/complete/{training,test}.pt``; nothing is
downloaded)."""

import sys

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.demos.boring_classes import Net
from lightning.pytorch.demos.mnist_datamodule import _MNIST
from torch.utils.data import DataLoader

fabric = L.Fabric(precision="16-mixed")
fabric.seed_everything(42)
dataset = _MNIST(sys.argv[1], train=True, download=False)
model = Net()
optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
model, optimizer = fabric.setup(model, optimizer)
loader = fabric.setup_dataloaders(DataLoader(dataset, batch_size=64, shuffle=True))
model.train()
for data, target in loader:
    optimizer.zero_grad()
    loss = F.nll_loss(model(data), target)
    fabric.backward(loss)
    optimizer.step()
