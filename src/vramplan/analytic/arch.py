"""The structure of a transformer as the analytic estimator sees it.

A family module (:mod:`.decoder`, :mod:`.encoder`, :mod:`.vit`) lays the one model shape
(:class:`~vramplan.models.shape.ModelShape`, whose dimensions every method reads) out as an
:class:`Arch`: groups of identical layers, each a list of :class:`Linear` weights plus what
decides saved activations (norm kinds, dropout, fp32 softmax, activation saves). Sizes here are
*whole-model* (before tensor/pipeline/expert parallel splits); :mod:`.parallel` divides them per
rank.
"""

from __future__ import annotations

from vramplan._dataclass import dataclass
from vramplan.models.shape import ModelShape
from vramplan.models.spec import Family


@dataclass(frozen=True)
class Linear:
    """One weight matrix of a layer (or a stack of ``count`` of them, e.g. routed experts)."""

    name: str
    """The module name PEFT matches (``q_proj``, ``c_attn``, ``query``, ``dense``…)."""
    role: str
    """What it does in the block: q k v qkv o gate up gate_up down fc1 fc2 router
    experts_gate_up experts_down shared_gate shared_up shared_down q_a q_b kv_a kv_b head."""
    d_in: int
    d_out: int
    count: int = 1
    tp: bool = True
    """Split across tensor-parallel ranks (Megatron column/row parallel)."""
    expert: bool = False
    """A routed expert stack: split across expert-parallel ranks, ``top_k`` of ``count`` used per token."""
    attn: bool = False
    """Part of the attention (the targets LoRA's default list stands for)."""
    lora: bool = True
    """An ``nn.Linear`` that PEFT can wrap (3-D expert parameters and custom routers cannot)."""

    @property
    def params(self) -> int:
        return self.count * self.d_in * self.d_out

    @property
    def matrix(self) -> int:
        """Elements of one matrix of the stack."""
        return self.d_in * self.d_out


@dataclass(frozen=True)
class Attn:
    """The attention of a layer group, as far as memory goes."""

    kind: str = "mha"
    """``mha`` (MHA/GQA/MQA) or ``mla`` (DeepSeek multi-head latent attention)."""
    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    """Query/key head size (MLA: nope + rope)."""
    v_head_dim: int = 0
    causal: bool = True
    rope: bool = True
    softmax_fp32: bool = False
    """The eager path upcasts the softmax to fp32 itself (HF Llama-style ``dtype=torch.float32``)."""
    dropout: float = 0.0
    """Dropout on attention probabilities during training."""
    window: int | None = None
    qk_norm: bool = False
    """Per-head RMSNorm on q and k before RoPE (Qwen3, Gemma 3)."""
    # MLA
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    rope_dim: int = 0
    nope_dim: int = 0

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim


@dataclass(frozen=True)
class Ffn:
    """The feed-forward block of a layer group."""

    kind: str = "gated"
    """``gated`` (SwiGLU/GeGLU), ``plain`` (fc → act → fc) or ``moe`` (routed gated experts)."""
    intermediate: int = 0
    """Per-expert intermediate size for ``moe``."""
    act_saves: int = 1
    """Activation-sized tensors the activation function saves (1 for fused GELU/SiLU; 4 for
    the Python-composite ``gelu_new`` of GPT-2: input, tanh, 0.5·x, 1+tanh)."""
    experts: int = 0
    top_k: int = 0
    shared_intermediate: int = 0
    """Intermediate size of the always-on shared expert MLP (0 = none)."""
    router_fp32: bool = False
    """DeepSeek's sigmoid router computes in fp32 (input and weight cast to float32)."""
    dropout: float = 0.0


@dataclass(frozen=True)
class LayerGroup:
    """``count`` identical layers."""

    name: str
    count: int
    linears: tuple[Linear, ...]
    attn: Attn
    ffn: Ffn
    norm: str = "rmsnorm"
    """``rmsnorm`` (HF Llama: fp32 math, weight applied in the input dtype), ``gemma_rmsnorm``
    (fp32 math including ``1 + weight``) or ``layernorm``."""
    post_norms: bool = False
    """Gemma 2/3 sandwich norms: the attention and MLP outputs are normalised too."""
    small_params: int = 0
    """Norm weights, biases: never quantised; replicated across TP but for ``tp_small``."""
    tp_small: int = 0
    """Of ``small_params``, the biases of column-parallel linears (Qwen2's q/k/v): tensor
    parallelism shards them with their rows (torch 2.13 ``distributed/tensor/parallel/style.py``
    ``ColwiseParallel._partition_linear_fn``, :121-132: weight and bias ``Shard(0)``; transformers 5.24
    ``distributed/tensor_parallel.py:143-171``, the same); a row-parallel linear's bias stays whole."""

    @property
    def params(self) -> int:
        return sum(lin.params for lin in self.linears) + self.small_params

    def role(self, *roles: str) -> tuple[Linear, ...]:
        """The linears with one of these roles, in block order."""
        return tuple(lin for lin in self.linears if lin.role in roles)


@dataclass(frozen=True)
class Head:
    """What follows the last layer."""

    kind: str
    """``lm`` (logits over the vocabulary for every position), ``mlm`` (BERT masked-LM head:
    dense + GELU + LayerNorm + tied decoder), ``cls`` (classifier on the first token)."""
    classes: int
    """Vocabulary size, or number of labels for ``cls``."""
    linears: tuple[Linear, ...] = ()
    """Head matrices that are separate parameters (the output projection when untied)."""
    tied: bool = False
    small_params: int = 0
    softcap: bool = False
    """Final-logit soft-capping (Gemma 2): ``tanh`` keeps one more logit-sized tensor."""


@dataclass(frozen=True)
class Arch:
    """The layer structure of one model shape, as the analytic formulas read it."""

    shape: ModelShape
    """The dimensions (read from here: ``family``, ``name``, ``hidden``)."""
    groups: tuple[LayerGroup, ...]
    head: Head
    embed_params: int
    """Token (+ position, token-type, patch) embeddings: vocab-parallel under TP, 16-bit under quantisation."""
    norm: str = "rmsnorm"
    final_norm_params: int = 0
    extra_params: int = 0
    """Published parameters not placed in the structure (biases, poolers, buffers): replicated."""
    embed_dropout: float = 0.0

    @property
    def family(self) -> Family:
        return self.shape.family

    @property
    def name(self) -> str:
        return self.shape.name

    @property
    def hidden(self) -> int:
        return self.shape.hidden

    @property
    def vocab(self) -> int:
        """Vocabulary size (0 for a ViT)."""
        return self.shape.vocab

    @property
    def layers(self) -> int:
        return sum(g.count for g in self.groups)

    @property
    def structured_params(self) -> int:
        head = sum(lin.params for lin in self.head.linears) + self.head.small_params
        return (
            sum(g.params * g.count for g in self.groups)
            + head + self.embed_params + self.final_norm_params
        )

    @property
    def params(self) -> int:
        return self.structured_params + self.extra_params

    def linear_names(self) -> tuple[str, ...]:
        seen: dict[str, None] = {}
        for g in self.groups:
            for lin in g.linears:
                if lin.lora:
                    seen.setdefault(lin.name)
        return tuple(seen)
