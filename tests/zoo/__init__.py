"""The zoo: unmodified public training and inference scripts, shipped by packages on the index
(torchtune's recipes, TRL's scripts), and short drivers of models a package ships for the
purpose (``scripts/``: Lightning's demo transformer under ``Trainer`` and ``Fabric``), run under
``vramplan run`` and for real on the CPU.

Each entry is the installed script as its package ships it, with the arguments its own docs
use (configs and CLI flags), pointed at tiny local fixtures built here (:func:`fixtures`): a
2-layer model, a tokenizer and a few dozen examples, so that nothing is downloaded and the
real CPU run takes seconds. ``cpu`` is what the script's own switch for the CPU adds.
"""

from __future__ import annotations

import base64
import importlib
import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


def package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


@dataclass(frozen=True)
class Entry:
    name: str
    package: str
    """The package (folder) that ships the script."""
    script: str
    """Path inside the package's folder."""
    args: tuple[str, ...]
    cpu: tuple[str, ...]
    """What the script's own CPU switch adds for the real CPU run."""
    covers: str
    steps: int = 2
    world: int = 1
    needs: str = ""
    """The library the script runs on (must import; default: ``package``)."""
    path_extra: tuple[str, ...] = ()
    """Folders (relative to the repository) put first on the script's path: ``.zoo-deps`` holds
    torchao 0.15 for torchtune, which the test venv cannot hold beside peft (requirements/zoo.txt)."""
    known: tuple[tuple[str, str], ...] = field(default_factory=tuple)
    """(pattern, why): storages that exist on one side only because CUDA and the CPU take
    different code paths (``pattern`` is a regular expression on ``dtype[shape]``)."""
    cpu_prelude: str = ""
    """A file under ``tests/zoo/preludes`` each real CPU process runs before the script (a library
    call that raises on the CPU, answered there; the file says which and why)."""
    slow: bool = False
    """The pair of runs takes more than ~10 s: the test runs in the slow tier (``make test-slow``)."""

    def path(self) -> Path | None:
        d = package_dir(self.package)
        return None if d is None else d / self.script

    def available(self) -> str | None:
        """None when the script can run here, else why not."""
        lib = self.needs or self.package
        try:
            importlib.import_module(lib)
        except Exception as e:  # noqa: BLE001 (any import failure: report it)
            return f"{lib} does not import: {type(e).__name__}: {str(e).strip().splitlines()[0][:120]}"
        p = self.path()
        if p is None or not p.is_file():
            return f"{self.package} ships no {self.script}"
        return None


def fixtures(root: Path, *, torchtune: bool = False) -> Path:
    """Build the fixtures the zoo uses under ``root`` (idempotent; torchtune's only when asked:
    building them imports torchtune); returns ``root``."""
    (root / "out").mkdir(parents=True, exist_ok=True)  # where scripts write (checkpoints, samples)
    if not (root / "hf" / "done").exists():
        _hf(root / "hf")
        (root / "hf" / "done").write_text("ok")
    if not (root / "wikitext" / "done").exists():
        _wikitext(root / "wikitext")
        (root / "wikitext" / "done").write_text("ok")
    if not (root / "mnist" / "done").exists():
        _mnist(root / "mnist")
        (root / "mnist" / "done").write_text("ok")
    if torchtune and not (root / "tt" / "done").exists():
        _torchtune(root / "tt")
        (root / "tt" / "done").write_text("ok")
    return root


def _wikitext(out: Path) -> None:
    """``wikitext-2.txt`` as Lightning's ``WikiText2`` reads it (one paragraph a line, words split
    on white space): 4,000 lines of 40 words drawn from 5,000."""
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 5000, (4000, 40), generator=g).tolist()
    (out / "wikitext-2.txt").write_text("".join(" ".join(f"w{i}" for i in row) + "\n" for row in ids),
                                        encoding="utf8")


def _mnist(out: Path) -> None:
    """MNIST as Lightning's ``_MNIST`` reads it (``MNIST/complete/{training,test}.pt``: uint8 images
    [N, 28, 28] and int64 labels): 512 and 64 random images."""
    folder = out / "MNIST" / "complete"
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    for n, name in ((512, "training.pt"), (64, "test.pt")):
        torch.save((torch.randint(0, 256, (n, 28, 28), generator=g, dtype=torch.uint8),
                    torch.randint(0, 10, (n,), generator=g)), folder / name)


