"""Inference with a quantised checkpoint as transformers loads it (vramplan run builds the
quantised layers from the config, reading no weights):
python tests/examples/pretrained_quant.py MODEL {awq,gptq,nf4,int8,ct-w4a16,ct-fp8} [BATCH] [SEQ]"""

import sys

import torch
from transformers import AutoModelForCausalLM, AwqConfig, BitsAndBytesConfig, GPTQConfig

name, method = sys.argv[1], sys.argv[2]
batch, seq = (int(sys.argv[3]), int(sys.argv[4])) if len(sys.argv) > 4 else (1, 512)


def compressed(weights: dict, acts: dict | None) -> dict:  # an llm-compressor checkpoint's config.json entry
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}}}


configs = {
    "awq": AwqConfig(bits=4, group_size=128),
    "gptq": GPTQConfig(bits=4, group_size=128, desc_act=False),
    "nf4": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16),
    "int8": BitsAndBytesConfig(load_in_8bit=True),
    "ct-w4a16": compressed({"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128},
                           None),
    "ct-fp8": compressed({"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"},
                         {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True}),
}
model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16, device_map="cuda",
                                             quantization_config=configs[method])
ids = torch.randint(0, model.config.vocab_size, (batch, seq), device="cuda")
with torch.inference_mode():
    for _ in range(3):
        shape = model(input_ids=ids).logits.shape
print(shape)
