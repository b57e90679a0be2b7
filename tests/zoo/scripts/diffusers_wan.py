"""diffusers' own Wan 2.1 text-to-video pipeline (``WanPipeline``: the UMT5 text encoder, the
``WanTransformer3DModel`` denoiser over 1 × 2 × 2 patches of a video's latents, classifier-free
guidance, and the causal 3-D ``AutoencoderKLWan`` decode, frame chunk by frame chunk with its
feature cache), run as diffusers' docs run it: ``.to(device)``, a seeded generator. The models are
Wan's architectures at a small width (16 latent channels, 4 × temporal and 8 × spatial
compression), built here with a word-level tokenizer: nothing is downloaded.

``python diffusers_wan.py [--frames 9] [--size 128] [--steps 2]``"""

import argparse

import torch
from diffusers import (
                                           AutoencoderKLWan,
                                           FlowMatchEulerDiscreteScheduler,
                                           WanPipeline,
                                           WanTransformer3DModel,
)
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, UMT5Config, UMT5EncoderModel

ap = argparse.ArgumentParser()
ap.add_argument("--frames", type=int, default=9)
ap.add_argument("--size", type=int, default=128)
ap.add_argument("--steps", type=int, default=2)
args = ap.parse_args()
device = "cuda" if torch.cuda.is_available() else "cpu"

vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{f"w{i}": i + 3 for i in range(300)}}
backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
backend.pre_tokenizer = pre_tokenizers.Whitespace()
tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")

torch.manual_seed(0)
text_encoder = UMT5EncoderModel(UMT5Config(vocab_size=303, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                                           pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))
transformer = WanTransformer3DModel(num_attention_heads=4, attention_head_dim=16, in_channels=16, out_channels=16,
                                    text_dim=64, freq_dim=32, ffn_dim=128, num_layers=2, rope_max_seq_len=256)
vae = AutoencoderKLWan(base_dim=16, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=1,
                       temperal_downsample=[False, True, True])
pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer,
                   scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0)).to(device)
pipe.set_progress_bar_config(disable=True)
video = pipe("w1 w2 w3 w4", negative_prompt="w9 w8", height=args.size, width=args.size, num_frames=args.frames,
             num_inference_steps=args.steps, guidance_scale=5.0, max_sequence_length=64,
             generator=torch.Generator(device).manual_seed(0), output_type="pt").frames
print(video.shape)
