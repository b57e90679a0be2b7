"""A diffusers pipeline built from its configs and called once, as diffusers' docs call it: the
script ``vramplan estimate`` runs for a pipeline under ``vramplan run``'s tracer (and that runs as
written on a GPU or, for comparison, on the CPU).

``python pipeline_run.py FOLDER [--size W] [--height H] [--frames F] [--steps N] [--batch B]
[--dtype bf16] [--offload model|sequential] [--vae-tiling]``

FOLDER is a pipeline folder (:mod:`vramplan.models.pipelines`: ``model_index.json`` and each
component's config). The models are built with random weights (under the tracer the host copies
hold no RAM); the pipeline moves to the GPU whole (``pipe.to("cuda")``) or under diffusers'
``enable_model_cpu_offload`` / ``enable_sequential_cpu_offload`` (on the CPU it runs in place);
``--vae-tiling``: ``pipe.vae.enable_tiling()``. A text-to-video pipeline (its call takes
``num_frames``: WanPipeline) makes ``--batch`` videos of ``--frames`` frames (0: its default),
which it rounds as its own code does. Every other argument of the call is the pipeline's default
(FluxPipeline: guidance 3.5, 512 T5 tokens; SDXL: guidance 5.0, so the UNet takes the prompt and
the empty negative prompt together; WanPipeline: guidance 5.0, the transformer called for the
prompt and for the empty negative prompt in turn, 512 UMT5 tokens). The image or video stays on
the device (``output_type="pt"``); nothing is printed."""

from __future__ import annotations

import argparse
import inspect
import sys
from collections.abc import Sequence
from typing import Any

_DTYPES = ("bf16", "fp16", "fp32")


def main(argv: Sequence[str]) -> None:
    import torch

    from vramplan.models.build import quiet
    from vramplan.models.pipelines import build_pipeline, read_pipeline

    ap = argparse.ArgumentParser(prog="pipeline_run.py")
    ap.add_argument("folder")
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--height", type=int, default=0)
    ap.add_argument("--frames", type=int, default=0)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", choices=_DTYPES, default="bf16")
    ap.add_argument("--offload", choices=("model", "sequential"))
    ap.add_argument("--vae-tiling", action="store_true")
    args = ap.parse_args(list(argv))
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    device = "cuda" if torch.cuda.is_available() else "cpu"

    torch.manual_seed(0)
    pipe = build_pipeline(read_pipeline(args.folder), dtype)
    with quiet():  # (diffusers' warnings on casting the VAE: the core never prints)
        _call(pipe, args, device)


def _call(pipe: Any, args: argparse.Namespace, device: str) -> None:
    import torch

    if args.offload and device == "cuda":  # accelerate's hooks bring each model (or layer) in for its call
        if args.offload == "model":
            pipe.enable_model_cpu_offload()
        else:
            pipe.enable_sequential_cpu_offload()
    else:
        pipe.to(device)
    if args.vae_tiling:
        pipe.vae.enable_tiling()
    pipe.set_progress_bar_config(disable=True)
    takes = set(inspect.signature(pipe.__call__).parameters)
    video: dict[str, Any] = {"num_videos_per_prompt": args.batch} if "num_frames" in takes else \
        {"num_images_per_prompt": args.batch}
    if args.frames:
        video["num_frames"] = args.frames
    pipe("w1 w2 w3 w4 w5", height=args.height or args.size, width=args.size, num_inference_steps=args.steps,
         generator=torch.Generator(device).manual_seed(0), output_type="pt", **video)


if __name__ == "__main__":
    main(sys.argv[1:])
