"""The serving API with vLLM pinned to 0.10.1.1: the release the rule tests and their public
logs (vLLM 0.10.x era) were written against. Newer releases: tests/test_serving_versions.py."""

from __future__ import annotations

from typing import Any

from vramplan.serving import api

PINNED = "0.10.1.1"


def _pin(kw: dict[str, Any]) -> dict[str, Any]:
    if (kw.get("engine") or "vllm") == "vllm":
        kw.setdefault("engine_version", PINNED)
    return kw


def serve_plan(*args: Any, **kw: Any) -> Any:
    return api.serve_plan(*args, **_pin(kw))


def largest_max_model_len(*args: Any, **kw: Any) -> Any:
    return api.largest_max_model_len(*args, **_pin(kw))


def cheapest(*args: Any, **kw: Any) -> Any:
    return api.cheapest(*args, **_pin(kw))


def sweep(*args: Any, **kw: Any) -> Any:
    return api.sweep(*args, **_pin(kw))
