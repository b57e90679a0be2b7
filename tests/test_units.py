import pytest
from hypothesis import given
from hypothesis import strategies as st

from vramplan.errors import VramplanError
from vramplan.units import GB, GiB, MiB, fmt_bytes, parse_bytes


@pytest.mark.parametrize("text,expected", [
    ("80GiB", 80 * GiB), ("80 GB", 80 * GB), ("512MiB", 512 * MiB), ("1.5g", int(1.5 * GiB)),
    ("1024", 1024), (2048, 2048), ("20m", 20 * MiB),
])
def test_parse(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["", "GiB", "12 parsecs", "-1GB", "1..2GB", True])
def test_parse_rejects(bad):
    with pytest.raises(VramplanError):
        parse_bytes(bad)


def test_fmt_names_unit():
    assert fmt_bytes(80 * GiB) == "80.00 GiB"
    assert fmt_bytes(80 * GB, "GB") == "80.00 GB"
    assert fmt_bytes(3 * MiB, "auto") == "3.00 MiB"


@given(st.integers(0, 1 << 50))
def test_roundtrip_bytes(n):
    assert parse_bytes(str(n)) == n
