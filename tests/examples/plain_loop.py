"""A plain PyTorch training loop, as a user writes it for a GPU (used by vramplan's tests).

    python tests/examples/plain_loop.py [--batch 8] [--steps 5] [--device cuda]
"""

import argparse

import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, d: int = 256, layers: int = 4, classes: int = 10) -> None:
        super().__init__()
        self.body = nn.Sequential(*[nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
                                    for _ in range(layers)])
        self.head = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--amp", action="store_true")
    ap.add_argument("--foreach", action="store_true", help="foreach AdamW (the CUDA default) on any device")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("this script needs a GPU")
    torch.manual_seed(0)
    model = Net(args.dim).to(args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True if args.foreach else None)
    loss_fn = nn.CrossEntropyLoss()
    for step in range(args.steps):
        x = torch.randn(args.batch, args.dim).to(args.device)  # a batch from the host, as a loader gives
        y = torch.randint(0, 10, (args.batch,)).to(args.device)
        with torch.autocast(args.device, dtype=torch.bfloat16, enabled=args.amp):
            loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if args.device == "cuda":
            print(f"step {step}: loss {loss.item() if loss.device.type != 'meta' else float('nan'):.3f} "
                  f"max allocated {torch.cuda.max_memory_allocated() / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
