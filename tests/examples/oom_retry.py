"""A loop that finds its batch size by running out of memory (accelerate's find_executable_batch_size).

    python tests/examples/oom_retry.py [--start 1048576] [--width 8192]
"""

import argparse

import torch
from accelerate.utils import find_executable_batch_size
from torch import nn


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--start", type=int, default=1 << 20)
    ap.add_argument("--width", type=int, default=8192)
    args = ap.parse_args()
    model = nn.Sequential(nn.Linear(args.width, args.width), nn.GELU(), nn.Linear(args.width, args.width)).cuda()
    opt = torch.optim.AdamW(model.parameters())

    @find_executable_batch_size(starting_batch_size=args.start)
    def train(batch_size: int) -> None:
        print("trying batch", batch_size)
        for _ in range(2):
            model(torch.randn(batch_size, args.width, device="cuda")).sum().backward()
            opt.step()
            opt.zero_grad()
        print("ran batch", batch_size)

    train()


if __name__ == "__main__":
    main()