def _torchtune(out: Path) -> None:
    """A 2-layer Llama 3.2 (torchtune's own builder), its checkpoint, a byte-level tiktoken file
    (Llama 3's special tokens sit at 128000+, so the vocabulary is Llama 3's) and an Alpaca
    JSON file."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "tokenizer.model", "w") as f:
        for i in range(256):
            f.write(base64.b64encode(bytes([i])).decode() + f" {i}\n")
    from torchtune.models.llama3_2 import llama3_2

    torch.manual_seed(0)
    model = llama3_2(**TT_MODEL)
    torch.save(model.state_dict(), out / "model.pt")
    rows = [{"instruction": f"Count to {i}.", "input": "", "output": " ".join(str(k) for k in range(i % 9 + 3))}
            for i in range(64)]
    (out / "alpaca.json").write_text(json.dumps(rows))
    pref = [{"chosen": [{"role": "user", "content": f"Count to {i}."},
                        {"role": "assistant", "content": " ".join(str(k) for k in range(i % 9 + 3))}],
             "rejected": [{"role": "user", "content": f"Count to {i}."}, {"role": "assistant", "content": "no"}]}
            for i in range(64)]
    (out / "pref.json").write_text(json.dumps(pref))


TT_MODEL = {"vocab_size": 128256, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "embed_dim": 64,
            "max_seq_len": 512, "intermediate_dim": 128}


def _hf(out: Path) -> None:
    """A 2-layer Llama saved as a Hub folder (config, safetensors, a word-level tokenizer with a
    chat template) and JSON-lines datasets: plain text, preference pairs, unpaired KTO labels,
    conversational prompts (GRPO)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    model_dir = out / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    words = [f"w{i}" for i in range(500)]
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, "<bos>": 3, **{w: i + 4 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    t = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
                                bos_token="<bos>")
    t.chat_template = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} <eos> {% endfor %}"
    t.save_pretrained(model_dir)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=len(vocab), max_position_embeddings=256, pad_token_id=0,
                      eos_token_id=1, bos_token_id=3, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(model_dir)

    g = torch.Generator().manual_seed(0)

    def text(n: int) -> str:
        return " ".join(words[int(i)] for i in torch.randint(0, 500, (n,), generator=g))

    for name, row in (("text", lambda: {"text": text(60)}),
                      ("pref", lambda: {"prompt": text(20), "chosen": text(30), "rejected": text(25)}),
                      ("kto", lambda: {"prompt": text(20), "completion": text(30),
                                       "label": bool(torch.randint(0, 2, (), generator=g))}),
                      ("prompts", lambda: {"prompt": [{"role": "user", "content": text(20)}]})):
        d = out / name
        d.mkdir(exist_ok=True)
        with open(d / "train.jsonl", "w") as f:
            for _ in range(64):
                f.write(json.dumps(row()) + "\n")


def _tt(config: str, *extra: str) -> tuple[str, ...]:
    """torchtune's own config, pointed at the fixtures (``ROOT`` is replaced by the fixture folder)."""
    d = package_dir("recipes")
    model = [f"model.{k}={v}" for k, v in TT_MODEL.items()]
    return (f"--config={d / 'configs' / config if d else config}", "output_dir=ROOT/out/tt",
            *model, "tokenizer.path=ROOT/tt/tokenizer.model", "tokenizer.max_seq_len=64",
            "checkpointer._component_=torchtune.training.FullModelTorchTuneCheckpointer",
            "checkpointer.checkpoint_dir=ROOT/tt", "checkpointer.checkpoint_files=[model.pt]",
            "checkpointer.output_dir=ROOT/out/tt", "checkpointer.model_type=LLAMA3_2",
            "metric_logger.log_dir=ROOT/out/tt/logs", "batch_size=2", "max_steps_per_epoch=3", *extra)


_ALPACA = ("dataset._component_=torchtune.datasets.alpaca_dataset", "dataset.source=json",
           "dataset.data_files=ROOT/tt/alpaca.json", "dataset.split=train")
