"""Cloud instance prices: coverage, integrity, the p4d pitfall, filters."""

from __future__ import annotations

import pytest

from vramplan.errors import UnknownNameError
from vramplan.hardware.catalog import get_gpu
from vramplan.hardware.prices import cheapest, list_instances, providers


def test_providers_and_integrity():
    assert {"aws", "gcp", "azure", "lambda", "runpod"} <= set(providers())
    rows = list_instances()
    assert len(rows) >= 30
    for i in rows:
        assert get_gpu(i.gpu).key == i.gpu
        assert i.count >= 1 and i.usd_per_hour > 0
        assert i.source.strip() and i.date_read.strip() and i.region.strip()
    names = [(i.provider, i.name) for i in rows]
    assert len(names) == len(set(names))


def test_p4d_is_a100_40gb_and_p4de_80gb():
    by_name = {i.name: i for i in list_instances(provider="aws")}
    assert by_name["p4d.24xlarge"].gpu == "a100-sxm4-40gb"
    assert by_name["p4de.24xlarge"].gpu == "a100-sxm4-80gb"
    assert by_name["p4d.24xlarge"].usd_per_hour == pytest.approx(21.96)


def test_filters_and_per_gpu_price():
    h100 = list_instances(gpu="h100")
    assert h100 and all(i.gpu == "h100-sxm" for i in h100)
    p5 = next(i for i in h100 if i.name == "p5.48xlarge")
    assert p5.usd_per_gpu_hour == pytest.approx(55.04 / 8)
    assert {i.provider for i in list_instances(provider="Azure")} == {"azure"}
    best = cheapest("a100-80gb")
    assert best is not None
    assert best.usd_per_gpu_hour == min(i.usd_per_gpu_hour for i in list_instances(gpu="a100-80gb"))
    assert cheapest("rtx-3060") is None


def test_unknown_provider_and_gpu():
    with pytest.raises(UnknownNameError):
        list_instances(provider="aws2")
    with pytest.raises(UnknownNameError):
        list_instances(gpu="h999")
