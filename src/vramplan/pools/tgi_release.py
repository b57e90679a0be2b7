"""What changed in TGI's start-up sizing across its 3.x releases (CUDA), for ``serve-plan --engine
tgi --engine-version``: :class:`TgiRelease`.

Read at the tags v3.0.0 … v3.3.7 of huggingface/text-generation-inference (every 3.x tag;
``docs/research/sglang-version-history.md`` § TGI cites the lines). Paths are in the repository.

Every 3.x release: ``num_blocks = int(free // total_cache_size) + batch_num_blocks`` with
``free = get_free_memory(device, MEMORY_FRACTION × TGI_WIGGLE_ROOM)`` = CUDA free − (1 −
fraction × wiggle) × CUDA total, measured after the warm-up prefill (its peak still reserved)
(server/text_generation_server/models/flash_causal_lm.py ``warmup``;
server/text_generation_server/utils/import_utils.py ``get_free_memory``); ``--cuda-memory-fraction``
1.0 (launcher/src/main.rs); ``BLOCK_SIZE`` 256 flashdecoding, 1 flashinfer, 16 paged
(server/text_generation_server/models/globals.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from vramplan.errors import WorkloadError

OLDEST = "3.0.0"
NEWEST = "3.3.7"
RELEASES = ("3.3.7", "3.3.6", "3.3.5", "3.3.4", "3.3.3", "3.3.2", "3.3.1", "3.3.0", "3.2.3", "3.2.2", "3.2.1",
            "3.2.0", "3.1.1", "3.1.0", "3.0.2", "3.0.1", "3.0.0")

_RE = re.compile(r"^v?(\d+)\.(\d+)(?:\.(\d+))?$")


def parse(text: str) -> tuple[int, int, int]:
    m = _RE.match((text or "").strip().lower())
    if not m:
        raise WorkloadError(f"invalid TGI version {text!r}", hint=f"e.g. `engine_version={NEWEST}` or 3.2",
                            field="engine_version")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


@dataclass(frozen=True)
class TgiRelease:
    text: str
    v: tuple[int, int, int]

    @classmethod
    def of(cls, text: str | None) -> TgiRelease:
        text = (text or NEWEST).strip()
        v = parse(text)
        if v < parse(OLDEST) or v > parse(NEWEST):
            raise WorkloadError(f"TGI {text} is not modelled: serve-plan follows TGI's sizing from {OLDEST} to {NEWEST}",
                                hint=f"use `engine_version` {OLDEST} … {NEWEST} (or leave it out)",
                                field="engine_version")
        return cls(text, v)

    def since(self, text: str) -> bool:
        return self.v >= parse(text)

    @property
    def wiggle_room(self) -> float:
        """``TGI_WIGGLE_ROOM`` (models/globals.py): 0.95 to 3.0.2, 0.93 from 3.1.0, 0.90 from 3.3.0."""
        if self.since("3.3.0"):
            return 0.90
        return 0.93 if self.since("3.1.0") else 0.95

    def card_tflops(self, gpu_key: str) -> int | None:
        """The launcher's f16 TFLOP/s for the card nvidia-smi names (launcher/src/main.rs
        ``impl From<&str> for Gpu`` and ``ComputeType::f16_flop``; v3.0.0:1648-1698, v3.1.0:1651-1714):
        the name is nvidia-smi's ``gpu_name`` lower-cased with spaces as dashes, so a GeForce card
        ("nvidia-geforce-rtx-4090"), a Tesla T4 ("tesla-t4") or an H100 PCIe is an unknown card (None)."""
        names = _CARDS_3_1 if self.since("3.1.0") else _CARDS_3_0
        return names.get(gpu_key)


# vramplan GPU key → the launcher's f16 TFLOP/s, for the nvidia-smi names the launcher matches
# ("NVIDIA H100 80GB HBM3" → "nvidia-h100-80gb-hbm3" …; hardware/catalog.py _NVML_NAMES gives each name).
_CARDS_3_0 = {"l4": 121, "l40": 181, "l40s": 363, "a10g": 125, "h100-sxm": 900, "a100-sxm4-80gb": 312}
_CARDS_3_1 = {**_CARDS_3_0, "h100-nvl": 900, "a100-sxm4-40gb": 312, "a100-pcie-80gb": 312,
              "h200-sxm": 989}
