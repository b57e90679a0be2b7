"""Lightning's own demo language model (``lightning.pytorch.demos``: ``LightningTransformer`` over
``WikiText2``, as shipped in the ``lightning`` wheel) trained by a ``Trainer`` the way Lightning's
docs use the demo: accelerator ``auto`` (the GPU when there is one), gradient clipping.

``python lightning_trainer.py DATA_DIR`` (``DATA_DIR/wikitext-2.txt``; nothing is downloaded)."""

import sys
from pathlib import Path

import lightning as L
from lightning.pytorch.demos import LightningTransformer, WikiText2
from torch.utils.data import DataLoader


class LocalData(LightningTransformer):
    def prepare_data(self) -> None:  # the demo's own downloads WikiText-2; the data is local here
        pass


dataset = WikiText2(data_dir=Path(sys.argv[1]), download=False)
model = LocalData(vocab_size=dataset.vocab_size)
trainer = L.Trainer(max_epochs=1, gradient_clip_val=0.25, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False)
trainer.fit(model, train_dataloaders=DataLoader(dataset, batch_size=20, shuffle=True))
