"""Inference engines' own sizing rules, given a forward's figures (no estimate runs here).

vLLM's start-up sizing (:mod:`.vllm`), the KV-cache layer specs every engine reads
(:mod:`.kvspec`), the memory outside PyTorch and the serving dtype (:mod:`.base`), and the plan
they produce (:class:`.result.ServePlan`). :mod:`vramplan.serving` measures the forward with
vramplan's estimate and runs these rules; the estimate core runs them for a rollout engine that
shares the trainer's GPU (:mod:`vramplan.engine.rollout`).
"""
