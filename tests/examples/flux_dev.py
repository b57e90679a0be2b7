"""FLUX.1-dev text-to-image at its published size, as diffusers' docs run it: ``FluxPipeline`` in
bf16, moved to the GPU whole, or under ``enable_model_cpu_offload`` / ``enable_sequential_cpu_offload``.
For ``vramplan run`` (the weights are never read: nothing is downloaded, and the host copies hold no
RAM there); on a real GPU it runs with random weights.

The models are built from their published configs: the transformer and VAE from
black-forest-labs/FLUX.1-dev ``transformer/config.json`` and ``vae/config.json`` (as vendored
verbatim in lllyasviel/stable-diffusion-webui-forge at 2d30eeed,
``backend/huggingface/black-forest-labs/FLUX.1-dev``), the T5 v1.1 XXL encoder from the config
kohya-ss/sd-scripts quotes for FLUX's ``text_encoder_2``, and CLIP ViT-L/14's text encoder. The
tokenizers are word-level stand-ins: the encoders pad every prompt to their full length (77 and
512 tokens), so the prompt's words do not change memory.

``python flux_dev.py [--size 1024] [--steps 2] [--offload model|sequential] [--vae-tiling]``"""

import argparse

import torch
from diffusers import (
    AutoencoderKL,
    FlowMatchEulerDiscreteScheduler,
    FluxPipeline,
    FluxTransformer2DModel,
)
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    PreTrainedTokenizerFast,
    T5Config,
    T5EncoderModel,
)

ap = argparse.ArgumentParser()
ap.add_argument("--size", type=int, default=1024)
ap.add_argument("--steps", type=int, default=2)
ap.add_argument("--offload", choices=("model", "sequential"))
ap.add_argument("--vae-tiling", action="store_true")
args = ap.parse_args()

TRANSFORMER = {"attention_head_dim": 128, "guidance_embeds": True, "in_channels": 64, "joint_attention_dim": 4096,
               "num_attention_heads": 24, "num_layers": 19, "num_single_layers": 38, "patch_size": 1,
               "pooled_projection_dim": 768}
VAE = {"act_fn": "silu", "block_out_channels": [128, 256, 512, 512],
       "down_block_types": ["DownEncoderBlock2D"] * 4, "force_upcast": True, "in_channels": 3, "latent_channels": 16,
       "latents_mean": None, "latents_std": None, "layers_per_block": 2, "mid_block_add_attention": True,
       "norm_num_groups": 32, "out_channels": 3, "sample_size": 1024, "scaling_factor": 0.3611,
       "shift_factor": 0.1159, "up_block_types": ["UpDecoderBlock2D"] * 4, "use_post_quant_conv": False,
       "use_quant_conv": False}
T5_XXL = {"vocab_size": 32128, "d_model": 4096, "d_kv": 64, "d_ff": 10240, "num_layers": 24, "num_heads": 64,
          "feed_forward_proj": "gated-gelu", "dense_act_fn": "gelu_new", "is_gated_act": True, "pad_token_id": 0,
          "eos_token_id": 1, "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128}
CLIP_L = {"vocab_size": 49408, "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
          "num_attention_heads": 12, "max_position_embeddings": 77, "projection_dim": 768, "hidden_act": "quick_gelu",
          "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2}


def tokenizer(max_length: int) -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{f"w{i}": i + 3 for i in range(300)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                                   model_max_length=max_length)


dtype = torch.bfloat16
pipe = FluxPipeline(
    scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True),
    vae=AutoencoderKL.from_config(VAE).to(dtype), transformer=FluxTransformer2DModel.from_config(TRANSFORMER).to(dtype),
    text_encoder=CLIPTextModel(CLIPTextConfig(**CLIP_L)).to(dtype), tokenizer=tokenizer(77),
    text_encoder_2=T5EncoderModel(T5Config(**T5_XXL)).to(dtype), tokenizer_2=tokenizer(512))
if args.offload == "model":
    pipe.enable_model_cpu_offload()
elif args.offload == "sequential":
    pipe.enable_sequential_cpu_offload()
else:
    pipe.to("cuda")
if args.vae_tiling:
    pipe.vae.enable_tiling()
pipe.set_progress_bar_config(disable=True)
image = pipe("w1 w2 w3", height=args.size, width=args.size, num_inference_steps=args.steps, guidance_scale=3.5,
             generator=torch.Generator("cuda").manual_seed(0), output_type="pt").images
print(tuple(image.shape))
