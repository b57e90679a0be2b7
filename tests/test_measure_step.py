"""The real-workload builder of `vramplan measure`, run on CPU with a tiny Llama so that the
GPU path's model, LoRA, checkpointing, optimizer and step code is exercised here."""

from __future__ import annotations

import json

import pytest
import torch

from vramplan.errors import WorkloadError
from vramplan.measure.step import build_step, check_measurable
from vramplan.models.catalog import resolve
from vramplan.workload import Workload

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32,
    "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
    "vocab_size": 128, "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
}


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    p = tmp_path_factory.mktemp("tiny") / "config.json"
    p.write_text(json.dumps(TINY_LLAMA))
    return resolve(str(p))


@pytest.mark.parametrize("kw", [
    {"precision": "fp32", "optimizer": "adamw"},
    {"precision": "bf16", "optimizer": "sgd-momentum", "optimizer_impl": "for-loop", "grad_accum": 2},
    {"precision": "bf16-mixed", "peft": "lora", "lora_rank": 4, "checkpointing": "full"},
    {"precision": "fp32", "checkpointing": "selective", "optimizer": "adafactor"},
    {"precision": "fp32", "keep_grads": True, "keep_outputs": True, "loss": "chunked", "loss_chunks": 4},
    {"precision": "bf16-mixed", "optimizer_in_backward": True},
])
def test_train_steps_run_and_update_weights(spec, kw):
    torch.manual_seed(0)
    w = Workload(task="train", batch=2, seq=16, **kw)
    step = build_step(spec, w, device="cpu")
    trainable = [p for p in step.model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in trainable]
    step()
    step()  # a second step reuses the optimizer state
    assert any(not torch.equal(a, p.detach()) for a, p in zip(before, trainable, strict=True))
    if kw.get("keep_grads"):  # zero_grad(set_to_none=False): zeroed in place
        assert all(p.grad is not None and not p.grad.any() for p in trainable)
    else:
        assert all(p.grad is None for p in trainable)  # zero_grad(set_to_none=True)
    if kw.get("peft") == "lora":
        assert all("lora_" in n for n, p in step.model.named_parameters() if p.requires_grad)
    if kw["precision"] == "bf16":
        assert all(p.dtype == torch.bfloat16 for p in trainable)


@pytest.mark.parametrize("task", ["infer", "generate"])
def test_inference_steps_run(spec, task):
    w = Workload(task=task, batch=2, seq=8, new_tokens=3 if task == "generate" else 0, precision="fp32")
    build_step(spec, w, device="cpu")()


def test_unmeasurable_workloads_fail_early():
    with pytest.raises(WorkloadError, match="one GPU"):
        check_measurable(Workload().replace(dp=2))
    with pytest.raises(WorkloadError, match="fp8"):
        check_measurable(Workload(task="infer", quant="fp8"))