_LORA = ("model._component_=torchtune.models.llama3_2.lora_llama3_2", "model.lora_attn_modules=[q_proj,v_proj]",
         "model.apply_lora_to_mlp=True", "model.lora_rank=8", "model.lora_alpha=16")
_HF = ("--model_name_or_path", "ROOT/hf/model", "--per_device_train_batch_size", "2", "--max_steps", "3",
       "--output_dir", "ROOT/out/hf", "--report_to", "none", "--save_strategy", "no", "--logging_steps", "1",
       "--dataloader_num_workers", "0", "--bf16", "False")

_COMPACT = (r"f32\[\d+,32768\]", "TRL's fused head (trl/trainer/utils.py `_fused_forward`, kernels/chunked_logprob.py): "
            "its [rows, 32768] fp32 projection buffer holds the scored (completion) rows on CUDA (`compact`, "
            "hidden_states[mask]) and every position on the CPU")
_TILES = (r"f32\[\d+,504\]|bool\[\d+,504\]", "TRL's chunked log-prob (trl/kernels/chunked_logprob.py): on the "
          "CPU logit tiles [tokens, vocab] and their mask; on CUDA a Triton kernel folds each tile into one "
          "preallocated buffer")
_DIVERGENCE = (r"f32\[\d+,504\]|bool\[\d+,504\]", "TRL's chunked divergence (trl/kernels/chunked_divergence.py): "
               "on the CPU the student's and the teacher's logit tiles [tokens, vocab] and the terms computed from "
               "them; on CUDA Triton kernels fold each tile into preallocated buffers")
_MASK = (r"f32\[\d+,1,\d+,\d+\]", "the 4-D attention mask: CUDA's memory-efficient SDPA pads its keys to a multiple "
         "of 16 (and the CPU's SDPA takes it unpadded)")

_MHA = (r"f32\[\d+,2,35,35\]|f32\[\d+,2,100,35\]|f32\[\d+,2,64\]|i64\[\]", "nn.MultiheadAttention's SDPA (fp32, "
        "dropout 0.2): on the CPU the math path keeps the scores [B,H,T,T] (softmax, its dropout mask, the dropped "
        "weights) and K transposed; on CUDA the memory-efficient kernel keeps its logsumexp [B,H,T rounded up to 32] "
        "and its philox seed and offset")
_RNN_STATE = (r"u8\[\d+\]|cudnn .*|f32\[2048,512\]|f32\[2048\]|f32\[35,20,512\]|f32\[20,512\]",
              "the LSTM kernels' own memory: on CUDA cuDNN's reserve space (kept for the backward), workspace and "
              "dropout state, and the flat copy of the weights it compacts at every call (after .to('cuda') they are "
              "not one chunk unless the script calls flatten_parameters); on the CPU oneDNN's workspace, its reordered "
              "weights and biases, and each layer's time-major output and states, per layer")
_TOKENS = (r"i64\[164000\]", "WikiText2's token ids (the fixture's 4,000 lines of 41 tokens): a host tensor in the "
           "GPU run (batches are copied to the device), counted by the CPU run")

_PHILOX = (r"i64\[\]|i32\[2\]", "cuDNN's SDPA (the H100's first choice for bf16, torch aten/src/ATen/native/"
           "transformers/cuda/sdp_utils.cpp) keeps its philox seed and offset (i64[] each, per attention call) for the "
           "backward even without dropout; the CPU's flash kernel keeps none. The CPU run counts the DeviceMeshes' rank "
           "maps (i32[2], made on the host: torch/distributed/device_mesh.py `init_device_mesh`), host tensors in a GPU "
           "run; the comparison pairs them with as many seeds (the same 8 bytes)")
_DPO_LOG = (r"f32\[\]", "rank 0's step log (recipes/lora_dpo_distributed.py:779-808): the running metrics copied "
            "to the host (`.cpu()`) and the tokens per second (from `num_tokens`, a host tensor: :691) are host "
            "tensors in a GPU run; on the CPU `.cpu()` returns the metric itself, which the dict keeps alive, counted")
_MNIST_DATA = (r"u8\[512,28,28\]|i64\[512\]", "the fixture's MNIST images and labels (_MNIST loads them whole): host "
               "tensors in the GPU run (batches are copied to the device), counted by the CPU run")
