"""Test-wide settings.

Hypothesis: no per-example deadline (the 2-core CI machine is shared and timing is not what
these tests check); under CI the examples are derandomised so that a run is reproducible.
"""

import os

# No test reads or writes the user's on-disk store of traces (``vramplan cache``): a stored trace
# would answer a test that patches the tracer, and test runs would fill ~/.cache. Subprocesses
# inherit it; tests of the store set their own folder and lift it.
os.environ["VRAMPLAN_NO_CACHE"] = "1"

from hypothesis import HealthCheck, settings

settings.register_profile("default", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", deadline=None, derandomize=True, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else "default")


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_estimate_caches():
    """Each test starts without the process's cached traces and replays (``vramplan.engine.cache``):
    a test that patches the tracer or counts traces sees its own calls, not an earlier test's."""
    from vramplan.engine import cache

    cache.clear()
    yield


_GUARDED = (("cuda", "is_available"), ("cuda", "device_count"), ("cuda", "get_rng_state"), ("cuda", "set_rng_state"),
            ("cuda", "current_device"), ("accelerator", "is_available"), ("accelerator", "current_accelerator"),
            ("backends.cudnn", "is_available"), ("_C", "_get_accelerator"))
"""torch functions the emulated GPU and the tracers patch while they run: a test that leaves one
patched changes what every later test in its process sees (the torch 2.14.1 suite's FSDP2 +
compile tests once traced eagerly because ``torch.cuda.is_available`` said yes)."""


def _guarded_now() -> dict:
    import importlib

    out = {}
    for mod, name in _GUARDED:
        m = importlib.import_module(f"torch.{mod}")
        if hasattr(m, name):
            out[f"torch.{mod}.{name}"] = (m, name, getattr(m, name))
    return out


_GUARDED_AT_START = _guarded_now()


def _cuda_says_yes() -> bool:
    import torch

    return bool(torch.cuda.is_available())


_CUDA_AT_START = _cuda_says_yes()

_CONFIGS = ("torch._dynamo.config", "torch._inductor.config", "torch._functorch.config")
"""torch.compile's settings: a script run in-process (``vramplan run``) or a test that sets one and
leaves it changes how every later compile of the process, the trace's among them, goes."""


def _configs_now() -> dict:
    import importlib

    out = {}
    for name in _CONFIGS:
        try:
            out[name] = importlib.import_module(name).get_config_copy()
        except Exception:  # noqa: BLE001 (a torch without it: nothing to guard)
            continue
    return out


_CONFIGS_AT_START = _configs_now()


def _config_changes() -> list:
    """(module, key, at start, now) of each compile setting changed since the start; put back."""
    import importlib

    import torch

    changed = []
    now = _configs_now()
    for name, start in _CONFIGS_AT_START.items():
        mod = importlib.import_module(name)
        for key, value in start.items():
            cur = now.get(name, {}).get(key, value)
            same = cur is value or (type(cur) is type(value) and not isinstance(cur, torch.Tensor) and _equal(cur, value))
            if not same:
                changed.append((name, key, value, cur))
                try:
                    setattr(mod, key, value)
                except Exception:  # noqa: BLE001 (read-only settings)
                    pass
    return changed


def _equal(a, b) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 (a value without a plain ==)
        return True


def _cuda_answer_sources() -> dict:
    """Where ``torch.cuda.is_available()``'s answer comes from (for the guard's message)."""
    import os

    import torch

    count = getattr(torch._C, "_cuda_getDeviceCount", None)
    return {"is_available": getattr(torch.cuda.is_available, "__qualname__", "?"),
            "is_available module": getattr(torch.cuda.is_available, "__module__", "?"),
            "_cuda_getDeviceCount": getattr(count, "__qualname__", None),
            "runtime count": count() if count is not None else None, "compiled": torch.cuda._is_compiled(),
            "PYTORCH_NVML_BASED_CUDA_CHECK": os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK"),
            "cached device count": getattr(torch.cuda, "_cached_device_count", None)}


@pytest.fixture(autouse=True)
def _no_torch_patch_left_behind():
    """Fails the test that leaves one of :data:`_GUARDED` patched (and puts it back), or leaves
    ``torch.cuda.is_available()`` saying yes on a host where it said no, or one of torch.compile's
    settings (:data:`_CONFIGS`) changed."""
    yield
    left = [key for key, (m, name, fn) in _GUARDED_AT_START.items() if getattr(m, name) is not fn]
    for key in left:
        m, name, fn = _GUARDED_AT_START[key]
        setattr(m, name, fn)
    assert not left, f"left patched by this test: {left}"
    changed = _config_changes()
    assert not changed, f"torch.compile settings left changed by this test (module, setting, was, now): {changed}"
    assert _CUDA_AT_START or not _cuda_says_yes(), \
        f"torch.cuda.is_available() says yes after this test on a host without a GPU: {_cuda_answer_sources()}"


# --- TRL's fused head with the decisions its code takes on CUDA (tests/test_trl_head.py, test_dpo.py)
import typing  # noqa: E402

import torch  # noqa: E402


class _TorchUnderAutocast:
    """``torch`` as TRL's kernel module sees it on CUDA inside a bf16 autocast region (the trace
    runs on ``meta``, where torch answers no autocast question)."""

    def __init__(self, autocast: torch.dtype | None) -> None:
        self._autocast = autocast

    def is_autocast_enabled(self, device_type: str) -> bool:
        return self._autocast is not None

    def get_autocast_dtype(self, device_type: str) -> torch.dtype:
        assert self._autocast is not None
        return self._autocast

    def __getattr__(self, name: str) -> typing.Any:
        return getattr(torch, name)


@pytest.fixture
def trl_on_cuda(monkeypatch: pytest.MonkeyPatch) -> typing.Any:
    """TRL's head, taking the decisions its code takes on a CUDA device with Triton; returns
    ``(add_fused_lm_head, set_autocast)``."""
    utils = pytest.importorskip("trl.trainer.utils")
    kernels = pytest.importorskip("trl.kernels.chunked_logprob")

    class _Launch:  # `kernel[grid](...)`: a Triton launch, which allocates nothing
        def __getitem__(self, grid: typing.Any) -> typing.Any:
            return lambda *a, **k: None

    class _Triton:
        @staticmethod
        def cdiv(a: int, b: int) -> int:
            return -(-a // b)

    monkeypatch.setattr(kernels, "_use_triton", lambda device: True)
    monkeypatch.setattr(utils, "_use_triton", lambda device: True)
    monkeypatch.setattr(kernels, "_forward_kernel", _Launch(), raising=False)
    monkeypatch.setattr(kernels, "_backward_kernel", _Launch(), raising=False)
    monkeypatch.setattr(kernels, "triton", _Triton, raising=False)
    monkeypatch.setattr(kernels, "_addmm_fp32", lambda acc, a, b: None)

    def set_autocast(dtype: torch.dtype | None) -> None:
        monkeypatch.setattr(kernels, "torch", _TorchUnderAutocast(dtype))

    return utils.add_fused_lm_head, set_autocast


@pytest.fixture
def small_llama() -> typing.Any:
    """Llama-3.1-8B's config cut to 2 layers of width 256, with a 40,000-entry vocabulary (two of
    TRL's 32,768-entry vocabulary tiles): a catalog-like spec for analytic-vs-trace checks."""
    from vramplan.models.catalog import resolve
    from vramplan.models.normalize import spec_from_config
    from vramplan.trace.testing import tiny_config

    c = tiny_config(dict(resolve("llama-3.1-8b").config), 2)
    c.update(hidden_size=256, intermediate_size=768, vocab_size=40000)
    return spec_from_config(c, name="small-llama", source="test")


_LONG_FILES_FIRST = ("test_web_browser.py",)
"""Files whose tests take the longest (the browser's burst test: a minute and more on 2 cores),
sent to the xdist workers first: collected in name order they came last and one worker ran them
alone at the end of the suite."""


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    """Send :data:`_LONG_FILES_FIRST` first, and mark the slow tier (:mod:`tiers`): ``make test``
    runs ``-m "not slow"``, ``make test-slow`` the rest. When the whole suite is collected, every
    entry of the list must still name a test (a renamed test would otherwise drop back into the
    fast tier unnoticed)."""
    import tiers

    items.sort(key=lambda item: item.path.name not in _LONG_FILES_FIRST)  # (stable: the rest keep their order)

    used: set[str] = set()
    for item in items:
        entry = tiers.slow_entry(item.nodeid)
        if entry is not None:
            item.add_marker(pytest.mark.slow)
            used.add(entry)
    whole = not config.args or [os.path.normpath(a) for a in config.args] == ["tests"]
    # (a module skipped whole at collection, e.g. the browser tests without Chromium, collects no test:
    # its entries are checked where it is collected; a renamed or removed file is caught here)
    files = {item.nodeid.split("::")[0] for item in items}
    unused = sorted(e for e in set(tiers.SLOW) - used
                    if e.split("::")[0] in files or not (config.rootpath / e.split("::")[0]).is_file())
    if whole and not config.option.keyword and unused:
        raise pytest.UsageError(f"tests/tiers.py names tests that do not exist: {', '.join(unused)}")
