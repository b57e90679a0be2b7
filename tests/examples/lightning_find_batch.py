"""A Lightning script that finds its batch size with Lightning's tuner (power scaling): the
batch doubles until CUDA runs out of memory, then the run trains with the largest that fit.

    python tests/examples/lightning_find_batch.py [--width 1024] [--tokens 2048] [--mode power] [--init 2]
"""

import argparse

import lightning as L
import torch
from lightning.pytorch.tuner import Tuner
from torch import nn

ap = argparse.ArgumentParser()
ap.add_argument("--width", type=int, default=1024)
ap.add_argument("--tokens", type=int, default=2048)
ap.add_argument("--mode", default="power")
ap.add_argument("--steps", type=int, default=4)
ap.add_argument("--init", type=int, default=2)
args = ap.parse_args()


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 1 << 16

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        return torch.randn(args.width, generator=g), torch.randint(0, 10, (), generator=g)


class Model(L.LightningModule):
    def __init__(self, batch_size: int = 2) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.up = nn.Linear(args.width, 4 * args.width)
        self.down = nn.Linear(4 * args.width, args.width)
        self.head = nn.Linear(args.width, 10)

    def training_step(self, batch, idx):
        x, y = batch
        h = x.unsqueeze(1).expand(-1, args.tokens, -1)  # every sample is a sequence of `tokens` copies
        h = self.down(nn.functional.gelu(self.up(h))).mean(1)
        return nn.functional.cross_entropy(self.head(h), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(Tokens(), batch_size=self.batch_size)


model = Model()
trainer = L.Trainer(max_steps=args.steps, accelerator="gpu" if torch.cuda.is_available() else "cpu", devices=1,
                    logger=False, enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False, default_root_dir=".")
found = Tuner(trainer).scale_batch_size(model, mode=args.mode, init_val=args.init)
print("batch size found:", found)
trainer.fit(model)