_SCALARS = (r"f32\[\]|i32\[\]", "0-dim scalars: the GradScaler's scale and growth tracker exist on the GPU only "
            "(Fabric's 16-mixed is bf16-mixed without a scaler on the CPU); Adadelta's step counters stay on the host "
            "unless capturable (torch/optim/adadelta.py), counted by the CPU run")

_SCHEDULER = (r"f32\[100\]|i64\[3\]|f32\[\]", "DDPMScheduler's tables (betas, alphas, their cumulative "
              "product: f32[100]) and timesteps stay host tensors in the GPU run (the pipeline moves the UNet, not "
              "the scheduler), counted by the CPU run")

_EFFICIENT = (r"i64\[\]|f32\[1,2,\d+\]", "the fp32 SDPA calls: on CUDA the memory-efficient kernel keeps its philox seed and "
              "offset (i64[] each) for the backward, and a logsumexp [B,H,T rounded up to 32] (the vision tower's "
              "windows: 2 heads); on the CPU the flash kernel keeps the logsumexp unpadded and no seed")
_ADAM_STEPS = (r"f32\[\]", "AdamW's step counters: host tensors on CUDA unless capturable or fused "
               "(torch/optim/adamw.py `_init_group`), counted by the CPU run")

ZOO: tuple[Entry, ...] = (
    Entry("torchtune full finetune", "recipes", "full_finetune_single_device.py",
          _tt("llama3_2/1B_full_single_device.yaml", *_ALPACA, "model._component_=torchtune.models.llama3_2.llama3_2",
              "optimizer._component_=torch.optim.AdamW",
              "optimizer_in_bwd=False"),
          ("device=cpu",), needs="torchtune", path_extra=(".zoo-deps",), covers="plain loop, bf16 weights, AdamW, chunked CE loss"),
    Entry("torchtune full finetune, optimizer in backward", "recipes", "full_finetune_single_device.py",
          _tt("llama3_2/1B_full_single_device.yaml", *_ALPACA, "model._component_=torchtune.models.llama3_2.llama3_2",
              "optimizer._component_=torch.optim.AdamW"),
          ("device=cpu",), needs="torchtune", path_extra=(".zoo-deps",), covers="optimizer stepped per parameter in its post-accumulate-grad hook"),
    Entry("torchtune LoRA, gradient accumulation", "recipes", "lora_finetune_single_device.py",
          _tt("llama3_2/1B_lora_single_device.yaml", *_ALPACA, *_LORA, "gradient_accumulation_steps=2",
              "lr_scheduler.num_warmup_steps=1"),
          ("device=cpu",), needs="torchtune", path_extra=(".zoo-deps",), covers="LoRA adapters, gradient accumulation, cosine schedule"),
    Entry("torchtune LoRA, activation checkpointing", "recipes", "lora_finetune_single_device.py",
          _tt("llama3_2/1B_lora_single_device.yaml", *_ALPACA, *_LORA, "enable_activation_checkpointing=True",
              "gradient_accumulation_steps=1", "lr_scheduler.num_warmup_steps=1"),  # (accumulation: the entry above)
          ("device=cpu",), needs="torchtune", path_extra=(".zoo-deps",), covers="LoRA with activation checkpointing (recompute in backward)"),
    Entry("torchtune LoRA DPO", "recipes", "lora_dpo_single_device.py",
          _tt("llama3_1/8B_lora_dpo_single_device.yaml", *_LORA, "checkpointer.model_type=LLAMA3_2",
              "dataset._component_=torchtune.datasets.preference_dataset", "dataset.source=json",
              "dataset.data_files=ROOT/tt/pref.json", "dataset.split=train", "gradient_accumulation_steps=1",
              "enable_activation_checkpointing=False", "lr_scheduler.num_warmup_steps=1"),
          ("device=cpu",), needs="torchtune", path_extra=(".zoo-deps",), covers="preference tuning: policy and reference (adapters off) on chosen and rejected"),
    Entry("torchtune knowledge distillation", "recipes", "knowledge_distillation_single_device.py",
          _tt("llama3_2/8B_to_1B_KD_lora_single_device.yaml", *_ALPACA, *_LORA,
              "teacher_model._component_=torchtune.models.llama3_2.llama3_2",
              *(f"teacher_model.{k}={v}" for k, v in TT_MODEL.items()),
              "teacher_checkpointer._component_=torchtune.training.FullModelTorchTuneCheckpointer",
              "teacher_checkpointer.checkpoint_dir=ROOT/tt", "teacher_checkpointer.checkpoint_files=[model.pt]",
              "teacher_checkpointer.model_type=LLAMA3_2", "teacher_checkpointer.output_dir=ROOT/out/tt",
              "gradient_accumulation_steps=1", "lr_scheduler.num_warmup_steps=1"),
          ("device=cpu",), needs="torchtune", path_extra=(".zoo-deps",), covers="a frozen teacher and a LoRA student, KL + CE losses"),
    Entry("torchtune generate", "recipes", "generate.py",
          _tt("generation.yaml", "model._component_=torchtune.models.llama3_2.llama3_2",
              "tokenizer._component_=torchtune.models.llama3.llama3_tokenizer", "max_new_tokens=8",
              "prompt.user=Count to five.", "top_k=50"),
          ("device=cpu",), needs="torchtune", path_extra=(".zoo-deps",), covers="inference: sampling with a KV cache"),
    Entry("torchtune full finetune, FSDP2 over 2 processes", "recipes", "full_finetune_distributed.py",
          _tt("llama3_2/1B_full.yaml", *_ALPACA, "model._component_=torchtune.models.llama3_2.llama3_2",
              "gradient_accumulation_steps=1"),
          ("device=cpu",), needs="torchtune", path_extra=(".zoo-deps",), world=2,
          cpu_prelude="torchtune_cpu.py", slow=True, known=(_PHILOX,),
          covers="a torchrun launch of torchtune's FSDP2 recipe: rank 0's shards, fused AdamW"),
    Entry("torchtune LoRA, FSDP2 over 2 processes", "recipes", "lora_finetune_distributed.py",
          _tt("llama3_2/1B_lora.yaml", *_ALPACA, *_LORA, "gradient_accumulation_steps=1",
              "lr_scheduler.num_warmup_steps=1"),
          ("device=cpu",), needs="torchtune", path_extra=(".zoo-deps",), world=2,
          cpu_prelude="torchtune_cpu.py", slow=True, known=(_PHILOX,),
          covers="a torchrun launch of torchtune's FSDP2 LoRA recipe: frozen sharded base, sharded adapters"),
    Entry("torchtune LoRA DPO, FSDP2 over 2 processes", "recipes", "lora_dpo_distributed.py",
          _tt("llama3_1/8B_lora_dpo.yaml", *_LORA, "checkpointer.model_type=LLAMA3_2",
              "dataset._component_=torchtune.datasets.preference_dataset", "dataset.source=json",
              "dataset.data_files=ROOT/tt/pref.json", "dataset.split=train", "gradient_accumulation_steps=1",
              "enable_activation_checkpointing=False", "lr_scheduler.num_warmup_steps=1"),
          ("device=cpu",), needs="torchtune", path_extra=(".zoo-deps",), world=2,
          cpu_prelude="torchtune_cpu.py", slow=True, known=(_DPO_LOG,),  # (its seeds and rank maps pair up)
          covers="a torchrun launch of torchtune's FSDP2 LoRA DPO recipe: policy and reference (adapters off) "
          "over the sharded base"),
    Entry("Lightning Trainer, demo transformer LM", "zoo", "scripts/lightning_trainer.py", ("ROOT/wikitext",), (),
          "Lightning's LightningTransformer demo (nn.Transformer, dropout) under Trainer: accelerator auto, "
          "gradient clipping, SGD", needs="lightning", known=(_MHA, _TOKENS)),
    Entry("Lightning Fabric, demo transformer LM", "zoo", "scripts/lightning_fabric.py", ("ROOT/wikitext",), (),
          "the same demo model under Fabric: setup, setup_dataloaders, backward, clip_gradients",
          needs="lightning", known=(_MHA, _TOKENS)),
    Entry("Lightning Trainer, demo LSTM LM", "zoo", "scripts/lightning_lstm.py", ("ROOT/wikitext",), (),
          "Lightning's LightningLSTM demo: a 4-layer LSTM with truncated-BPTT hidden state, SequenceSampler",
          needs="lightning", known=(_RNN_STATE, _TOKENS)),
    Entry("Lightning Fabric, demo MNIST CNN, 16-mixed", "zoo", "scripts/lightning_mnist_amp.py", ("ROOT/mnist",), (),
          "vision (convolutions, max-pooling, dropout) with AMP: fp16 autocast and a GradScaler on the GPU, "
          "Adadelta", needs="lightning", known=(_MNIST_DATA, _SCALARS)),
    Entry("diffusers DDPM pipeline", "zoo", "scripts/diffusers_ddpm.py", (), (),
          "diffusion inference: a UNet's denoising steps, a seeded generator on the device", needs="diffusers",
          known=(_SCHEDULER,)),
    Entry("diffusers Flux pipeline", "zoo", "scripts/diffusers_flux.py", (), (),
          "text-to-image: CLIP and T5 text encoders, a Flux transformer over packed latents, the VAE decode",
          needs="diffusers"),
    Entry("diffusers Flux pipeline, tiled VAE", "zoo", "scripts/diffusers_flux.py", ("--vae-tiling",), (),
          "the VAE decoded tile by tile (`vae.enable_tiling()`)", needs="diffusers"),
    Entry("diffusers Wan 2.1 text-to-video", "zoo", "scripts/diffusers_wan.py", (), (),
          "text-to-video: UMT5 encoder, a 3-D transformer over video latents with classifier-free guidance, "
          "the causal 3-D VAE decode", needs="diffusers"),
    Entry("transformers Qwen2.5-VL training", "zoo", "scripts/transformers_qwen2_5_vl.py", ("train",), (),
          "vision-language training: a vision tower over the images' patches, the merger, multimodal RoPE; the "
          "sequence length follows the images' resolution; AdamW on every weight", needs="transformers",
          known=(_EFFICIENT, _ADAM_STEPS)),
    Entry("transformers Qwen2.5-VL LoRA", "zoo", "scripts/transformers_qwen2_5_vl.py",
          ("train", "--lora"), (),
          "vision-language LoRA: peft adapters on the language model's attention, the vision tower frozen",
          needs="peft", known=(_ADAM_STEPS,)),
    Entry("transformers Qwen2.5-VL generate", "zoo", "scripts/transformers_qwen2_5_vl.py", ("generate",), (),
          "vision-language generation: the image prefill, then greedy decoding with a growing KV cache",
          needs="transformers"),
    Entry("TRL SFT", "trl", "scripts/sft.py",
          (*_HF, "--dataset_name", "ROOT/hf/text", "--max_length", "64"),
          ("--use_cpu", "True"), "HF Trainer + accelerate, fused AdamW, TRL's chunked log-prob loss",
          known=(_TILES,)),
    Entry("TRL SFT, gradient accumulation", "trl", "scripts/sft.py",
          (*_HF, "--dataset_name", "ROOT/hf/text", "--max_length", "64", "--gradient_accumulation_steps", "2"),
          ("--use_cpu", "True"), "HF Trainer gradient accumulation",
          known=(_TILES,)),
    Entry("TRL SFT, DDP over 2 processes", "trl", "scripts/sft.py",
          (*_HF, "--dataset_name", "ROOT/hf/text", "--max_length", "64"),
          ("--use_cpu", "True"), "a torchrun launch: rank 0 of DistributedDataParallel (gloo on the CPU, the fake "
          "process group under vramplan run)", world=2, known=(_TILES,)),
    Entry("TRL DPO", "trl", "scripts/dpo.py",
          (*_HF, "--dataset_name", "ROOT/hf/pref", "--max_length", "64"),
          ("--use_cpu", "True"), "preference tuning with a reference model", known=(_TILES, _COMPACT)),
    Entry("TRL reward model", "trl", "scripts/reward.py",
          (*_HF, "--dataset_name", "ROOT/hf/pref", "--max_length", "64"),
          ("--use_cpu", "True"), "sequence-classification head on chosen/rejected pairs", known=(_MASK,)),
    Entry("TRL GRPO", "trl", "scripts/grpo.py",
          (*_HF, "--dataset_name", "ROOT/hf/prompts", "--reward_funcs", "think_format_reward", "--num_generations",
           "2", "--max_completion_length", "16"),
          ("--use_cpu", "True"), "GRPO: `generate` on the training model (sampled tokens, the stop check read on "
          "the host), the completions decoded for the reward function, then the policy-gradient step through TRL's "
          "fused head", known=(_TILES, _COMPACT)),
    Entry("TRL KTO", "trl", "scripts/kto.py",
          (*_HF, "--dataset_name", "ROOT/hf/kto", "--max_length", "64"),
          ("--use_cpu", "True"), "unpaired preference tuning with a reference model", known=(_TILES, _COMPACT)),
    Entry("TRL RLOO, reward model", "trl", "scripts/rloo.py",
          (*_HF, "--dataset_name", "ROOT/hf/prompts", "--reward_model_name_or_path", "ROOT/hf/model",
           "--num_generations", "2", "--max_completion_length", "16"),
          ("--use_cpu", "True"), "RL with a reward model: `generate`, the completions scored by a "
          "sequence-classification model, leave-one-out advantages, the policy step", known=(_TILES, _COMPACT)),
    Entry("TRL distillation", "trl", "scripts/distillation.py",
          (*_HF, "--dataset_name", "ROOT/hf/prompts", "--teacher_model_name_or_path", "ROOT/hf/model",
           "--max_completion_length", "16"),
          ("--use_cpu", "True"), "knowledge distillation: the student's generations, a frozen teacher's hidden "
          "states inside the student's forward, a generalised JSD over both heads in vocabulary tiles",
          known=(_DIVERGENCE,)),
)


