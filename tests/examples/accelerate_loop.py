"""An accelerate training loop (bf16 mixed precision) on a small Llama built from its config."""

import argparse

import torch
from accelerate import Accelerator
from transformers import LlamaConfig, LlamaForCausalLM

ap = argparse.ArgumentParser()
ap.add_argument("--batch", type=int, default=4)
ap.add_argument("--seq", type=int, default=128)
ap.add_argument("--steps", type=int, default=5)
args = ap.parse_args()

config = LlamaConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                     num_key_value_heads=4, vocab_size=4096, max_position_embeddings=1024)
accelerator = Accelerator(mixed_precision="bf16" if torch.cuda.is_available() else "no")
model = LlamaForCausalLM(config)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
ids = torch.randint(0, config.vocab_size, (8 * args.batch, args.seq))
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=args.batch)
model, opt, loader = accelerator.prepare(model, opt, loader)
model.train()
for step, (batch,) in enumerate(loader):
    loss = model(input_ids=batch, labels=batch).loss
    accelerator.backward(loss)
    opt.step()
    opt.zero_grad()
    if step + 1 >= args.steps:
        break
