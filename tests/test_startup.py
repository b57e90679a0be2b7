"""Start-up work avoided without changing a result: each shortcut against what it replaces."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from vramplan.trace.analysis import _distinct


@given(hnp.arrays(st.sampled_from([np.int8, np.int16, np.int64]), st.integers(0, 200),
                  elements=st.integers(-128, 127)))
def test_distinct_is_np_unique(x: np.ndarray) -> None:
    got, want = _distinct(x), np.unique(x)
    assert got.dtype == want.dtype and got.tolist() == want.tolist()


@given(hnp.arrays(np.int64, st.integers(1, 50), elements=st.integers(-(2**40), 2**40)))
def test_distinct_of_a_wide_range_is_np_unique(x: np.ndarray) -> None:
    assert _distinct(x).tolist() == np.unique(x).tolist()


def test_a_trace_summary_does_not_import_numpy_ma() -> None:
    code = ("import sys; import numpy as np; from vramplan.trace.analysis import _distinct; "
            "_distinct(np.array([3, 1, 3], dtype=np.int64)); print('numpy.ma' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "False"


def _probe(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    return out.stdout.strip()


def test_the_analytic_command_imports_only_what_it_uses() -> None:
    code = ("import io, sys; from vramplan.cli.main import main; from vramplan import workload; "
            "sys.stdout = io.StringIO(); rc = main(['estimate', 'llama-3.1-8b', '--method', 'analytic']); "
            "sys.stdout = sys.__stdout__; "
            "print(rc, workload._module_field_docs.cache_info().misses, "
            "*[m for m in ('torch', 'numpy', 'pathlib', 'difflib') if m in sys.modules])")
    assert _probe(code) == "0 0"  # no flag help read from workload.py's source, none of those imported


@pytest.mark.parametrize("flag", ["--help", "--hel", "-h"])
def test_help_still_shows_each_flags_docstring(flag: str) -> None:
    from vramplan.workload import Workload, field_docs

    code = f"from vramplan.cli.main import build_parser; build_parser(['estimate', {flag!r}]).parse_args(['estimate', {flag!r}])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0
    assert " ".join(field_docs(Workload)["batch"].split()[:4]) in " ".join(out.stdout.split())


_STRUCTURE = ("import hashlib, sys; {setup}import transformers.models.llama.modeling_llama; "
              "import transformers, transformers.models as m; "
              "from transformers.utils import import_utils as iu; "
              "print(iu.create_import_structure_from_path.cache_info().maxsize, hashlib.sha256(repr(("
              "sorted(m._class_to_module.items()), sorted(transformers._class_to_module.items()), "
              "sorted(dir(transformers)), sorted(dir(m)))).encode()).hexdigest())")


def test_transformers_import_structure_is_unchanged_by_the_wider_cache() -> None:
    plain = _probe(_STRUCTURE.format(setup=""))
    wide = _probe(_STRUCTURE.format(setup="from vramplan.models.hf_import import import_transformers; "
                                          "import_transformers(); "))
    (plain_size, plain_hash), (wide_size, wide_hash) = plain.split(), wide.split()
    assert plain_size == "128" and wide_size == "None"  # the hook did act
    assert wide_hash == plain_hash


def test_the_finder_is_removed_and_a_second_call_imports_nothing() -> None:
    code = ("import sys; from vramplan.models.hf_import import _WidenCache, import_transformers; "
            "a = import_transformers(); b = import_transformers(); "
            "print(a is b, any(isinstance(f, _WidenCache) for f in sys.meta_path))")
    assert _probe(code) == "True False"


def test_widen_leaves_anything_else_alone() -> None:
    import functools
    import types

    from vramplan.models.hf_import import widen

    mod = types.ModuleType("m")
    assert not widen(mod)
    mod.create_import_structure_from_path = functools.cache(lambda p: p)  # already unbounded
    assert not widen(mod)
    mod.create_import_structure_from_path = functools.lru_cache(lambda p: [p])
    assert widen(mod) and mod.create_import_structure_from_path.cache_info().maxsize is None
    assert mod.create_import_structure_from_path("x") == ["x"]


def test_reports_print_colon_words_as_text_without_rich_emoji_table() -> None:
    code = ("import io, sys; from vramplan.report.doc import Doc, Notes; from vramplan.report.render import emit; "
            "buf = io.StringIO(); emit(Doc('t', [Notes(['mesh dp:x:tp, :warning:'])]), 'table', buf); "
            "print(':x:' in buf.getvalue(), ':warning:' in buf.getvalue(), 'rich._emoji_codes' in sys.modules)")
    assert _probe(code) == "True True False"
