"""vLLM V1's speculative decoding at start-up, following vLLM **0.10.1.1** (the version
:mod:`.vllm` follows; files cited per rule).

V1 runs ``ngram``, ``eagle``, ``eagle3``, ``deepseek_mtp`` and ``medusa``; a separate draft model
(``draft_model``) is refused ("Speculative decoding with draft model is not supported yet",
``vllm/engine/arg_utils.py`` ``_is_v1_supported_oracle``, ``vllm/config/__init__.py``
``SpeculativeConfig.__post_init__``). What each changes:

- **Weights** (inside "Model loading took": ``EagleProposer.load_model`` runs in the same
  ``DeviceMemoryProfiler`` window as the target, ``vllm/v1/worker/gpu_model_runner.py``):
  EAGLE-1 (``llama_eagle.py``): the head's decoder layers (its ``num_hidden_layers``, usually 1)
  and ``fc`` (2H → H), unquantised; its embedding is the target's (the copy is freed) and so is
  its ``lm_head``. EAGLE-3 (``llama_eagle3.py``): one decoder layer whose q/k/v read 2H inputs,
  ``fc`` (3H → H), its own ``lm_head`` (draft vocabulary × H, never shared in 0.10.1.1) and the
  draft-to-target id map (int64). DeepSeek MTP (``deepseek_mtp.py``): ``num_nextn_predict_layers``
  full decoder layers of the target (MoE, the target's quantisation), ``eh_proj`` (2H → H), two
  norms and a second copy of the vocabulary head. ngram: none (a CPU proposer).
- **KV cache**: the drafter's attention layers are registered like the target's
  (``static_forward_context``), so ``get_kv_cache_config`` divides the pool by target + draft
  layers: one more layer for EAGLE/EAGLE-3, ``num_nextn_predict_layers`` for MTP, whatever
  ``num_speculative_tokens`` is.
- **Outside the budget**: ``EagleProposer.__init__`` allocates ``hidden_states`` and
  ``inputs_embeds`` ``[max_num_batched_tokens, H]`` and two index buffers after the first memory
  snapshot and before the profile, so no term of the budget holds them (like the runner's own
  buffers): device memory beyond ``gpu_memory_utilization``.
- **Profile run**: the drafter's dummy forward is one head over the batched tokens without
  attention or logits (below the target's forward, which stays the peak); the sampler's dummy
  run takes one draft token per request.
- **Not profiled**: at run time the target's logits cover ``k + 1`` positions per request (up to
  the batched-token budget), and the rejection sampler works on them; the note compares that
  with the profiled sampler peak.

The reading behind these rules (vLLM's files and lines per version, and what changed later):
``docs/research/vllm-spec-decode.md``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from vramplan.errors import WorkloadError
from vramplan.models.params import count_params
from vramplan.models.spec import ModelSpec

from .kvspec import LayerKV

METHODS = ("ngram", "eagle", "eagle3", "deepseek_mtp", "medusa", "mlp_speculator", "draft_model")
"""``SpeculativeMethod`` of vLLM 0.10.1.1 (``vllm/config/__init__.py``)."""
MTP_TYPES = ("deepseek_v3",)
"""Targets whose own MTP layers vLLM 0.10.1.1 loads (``deepseek_mtp``; MiMo and GLM-4.5 are not in the catalog)."""


@dataclass(frozen=True, kw_only=True)
class SpecSettings:
    """``--speculative-config``: ``method``, ``num_speculative_tokens``, and the draft head's config
    (``model``, resolved: EAGLE heads ship a Llama-style config.json)."""

    method: str = ""
    num_speculative_tokens: int = 0
    draft: ModelSpec | None = field(default=None, compare=False)
    draft_name: str = ""

    @property
    def on(self) -> bool:
        return bool(self.method)


@dataclass(frozen=True)
class Drafter:
    """The drafter on one rank."""

    method: str
    k: int
    weights: int
    layers: int
    """KV layers it adds (per rank: the last pipeline stage's)."""
    buffers: int
    """``EagleProposer``'s persistent buffers, outside the budget."""
    notes: tuple[str, ...] = ()


def check(spec: ModelSpec, s: SpecSettings) -> None:
    """vLLM's refusals of the speculative settings (its own words where it has them)."""
    if not s.on:
        return
    if s.method not in METHODS:
        raise WorkloadError(f"speculative method {s.method!r} is not one of vLLM's",
                            hint=f"choose one of {', '.join(METHODS[:5])}", field="speculative_config")
    if s.method == "draft_model":
        raise WorkloadError("Speculative decoding with draft model is not supported yet. Please consider using other "
                            "speculative decoding methods such as ngram, medusa, eagle, or deepseek_mtp.",
                            hint="vLLM 0.10.1.1's own refusal: use an EAGLE head or ngram", field="speculative_config")
    if s.method in ("mlp_speculator", "medusa"):
        raise WorkloadError(f"speculative method {s.method} is not modelled",
                            hint="use ngram, eagle, eagle3 or deepseek_mtp", field="speculative_config")
    if s.num_speculative_tokens < 1:
        raise WorkloadError(f"num_speculative_tokens must be >= 1, got {s.num_speculative_tokens}",
                            hint='e.g. {"method": "eagle", "num_speculative_tokens": 3}', field="speculative_config")
    if s.method == "deepseek_mtp":
        n = int(spec.config.get("num_nextn_predict_layers") or 0)
        if spec.model_type not in MTP_TYPES or n < 1:
            raise WorkloadError(f"{spec.name} has no MTP layers for deepseek_mtp",
                                hint="deepseek_mtp applies to DeepSeek-V3/R1 (num_nextn_predict_layers)",
                                field="speculative_config")
    if s.method == "eagle3" and not any(t in spec.model_type for t in ("llama", "qwen")):
        raise WorkloadError(f"Eagle3 is only supported for Llama and Qwen models. Got model_type={spec.model_type!r}",
                            hint="vLLM 0.10.1.1's check: use eagle", field="speculative_config")


def _one_layer(config: dict[str, Any], origin: str) -> int:
    """Parameters of the decoder layer after ``config``'s last (the count with one layer more,
    less the count as it is: for DeepSeek-V3 an MoE layer, the dense ones come first)."""
    more = copy.deepcopy(config)
    more["num_hidden_layers"] = int(config["num_hidden_layers"]) + 1
    return count_params(more, origin=origin)[0] - count_params(config, origin=origin)[0]


def drafter(spec: ModelSpec, s: SpecSettings, *, tp: int, weight_bytes: float, compute_bytes: int,
            max_num_batched_tokens: int, max_num_seqs: int) -> Drafter | None:
    """What ``s`` adds on one rank of ``spec`` (``weight_bytes``: the target's bytes per weight,
    for MTP layers, which take its quantisation)."""
    if not s.on:
        return None
    k = s.num_speculative_tokens
    if s.method == "ngram":
        return Drafter("ngram", k, 0, 0, 0, ("ngram: the proposer matches n-grams of the prompt on the CPU (numpy); "
                                              "no GPU weights, KV or buffers.",))
    config = dict(spec.config)
    h = spec.hidden
    notes: list[str] = []
    if s.method == "deepseek_mtp":
        n = int(config.get("num_nextn_predict_layers") or 0)
        layer = _one_layer(config, spec.name)
        extra = 2 * h * h + 2 * h + h + spec.vocab * h  # eh_proj, enorm+hnorm, shared_head norm + its own head
        weights = int(n * layer * weight_bytes + extra * compute_bytes) // tp
        layers = n
        notes.append(f"deepseek_mtp: {n} MTP layer(s) of {spec.name} ({layer:,} parameters each, the target's "
                     f"quantisation) + eh_proj, norms and a second vocabulary head ({spec.vocab:,} × {h:,}, 16-bit).")
        hidden = h
    else:
        draft = s.draft
        if draft is None and spec.n_experts:
            raise WorkloadError(f"{s.method} on {spec.name} (a mixture of experts) needs the head's config: the "
                                "target's layer shape is not the head's", hint='give "model": "path/to/head/config.json"',
                                field="speculative_config")
        dconf = dict(draft.config) if draft is not None else {**config, "num_hidden_layers": 1}
        dh = int(dconf.get("hidden_size", h))
        n = 1 if s.method == "eagle3" else int(dconf.get("num_hidden_layers", 1))
        layer = _one_layer({**dconf, "num_hidden_layers": 1}, s.draft_name or spec.name)
        if s.method == "eagle":
            params = n * layer + 2 * dh * dh  # fc 2H -> H; embedding and lm_head the target's
            what = f"eagle: {n} decoder layer(s) ({layer:,} parameters each) + fc 2H → H"
        else:
            heads = int(dconf.get("num_attention_heads", spec.heads))
            kv = int(dconf.get("num_key_value_heads", heads))
            hd = int(dconf.get("head_dim") or dh // heads)
            vocab = int(dconf.get("draft_vocab_size") or dconf.get("vocab_size") or spec.vocab)
            qkv_in = (heads + 2 * kv) * hd * dh  # q/k/v read 2H: one more H of inputs
            params = layer + qkv_in + dh + 3 * h * dh + vocab * dh  # + hidden_norm, fc 3H -> H, own lm_head
            weights_map = vocab * 8  # draft_id_to_target_id, int64
            what = (f"eagle3: 1 decoder layer ({layer:,} + {qkv_in:,} parameters: q/k/v over 2H) + fc 3H → H + its own "
                    f"lm_head ({vocab:,} × {dh:,}) + the draft-to-target id map")
        weights = int(params * compute_bytes + (weights_map if s.method == "eagle3" else 0)) // tp
        layers = n
        source = s.draft_name or "(no draft config given: one layer of the target's shape)"
        notes.append(f"{what}; head config {source}; 16-bit (EAGLE heads are built without the target's "
                     "quantisation).")
        hidden = dh
    buffers = max_num_batched_tokens * (2 * hidden * compute_bytes + 4 + 8) + (max_num_seqs + 1) * 4 + \
        max_num_seqs * k * 4
    notes.append(f"{s.method}: EagleProposer's buffers ({max_num_batched_tokens:,} × {hidden:,} hidden states and "
                 f"embeddings, {buffers / 2**20:.0f} MiB) are allocated before the profile: outside "
                 "gpu_memory_utilization's budget, in device memory.")
    notes.append(f"The scheduler reserves {k} lookahead KV slot(s) per running request (the logged maximum "
                 "concurrency does not).")
    return Drafter(s.method, k, weights, layers, buffers, tuple(notes))


def draft_layers(layers: tuple[LayerKV, ...], d: Drafter | None) -> tuple[LayerKV, ...]:
    """The KV layers with the drafter's (the target's full-attention page: EAGLE heads and MTP
    layers share one KV group with it)."""
    if d is None or not d.layers:
        return layers
    like = next((x for x in layers if x.kind in ("full", "mla")), layers[0])
    return layers + tuple(like for _ in range(d.layers))


def runtime_logits(vocab: int, max_num_seqs: int, max_num_batched_tokens: int, k: int, compute_bytes: int) -> int:
    """The target's logits (16-bit and an fp32 copy) of a full decode batch with ``k`` draft tokens
    per request: ``k + 1`` positions each, capped by the batched-token budget."""
    rows = min(max_num_seqs * (k + 1), max_num_batched_tokens)
    return rows * vocab * (compute_bytes + 4)


__all__ = ["METHODS", "Drafter", "SpecSettings", "check", "draft_layers", "drafter", "runtime_logits"]
