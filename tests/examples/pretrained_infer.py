"""Inference with a catalog model loaded by from_pretrained (vramplan run builds it from its
config without reading weights): python tests/examples/pretrained_infer.py [MODEL] [BATCH] [SEQ]"""

import sys

import torch
from transformers import AutoModelForCausalLM

name = sys.argv[1] if len(sys.argv) > 1 else "Qwen/Qwen2.5-0.5B"
batch, seq = (int(sys.argv[2]), int(sys.argv[3])) if len(sys.argv) > 3 else (2, 256)
model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16, device_map="cuda")
ids = torch.randint(0, model.config.vocab_size, (batch, seq), device="cuda")
with torch.inference_mode():
    for _ in range(3):
        shape = model(input_ids=ids).logits.shape  # the output is dropped at once
print(shape)
