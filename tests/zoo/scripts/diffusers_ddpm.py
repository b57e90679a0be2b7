"""diffusers' own DDPM pipeline (``DDPMPipeline`` over a ``UNet2DModel`` and a ``DDPMScheduler``,
as the diffusers package ships them) sampling images with a seeded generator on the device, the
way diffusers' docs run a pipeline: ``.to(device)``, ``generator=torch.Generator(device)``. A small
UNet (32 × 32 images, two resolutions, attention in the lower one), built here: nothing is
downloaded.

``python diffusers_ddpm.py``"""

import torch
from diffusers import DDPMPipeline, DDPMScheduler, UNet2DModel

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
unet = UNet2DModel(sample_size=32, in_channels=3, out_channels=3, layers_per_block=1, block_out_channels=(32, 64),
                   down_block_types=("DownBlock2D", "AttnDownBlock2D"), up_block_types=("AttnUpBlock2D", "UpBlock2D"))
pipe = DDPMPipeline(unet=unet, scheduler=DDPMScheduler(num_train_timesteps=100)).to(device)
images = pipe(batch_size=2, generator=torch.Generator(device).manual_seed(0), num_inference_steps=3,
              output_type="np").images
print(images.shape)
