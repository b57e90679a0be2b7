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
            "*[m for m in ('torch', 'numpy', 'pathlib', 'difflib', 'vramplan.hardware.gpu', "
            "'vramplan.engine.boundary', 'vramplan.analytic.encoder', 'vramplan.analytic.vit') if m in sys.modules])")
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
              "print(iu.create_import_structure_from_path.cache_info().maxsize, "
              "getattr(iu.fetch__all__, '__wrapped__', None) is not None, hashlib.sha256(repr(("
              "sorted(m._class_to_module.items()), sorted(transformers._class_to_module.items()), "
              "sorted(dir(transformers)), sorted(dir(m)))).encode()).hexdigest())")


def test_transformers_import_structure_is_unchanged_by_the_wider_cache_and_the_trimmed_fetch() -> None:
    plain = _probe(_STRUCTURE.format(setup=""))
    wide = _probe(_STRUCTURE.format(setup="from vramplan.models.hf_import import import_transformers; "
                                          "import_transformers(); "))
    (plain_size, plain_fetch, plain_hash), (wide_size, wide_fetch, wide_hash) = plain.split(), wide.split()
    assert plain_size == "128" and wide_size == "None"  # the hook did act
    assert plain_fetch == "False" and wide_fetch == "True"
    assert wide_hash == plain_hash


def test_fetch_all_from_the_first_all_line_agrees_on_every_transformers_file() -> None:
    from pathlib import Path

    from transformers.utils import import_utils as iu

    from vramplan.models.hf_import import from_first_all_line

    fast, files = from_first_all_line(iu.fetch__all__), 0
    for path in sorted((Path(iu.__file__).parents[1]).rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        assert fast(text) == iu.fetch__all__(text), path
        files += "__all__" in text
    assert files > 1000


_LINES = st.sampled_from(["__all__ = ['A', 'B']", "__all__ = [", "    'A',", '    "B",', "]", "x = 1",
                          "  __all__ = ['C']", "# __all__ = ['D']", "", "__all__+= ['E']", "y = '__all__'"])
_BREAKS = st.sampled_from(["\n", "\r\n", "\r", "\x0b", "\x0c", "\x1c", "\x85", "\u2028"])


@given(st.lists(st.tuples(_LINES, _BREAKS), max_size=12), st.booleans())
def test_fetch_all_from_the_first_all_line_agrees_on_drawn_files(lines: list[tuple[str, str]], last_break: bool
                                                                   ) -> None:
    from transformers.utils import import_utils as iu

    from vramplan.models.hf_import import first_all_line, from_first_all_line

    text = "".join(line + br for line, br in lines)
    if lines and not last_break:
        text = text[: -len(lines[-1][1])]
    assert from_first_all_line(iu.fetch__all__)(text) == iu.fetch__all__(text)
    at = first_all_line(text)
    starts = [i for i, line in enumerate(text.splitlines()) if line.startswith("__all__")]
    assert (at is None) == (not starts)
    if at is not None:
        assert text[at:].splitlines() == text.splitlines()[starts[0]:]


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
