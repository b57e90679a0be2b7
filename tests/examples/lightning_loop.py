"""A Lightning training script (bf16-mixed) on a small MLP."""

import argparse

import lightning as L
import torch
from torch import nn

ap = argparse.ArgumentParser()
ap.add_argument("--batch", type=int, default=64)
ap.add_argument("--steps", type=int, default=5)
args = ap.parse_args()


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256), nn.GELU(), nn.Linear(256, 10))

    def training_step(self, batch, idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


data = torch.utils.data.TensorDataset(torch.randn(8 * args.batch, 256), torch.randint(0, 10, (8 * args.batch,)))
trainer = L.Trainer(max_steps=args.steps, accelerator="gpu" if torch.cuda.is_available() else "cpu", devices=1,
                    precision="bf16-mixed", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False)
trainer.fit(Model(), torch.utils.data.DataLoader(data, batch_size=args.batch))
