"""Run before the real CPU run of torchtune's distributed recipes (``Entry.cpu_prelude``).

torchtune 0.6.1's distributed recipes call two CUDA memory utilities without checking the
device, and neither runs on the CPU (the single-device recipes check first,
recipes/full_finetune_single_device.py:453):

- rank 0 logs its memory after building the model (recipes/full_finetune_distributed.py:627-629,
  lora_finetune_distributed.py:543-545, lora_dpo_distributed.py:446-448), and
  ``torchtune.training.get_memory_stats`` raises on a CPU device (torchtune/training/memory.py:263-264):
  here it answers zeros on the CPU (it reads CUDA's counters, allocates nothing);
- ``train()`` starts with ``training.cleanup_before_training()`` (full_finetune_distributed.py:745,
  lora_finetune_distributed.py:752, lora_dpo_distributed.py:653), which calls ``empty_cache`` and
  ``reset_peak_memory_stats`` on ``torch.cpu`` (torchtune/training/memory.py:50-52, the device
  namespace of torchtune/utils/_device.py:257-259), and ``torch.cpu`` has neither: here the
  ``gc.collect()`` it starts with runs, and the caching allocator's two calls, which have no CPU
  counterpart, are skipped;
- the LoRA and DPO recipes start ``init_process_group("cuda:nccl,cpu:gloo")``
  (lora_finetune_distributed.py:918, lora_dpo_distributed.py:848), and without a GPU the CUDA
  backend cannot be built (torch/distributed/distributed_c10d.py: a CPU-only build "doesn't have
  NCCL built in"; a CUDA build's ProcessGroupNCCL "is only supported with GPUs"): there the CUDA half
  of the string is dropped (no CUDA tensor reaches it on the CPU; gloo serves the CPU's, as it does
  in the string).

The recipe itself runs as written.
"""

import gc

import torch
import torch.distributed
import torch.distributed.distributed_c10d
import torchtune.training
import torchtune.training.memory

_get_memory_stats = torchtune.training.memory.get_memory_stats
_cleanup_before_training = torchtune.training.memory.cleanup_before_training
_init_process_group = torch.distributed.distributed_c10d.init_process_group


def get_memory_stats(device: torch.device, reset_stats: bool = True) -> dict:
    if device.type == "cpu":
        return {"peak_memory_active": 0.0, "peak_memory_alloc": 0.0, "peak_memory_reserved": 0.0}
    return _get_memory_stats(device, reset_stats)


def cleanup_before_training() -> None:
    if torch.cuda.is_available():
        _cleanup_before_training()
    else:
        gc.collect()


def init_process_group(backend: str | None = None, *args: object, **kwargs: object) -> None:
    if isinstance(backend, str) and "cuda:" in backend and not torch.cuda.is_available():
        backend = ",".join(b for b in backend.split(",") if not b.startswith("cuda:")) or "gloo"
    _init_process_group(backend, *args, **kwargs)  # type: ignore[arg-type]


torch.distributed.init_process_group = init_process_group  # type: ignore[assignment]
torch.distributed.distributed_c10d.init_process_group = init_process_group  # type: ignore[assignment]
for module in (torchtune.training, torchtune.training.memory):
    module.get_memory_stats = get_memory_stats  # type: ignore[attr-defined]
    module.cleanup_before_training = cleanup_before_training  # type: ignore[attr-defined]
