"""Serving: an inference engine's own start-up sizing of its KV-cache pool.

vLLM (V1, 0.9.2 … 0.34.0), SGLang (0.4.6 … 0.5.23), TGI (3.0.0 … 3.3.7) and TensorRT-LLM (1.0): weights per GPU,
the profile run's peak (vramplan's own estimate of a forward at the engine's token budget),
memory outside PyTorch, CUDA graphs, and the resulting pool — blocks, tokens and maximum
concurrency, or the engine's own error when it would not start. See each engine's module
for the rules it follows and what is approximated.
"""

from __future__ import annotations

from vramplan.pools.result import ServePlan

from .api import ENGINES, SWEEPS, Option, cheapest, largest_max_model_len, serve_plan, sweep

__all__ = ["ENGINES", "SWEEPS", "Option", "ServePlan", "cheapest", "largest_max_model_len", "serve_plan", "sweep"]
