"""Lightning's own demo LSTM language model (``lightning.pytorch.demos.lstm``: ``LightningLSTM``,
its truncated-BPTT hidden state and ``SequenceSampler``, as shipped in the ``lightning`` wheel)
trained by a ``Trainer`` with accelerator ``auto`` (the GPU when there is one).

``python lightning_lstm.py DATA_DIR`` (``DATA_DIR/wikitext-2.txt``; nothing is downloaded)."""

import sys
from pathlib import Path

import lightning as L
from lightning.pytorch.demos import WikiText2
from lightning.pytorch.demos.lstm import LightningLSTM, SequenceSampler
from torch.utils.data import DataLoader

DATA = Path(sys.argv[1])


class LocalData(LightningLSTM):
    def prepare_data(self) -> None:  # the demo's own downloads WikiText-2; the data is local here
        pass

    def train_dataloader(self) -> DataLoader:  # the demo's loader, over the local file
        dataset = WikiText2(data_dir=DATA, download=False)
        return DataLoader(dataset, batch_sampler=SequenceSampler(dataset, batch_size=20))


model = LocalData(vocab_size=WikiText2(data_dir=DATA, download=False).vocab_size)
trainer = L.Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False)
trainer.fit(model)