REPO = Path(__file__).resolve().parents[2]


FORK_PRELOAD = ("transformers", "trl", "peft", "datasets", "accelerate", "diffusers", "lightning",
                "vramplan.engine.script", "vramplan.script.truth", "zoo")
"""What the fork server imports for the entries :func:`run` forks (``fresh=False``): their
libraries, imported once per test process instead of once per entry (seconds each)."""


def _truth(entry: Entry, root: Path, *, forked: bool) -> Any:
    """The real CPU run of ``entry`` (rank 0 of a real gloo run when it runs on several processes,
    launched as torchrun would; ``forked``: the ranks forked from the fork server)."""
    from vramplan.script.truth import cpu_truth, cpu_truth_world

    path = entry.path()
    assert path is not None
    argv = [a.replace("ROOT", str(root)) for a in [*entry.args, *entry.cpu]]
    prelude = Path(__file__).with_name("preludes") / entry.cpu_prelude if entry.cpu_prelude else None
    if entry.world > 1:
        import os

        extra = [str(REPO / p) for p in entry.path_extra]  # (the ranks' path, as :func:`run` gives the script's)
        env = {"PYTHONPATH": os.pathsep.join([*extra, os.environ.get("PYTHONPATH", "")]).strip(os.pathsep)}
        return cpu_truth_world(path, argv, world=entry.world, steps=entry.steps, forked=forked, prelude=prelude,
                               env=env)
    return cpu_truth(path, argv, steps=entry.steps, prelude=prelude)


