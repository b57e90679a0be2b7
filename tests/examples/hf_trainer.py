"""An HF Trainer fine-tuning script (a small Llama built from its config; no download).

    python tests/examples/hf_trainer.py [--batch 4] [--seq 128] [--bf16] [--steps 5]
"""

import argparse
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seq: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--hidden", type=int, default=256)
    args = ap.parse_args()
    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, vocab_size=4096,
                         max_position_embeddings=1024)
    model = LlamaForCausalLM(config)
    with tempfile.TemporaryDirectory() as out:
        targs = TrainingArguments(
            output_dir=out, per_device_train_batch_size=args.batch, max_steps=args.steps, bf16=args.bf16,
            learning_rate=1e-4, report_to=[], save_strategy="no", logging_steps=1, dataloader_num_workers=0,
            use_cpu=not torch.cuda.is_available(),
        )
        Trainer(model=model, args=targs, train_dataset=Tokens(64, args.seq, config.vocab_size)).train()


if __name__ == "__main__":
    main()
