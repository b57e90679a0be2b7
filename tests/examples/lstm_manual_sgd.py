"""An LSTM language model trained with a hand-written SGD update and no optimizer, in the style of
PyTorch's word-language-model example (vramplan's own example, written for its tests).

    python tests/examples/lstm_manual_sgd.py
"""

import math

import torch
from torch import nn


class RNNModel(nn.Module):
    def __init__(self, ntoken: int = 10000, ninp: int = 200, nhid: int = 200, nlayers: int = 2,
                 dropout: float = 0.2) -> None:
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout)  # time-major: [seq, batch]
        self.decoder = nn.Linear(nhid, ntoken)
        self.nhid, self.nlayers, self.ntoken = nhid, nlayers, ntoken

    def forward(self, x: torch.Tensor, hidden: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        output, hidden = self.rnn(self.drop(self.encoder(x)), hidden)
        decoded = self.decoder(self.drop(output)).view(-1, self.ntoken)
        return torch.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz: int) -> tuple[torch.Tensor, torch.Tensor]:
        weight = next(self.parameters())
        return weight.new_zeros(self.nlayers, bsz, self.nhid), weight.new_zeros(self.nlayers, bsz, self.nhid)


def batchify(data: torch.Tensor, bsz: int, device: torch.device) -> torch.Tensor:
    n = data.size(0) // bsz
    return data.narrow(0, 0, n * bsz).view(bsz, -1).t().contiguous().to(device)


def repackage_hidden(h: object) -> object:
    return h.detach() if isinstance(h, torch.Tensor) else tuple(repackage_hidden(v) for v in h)  # type: ignore[attr-defined]


def main() -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    train_data = batchify(torch.randint(0, 10000, (20000,)), 20, device)
    model = RNNModel().to(device)
    criterion = nn.NLLLoss()
    lr, bptt, total_loss = 20.0, 35, 0.0
    model.train()
    hidden = model.init_hidden(20)
    for batch, i in enumerate(range(0, train_data.size(0) - 1, bptt)):
        seq_len = min(bptt, len(train_data) - 1 - i)
        inputs, target = train_data[i:i + seq_len], train_data[i + 1:i + 1 + seq_len].view(-1)
        model.zero_grad()
        hidden = repackage_hidden(hidden)
        output, hidden = model(inputs, hidden)
        loss = criterion(output, target)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr)
        total_loss += loss.item()
        if batch % 10 == 0:
            print(f"batch {batch} loss {total_loss:.2f} ppl {math.exp(min(total_loss / 10, 20)):8.2f}")


if __name__ == "__main__":
    main()