def compare_entry(name: str, root: Path, truth: Any = None) -> dict:
    """``vramplan run`` of the entry and the real CPU run of the same script (``truth``: already
    run), compared (or ``{"skip": why}``), as one JSON-able dictionary."""
    import dataclasses
    import time

    entry = next(e for e in ZOO if e.name == name)
    why = entry.available()
    if why:
        return {"skip": why}
    import vramplan
    from vramplan.script.truth import compare

    fixtures(root, torchtune=(entry.needs == "torchtune"))
    path = entry.path()
    assert path is not None
    argv = [a.replace("ROOT", str(root)) for a in entry.args]
    t0 = time.perf_counter()
    r = vramplan.run_script(path, argv, gpu="h100-sxm", workspaces=False, steps=entry.steps, world=entry.world,
                            gpus=entry.world)
    t1 = time.perf_counter()
    if truth is None:
        truth = _truth(entry, root, forked=False)
    c = compare(r, truth, entry.known)
    out = dataclasses.asdict(c)
    out.update(residual=c.residual, unexplained=c.unexplained, error=c.error, live=len(truth.at_peak),
               ran=r.ran.line() if r.ran else "", params=r.params, run_s=t1 - t0, torch=torch.__version__)
    return out


def _forked_entry(name: str, root: str, extra: list[str], env: dict[str, str], out: str, truth: Any) -> None:
    """:func:`compare_entry` in a process forked from the fork server: the caller's environment,
    ``extra`` first on the path, output to ``out + '.log'``, the result to ``out``; the process
    ends without the interpreter's teardown (as the gloo ranks do)."""
    import os
    import sys
    import traceback

    os.environ.clear()
    os.environ.update(env)
    sys.path[:0] = extra
    log = os.open(out + ".log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    try:
        result = json.dumps(compare_entry(name, Path(root), truth))
    except BaseException:  # noqa: BLE001 (reported to the caller with its traceback)
        traceback.print_exc()
        result = ""
    sys.stdout.flush()
    sys.stderr.flush()
    with open(out, "w") as f:
        f.write(result)
    os._exit(0)


def _forked_fixtures(root: str, extra: list[str], torchtune: bool) -> None:
    """:func:`fixtures` in a process forked from the fork server, ``extra`` first on the path (building
    torchtune's imports torchtune, which needs ``.zoo-deps``)."""
    import os
    import sys

    sys.path[:0] = extra
    fixtures(Path(root), torchtune=torchtune)
    os._exit(0)


def run(entry: Entry, root: Path, *, fresh: bool = True, timeout: float = 600) -> dict:
    """Run ``entry`` in a process of its own and return its :func:`compare_entry`.

    ``fresh``: a new Python process (``tests/zoo/run_entry.py``) in which the script imports its
    libraries under the emulated GPU, as ``vramplan run`` does. Otherwise a process forked from
    the fork server (:func:`vramplan.trace.testing.fork_context`, preloading :data:`FORK_PRELOAD`):
    the libraries are imported before the emulation starts, as in a notebook calling
    ``vramplan.run_script`` — the same script run, seconds faster."""
    import os
    import subprocess
    import sys
    import tempfile

    missing = [p for p in entry.path_extra if not (REPO / p).is_dir()]
    if missing:  # (before the real run of a world, which runs here: its libraries would not import)
        return {"skip": f"{', '.join(missing)} is not installed (the Makefile installs it)"}
    env = dict(os.environ)
    extra = [str(REPO / p) for p in entry.path_extra]
    env["PYTHONPATH"] = os.pathsep.join([*extra, env.get("PYTHONPATH", "")]).strip(os.pathsep)
    if not fresh:
        from vramplan.trace.testing import fork_context, preload_in_fork_server

        preload_in_fork_server(*FORK_PRELOAD)
        truth = None
        script = entry.path()
        if entry.world > 1 and script is not None and script.is_file():  # (the ranks are forked from here: the
            p = fork_context().Process(target=_forked_fixtures, args=(str(root), extra,  # fork server is this
                                                                     entry.needs == "torchtune"))  # process's)
            p.start()
            p.join(timeout)
            if p.exitcode != 0:
                raise AssertionError(f"{entry.name}: building the fixtures failed (exit {p.exitcode})")
            truth = _truth(entry, root, forked=True)
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "result")
            p = fork_context().Process(target=_forked_entry, args=(entry.name, str(root), extra, env, out, truth))
            p.start()
            p.join(timeout)
            if p.is_alive():
                p.kill()
                p.join()
                raise AssertionError(f"{entry.name}: did not finish in {timeout:g} s")
            result = Path(out).read_text() if os.path.exists(out) else ""
            if p.exitcode != 0 or not result:
                log = Path(out + ".log").read_text(errors="replace") if os.path.exists(out + ".log") else ""
                raise AssertionError(f"{entry.name}: exit {p.exitcode}\n{log[-3000:]}")
            return json.loads(result)
    p = subprocess.run([sys.executable, str(Path(__file__).with_name("run_entry.py")), entry.name, str(root)],
                       capture_output=True, text=True, timeout=timeout, env=env)
    lines = [x for x in p.stdout.splitlines() if x.startswith("{")]
    if p.returncode != 0 or not lines:
        raise AssertionError(f"{entry.name}: exit {p.returncode}\n{p.stderr[-3000:]}")
    return json.loads(lines[-1])
