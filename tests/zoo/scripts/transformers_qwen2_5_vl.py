"""A vision-language model as transformers ships it (``Qwen2_5_VLForConditionalGeneration``: the
vision tower with windowed attention, its patch merger, the language model with multimodal RoPE),
fed as its model card feeds it: a chat template puts one image placeholder per image, the image
processor (``Qwen2VLImageProcessor``: resize to a multiple of 28 pixels, 14-pixel patches in pairs
of frames) makes ``pixel_values`` and ``image_grid_thw``, and each placeholder becomes one
``<|image_pad|>`` per merged 2 × 2 patch group — so the sequence length follows the images'
resolution. That last step is ``Qwen2_5_VLProcessor.__call__``'s, done here by hand: the processor
class also builds a video processor, which needs torchvision. A small model and a word-level
tokenizer, built here: nothing is downloaded.

``python transformers_qwen2_5_vl.py train [--lora | --freeze-vision]`` — AdamW steps on image-text pairs
of two images at different resolutions (``--lora``: peft LoRA on the language model's attention
projections, everything else frozen; ``--freeze-vision``: the vision tower frozen);
``python transformers_qwen2_5_vl.py generate`` — greedy ``generate`` of 16 tokens for two images."""

import argparse

import numpy as np
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    BatchFeature,
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLImageProcessor,
)

ap = argparse.ArgumentParser()
ap.add_argument("mode", choices=("train", "generate"))
ap.add_argument("--lora", action="store_true")
ap.add_argument("--freeze-vision", action="store_true")
ap.add_argument("--steps", type=int, default=3)
args = ap.parse_args()
device = "cuda" if torch.cuda.is_available() else "cpu"

special = ["<pad>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
words = [f"w{i}" for i in range(400)]
vocab = {t: i for i, t in enumerate(special + ["user", "assistant"] + words)}
backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
backend.pre_tokenizer = pre_tokenizers.Split(r"<\|[a-z_]+\|>|\w+", behavior="isolated")
tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<|im_end|>",
                                    additional_special_tokens=special[1:], padding_side="left")
chat = ("{% for m in messages %}{{ m['role'] }} {% for c in m['content'] %}{% if c['type'] == 'image' %}"
        "<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ c['text'] }}{% endif %} {% endfor %}<|im_end|> "
        "{% endfor %}{% if add_generation_prompt %}assistant {% endif %}")
tokenizer.chat_template = chat
image_processor = Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=224 * 224)

torch.manual_seed(0)
config = Qwen2_5_VLConfig(
    text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=len(vocab), max_position_embeddings=2048,
                     rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}, pad_token_id=0,
                     bos_token_id=None, eos_token_id=vocab["<|im_end|>"]),
    vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                       fullatt_block_indexes=[1]),
    image_token_id=vocab["<|image_pad|>"], video_token_id=vocab["<|video_pad|>"],
    vision_start_token_id=vocab["<|vision_start|>"], vision_end_token_id=vocab["<|vision_end|>"])
model = Qwen2_5_VLForConditionalGeneration(config).to(device)

rng = np.random.default_rng(0)


def batch(n: int, answer: bool) -> dict:
    images = [rng.integers(0, 256, (168 + 28 * i, 224, 3), dtype=np.uint8) for i in range(n)]
    convs = []
    for i in range(n):
        conv = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"w{i} w{i + 1} w7"}]}]
        if answer:
            conv.append({"role": "assistant", "content": [{"type": "text", "text": " ".join(f"w{k}" for k in range(12))}]})
        convs.append(tokenizer.apply_chat_template(conv, add_generation_prompt=not answer, tokenize=False))
    pixels = image_processor(images=images, return_tensors="pt")
    # Qwen2_5_VLProcessor.__call__'s expansion: one <|image_pad|> per merged patch of each image
    merge = image_processor.merge_size ** 2
    for i, thw in enumerate(pixels["image_grid_thw"]):
        convs[i] = convs[i].replace("<|image_pad|>", "<|image_pad|>" * (int(thw.prod()) // merge), 1)
    return BatchFeature({**tokenizer(convs, return_tensors="pt", padding=True), **pixels})


if args.mode == "train":
    if args.lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=r".*language_model.*\.(q|k|v|o)_proj"))
    elif args.freeze_vision:
        model.model.visual.requires_grad_(False)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    for step in range(args.steps):
        inputs = batch(2, answer=True).to(device)
        labels = inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)
        loss = model(**inputs, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        print(f"step {step}: {inputs['input_ids'].shape[1]} tokens, loss {loss.item():.3f}")
else:
    model.eval()
    inputs = batch(2, answer=False).to(device)
    out = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    print(tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1]:]))
