"""PYTORCH_CUDA_ALLOC_CONF parsing: what PyTorch accepts, what it rejects and how it says so."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vramplan.allocator import AllocatorConfig, parse_conf
from vramplan.allocator.config import tokenize
from vramplan.allocator.constants import LARGE_BUFFER, NO_LIMIT
from vramplan.errors import ConfigError

MiB = 1024**2


def test_defaults():
    for s in ("", None, "   "):
        c = parse_conf(s)
        assert c == AllocatorConfig(text=(s or "").strip())
        assert c.max_split_size == NO_LIMIT and c.max_non_split_rounding_size == LARGE_BUFFER
        assert c.backend == "native" and not c.expandable_segments and c.describe() == ""


def test_tokenizer_matches_pytorch():
    assert tokenize(" a : 1 ,b:[2: 4,>:8] ") == ["a", ":", "1", ",", "b", ":", "[", "2", ":", "4",
                                                 ",", ">", ":", "8", "]"]


def test_full_string():
    c = parse_conf("max_split_size_mb:128, max_non_split_rounding_mb:64 ,garbage_collection_threshold:0.6,"
                   "expandable_segments:True,backend:native,per_process_memory_fraction:0.9,")
    assert c.max_split_size == 128 * MiB and c.max_non_split_rounding_size == 64 * MiB
    assert c.garbage_collection_threshold == 0.6 and c.expandable_segments
    assert c.per_process_memory_fraction == 0.9 and c.gc_active


def test_roundup_single_number_form():
    c = parse_conf("roundup_power2_divisions:4")
    assert set(c.roundup_power2_divisions) == {4}


def test_roundup_list_form():
    c = parse_conf("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]")
    d = c.roundup_power2_divisions
    # boundaries are in MiB: index log2(256) = 8; the first value also fills indices 0..7
    assert d[:8] == (1,) * 8 and d[8] == 1 and d[9] == 2 and d[10] == 4 and d[11:] == (8,) * 5
    assert c.divisions(600 * MiB) == 2 and c.divisions(100) == 1
    assert any("older releases" in n for n in c.notes)


def test_roundup_zero_disables_in_list_form():
    c = parse_conf("roundup_power2_divisions:[64:8,128:0,>:1]")
    assert c.roundup_power2_divisions[7] == 0 and c.roundup_power2_divisions[6] == 8


def test_backend_and_ignored_options():
    c = parse_conf("backend:cudaMallocAsync,pinned_use_cuda_host_register:True,"
                   "pinned_num_register_threads:8,release_lock_on_cudamalloc:False")
    assert c.backend == "cudaMallocAsync"
    assert c.ignored == ("pinned_use_cuda_host_register", "pinned_num_register_threads",
                         "release_lock_on_cudamalloc")
    assert any("accepted and ignored" in n for n in c.notes)


def test_large_segment_size_option():
    assert parse_conf("large_segment_size_mb:64").large_segment_size == 64 * MiB


@pytest.mark.parametrize("text,match", [
    ("max_split_size_mb:19", "max_split_size_mb too small, must be >= 20"),
    ("max_non_split_rounding_mb:5", "max_non_split_rounding_mb too small, must be >= 20"),
    ("large_segment_size_mb:10", "large_segment_size_mb must be > 10 MB"),
    ("garbage_collection_threshold:1.0", r"set it in \(0.0, 1.0\)"),
    ("garbage_collection_threshold:0", r"set it in \(0.0, 1.0\)"),
    ("roundup_power2_divisions:3", "divisions has to be power of 2"),
    ("roundup_power2_divisions:[300:2]", "intervals have to be power of 2"),
    ("roundup_power2_divisions:[256:3]", "power of 2 or 0"),
    ("roundup_power2_divisions:[256:2", "closing bracket"),
    ("expandable_segments:true", "Expected 'True' or 'False'"),
    ("expandable_segments:1", "Expected 'True' or 'False'"),
    ("backend:cudaMalloc", "Unknown allocator backend, options are native and cudaMallocAsync"),
    ("max_split_sz_mb:100", "Unrecognized key 'max_split_sz_mb'"),
    ("max_split_size_mb", "expected ':' after 'max_split_size_mb'"),
    ("max_split_size_mb:", "expecting max_split_size_mb value"),
    ("max_split_size_mb:lots", "invalid value 'lots'"),
    ("max_split_size_mb:100 expandable_segments:True", "invalid value"),
    ("max_split_size_mb:100;expandable_segments:True", "invalid value"),
    ("per_process_memory_fraction:1.5", r"set it in \[0.0, 1.0\]"),
    ("pinned_num_register_threads:3", "has to be power of 2"),
    ("pinned_num_register_threads:256", "less than or equal to 128"),
    ("max_split_size_mb:100,,expandable_segments:True", "Unrecognized key ','"),
])
def test_rejected_like_pytorch(text, match):
    with pytest.raises(ConfigError, match=match) as e:
        parse_conf(text)
    assert "\n" not in str(e.value)


def test_gc_without_fraction_is_noted():
    c = parse_conf("garbage_collection_threshold:0.5")
    assert not c.gc_active and any("no effect" in n for n in c.notes)


confs = st.fixed_dictionaries({}, optional={
    "max_split_size_mb": st.integers(20, 4096).map(str),
    "max_non_split_rounding_mb": st.integers(20, 512).map(str),
    "large_segment_size_mb": st.integers(11, 256).map(str),
    "garbage_collection_threshold": st.sampled_from(["0.1", "0.5", "0.75", "0.99"]),
    "roundup_power2_divisions": st.sampled_from(["1", "2", "4", "8", "16", "[1:2,>:4]",
                                                 "[256:1,512:2,1024:4,>:8]"]),
    "expandable_segments": st.sampled_from(["True", "False"]),
    "per_process_memory_fraction": st.sampled_from(["0.5", "0.9", "1"]),
})


@given(confs)
def test_describe_roundtrips(opts):
    text = ",".join(f"{k}:{v}" for k, v in opts.items())
    c = parse_conf(text)
    again = parse_conf(c.describe())
    for f in ("max_split_size", "max_non_split_rounding_size", "large_segment_size",
              "garbage_collection_threshold", "roundup_power2_divisions", "expandable_segments",
              "per_process_memory_fraction", "backend"):
        assert getattr(again, f) == getattr(c, f), f
