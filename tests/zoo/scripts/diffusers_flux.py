"""diffusers' own Flux pipeline (``FluxPipeline``: the CLIP and T5 text encoders, the
``FluxTransformer2DModel`` denoiser over packed 2 × 2 latent patches, the flow-matching Euler
scheduler, and the ``AutoencoderKL`` decode that turns latents into pixels), run the way
diffusers' docs run it: ``.to(device)``, a seeded generator, ``num_inference_steps``. The models
are Flux's architectures at a small width (16 latent channels, an 8 × downsampling VAE), built
here with word-level tokenizers: nothing is downloaded.

``python diffusers_flux.py [--size 256] [--steps 3] [--vae-tiling] [--offload model|sequential]``
(``--offload``: diffusers' ``enable_model_cpu_offload`` / ``enable_sequential_cpu_offload`` on a
GPU; on the CPU the pipeline runs in place)."""

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
ap.add_argument("--size", type=int, default=256)
ap.add_argument("--steps", type=int, default=3)
ap.add_argument("--vae-tiling", action="store_true")
ap.add_argument("--offload", choices=("model", "sequential"))
args = ap.parse_args()
device = "cuda" if torch.cuda.is_available() else "cpu"


def tokenizer(max_length: int) -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": i + 3 for i in range(300)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
                                   model_max_length=max_length)


torch.manual_seed(0)
clip = CLIPTextModel(CLIPTextConfig(vocab_size=303, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=2, max_position_embeddings=77, projection_dim=32,
                                    pad_token_id=0, bos_token_id=2, eos_token_id=1))
t5 = T5EncoderModel(T5Config(vocab_size=303, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                             pad_token_id=0, eos_token_id=1))
transformer = FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=1, num_single_layers=2,
                                     attention_head_dim=16, num_attention_heads=4, joint_attention_dim=64,
                                     pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=(4, 6, 6))
vae = AutoencoderKL(sample_size=128, in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(16, 32, 32, 32),
                    down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                    layers_per_block=1, norm_num_groups=8, use_quant_conv=False, use_post_quant_conv=False,
                    shift_factor=0.1159, scaling_factor=0.3611)
pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True),
                    vae=vae, text_encoder=clip, tokenizer=tokenizer(77), text_encoder_2=t5, tokenizer_2=tokenizer(512),
                    transformer=transformer)
if args.offload and device == "cuda":  # accelerate's hooks move each model (or layer) in for its call
    pipe.enable_model_cpu_offload() if args.offload == "model" else pipe.enable_sequential_cpu_offload()
else:
    pipe.to(device)
pipe.set_progress_bar_config(disable=True)
if args.vae_tiling:
    pipe.vae.enable_tiling()  # tiles of the config's sample_size (128 pixels, 16 latents), overlapping by 1/4
image = pipe("w1 w2 w3 w4 w5", height=args.size, width=args.size, num_inference_steps=args.steps, guidance_scale=3.5,
             max_sequence_length=64, generator=torch.Generator(device).manual_seed(0), output_type="pt").images
print(image.shape)
