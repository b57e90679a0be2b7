"""A TRL SFTTrainer script: a small Llama from its config, a word-level tokenizer built here, a
tiny text dataset (no download)."""

import argparse
import tempfile

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import SFTConfig, SFTTrainer

ap = argparse.ArgumentParser()
ap.add_argument("--batch", type=int, default=4)
ap.add_argument("--seq", type=int, default=128)
ap.add_argument("--steps", type=int, default=5)
args = ap.parse_args()

words = [f"w{i}" for i in range(1000)]
vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(words)}}
tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.Whitespace()
tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
g = torch.Generator().manual_seed(0)
texts = [" ".join(words[int(i)] for i in torch.randint(0, 1000, (args.seq,), generator=g)) for _ in range(32)]
config = LlamaConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                     num_key_value_heads=4, vocab_size=len(vocab), max_position_embeddings=1024,
                     pad_token_id=0, eos_token_id=1, bos_token_id=1)
with tempfile.TemporaryDirectory() as out:
    cfg = SFTConfig(output_dir=out, per_device_train_batch_size=args.batch, max_steps=args.steps, bf16=True,
                    report_to=[], save_strategy="no", logging_steps=1, max_length=args.seq, packing=False,
                    use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0)
    trainer = SFTTrainer(model=LlamaForCausalLM(config), args=cfg, processing_class=tokenizer,
                         train_dataset=Dataset.from_dict({"text": texts}))
    trainer.train()
