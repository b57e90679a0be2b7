"""Lightning's demo ``Transformer`` and ``WikiText2`` (``lightning.pytorch.demos``, as shipped in
the ``lightning`` wheel) trained with ``lightning.Fabric``: ``setup``, ``setup_dataloaders``,
``fabric.backward``, ``fabric.clip_gradients``; the device is Fabric's ``auto`` choice.

``python lightning_fabric.py DATA_DIR`` (``DATA_DIR/wikitext-2.txt``; nothing is downloaded)."""

import sys
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.demos import Transformer, WikiText2
from torch.utils.data import DataLoader

fabric = L.Fabric()
fabric.seed_everything(42)
dataset = WikiText2(data_dir=Path(sys.argv[1]), download=False)
with fabric.init_module():
    model = Transformer(vocab_size=dataset.vocab_size)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = fabric.setup(model, optimizer)
loader = fabric.setup_dataloaders(DataLoader(dataset, batch_size=20, shuffle=True))
model.train()
for inputs, target in loader:
    output = model(inputs, target)
    loss = F.nll_loss(output, target.view(-1))
    fabric.backward(loss)
    fabric.clip_gradients(model, optimizer, clip_val=0.25)
    optimizer.step()
    optimizer.zero_grad()
