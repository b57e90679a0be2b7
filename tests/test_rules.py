"""Rules beyond deep learning: arithmetic checked against hand computations of the formulas."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vramplan.cli.main import main
from vramplan.errors import UnknownNameError, VramplanError
from vramplan.hardware import rules
from vramplan.hardware.catalog import get_gpu, usable_capacity
from vramplan.units import GiB, TiB

# --- bandwidth ----------------------------------------------------------------------


def test_bandwidth_4090_is_1008_not_double():
    r = rules.bandwidth(384, 21, efficiency=0.9)
    assert r.values["peak_bytes_per_s"] == pytest.approx(1_008e9)
    assert r.values["effective_bytes_per_s"] == pytest.approx(907.2e9)
    assert r.values["double_counted_bytes_per_s"] == pytest.approx(2_016e9)
    assert r.steps[0].formula == "384 bit × 21 Gbps ÷ 8 = 1,008 GB/s"
    assert "rtx-4090" in r.values["matching_gpus"]
    assert any("Not × 2" in n for n in r.notes)


def test_bandwidth_from_nvml_clock():
    r = rules.bandwidth(6016, clock_mhz=2619)  # H100 NVL
    assert r.values["rate_gbps"] == pytest.approx(5.238)
    assert r.values["peak_bytes_per_s"] == pytest.approx(6016 / 8 * 2619 * 2 * 1e6)


@settings(max_examples=60, deadline=None)
@given(bus=st.integers(1, 16384), rate=st.floats(0.1, 40, allow_nan=False), eff=st.floats(0.05, 1.0))
def test_bandwidth_formula(bus, rate, eff):
    r = rules.bandwidth(bus, rate, efficiency=eff)
    assert r.values["peak_bytes_per_s"] == pytest.approx(bus * rate / 8 * 1e9)
    assert r.values["effective_bytes_per_s"] == pytest.approx(bus * rate / 8 * 1e9 * eff)


@pytest.mark.parametrize("args, kw", [
    ((0, 21), {}), ((384, -1), {}), ((384, 21), {"efficiency": 1.5}), ((384, None), {}),
    ((384, 21), {"clock_mhz": 1000}),
])
def test_bandwidth_rejects_bad_input(args, kw):
    with pytest.raises(VramplanError):
        rules.bandwidth(*args, **kw)


# --- render -------------------------------------------------------------------------


def test_render_4k_by_hand():
    r = rules.render(3840, 2160, color_format="rgba8", buffers=3, msaa=4, depth="d32",
                     textures=4 * GiB, bvh_triangles=10_000_000, fps=60, gpu="rtx-4090")
    v = r.values
    px = 3840 * 2160
    assert v["color_bytes"] == px * 4 * 3 == 99_532_800
    assert v["msaa_color_bytes"] == px * 4 * 4
    assert v["depth_bytes"] == px * 4 * 4
    assert v["bvh_bytes"] == 10_000_000 * 64
    assert v["total_bytes"] == 99_532_800 + 2 * px * 16 + 4 * GiB + 640_000_000
    # research/hardware.md: 4K RGBA8 at 60 fps = 1.99 GB/s (1.85 GiB/s) of frame writes
    assert v["final_frame_writes_bytes_per_s"] == px * 4 * 60 == 1_990_656_000
    assert v["final_frame_writes_bytes_per_s"] / GiB == pytest.approx(1.854, abs=1e-3)
    assert v["target_writes_bytes_per_s"] == px * (4 * 4 + 4 + 4 * 4) * 60
    assert v["write_share_of_bandwidth"] == pytest.approx(v["target_writes_bytes_per_s"] / 1_008e9)
    assert v["fits"] is True


@settings(max_examples=40, deadline=None)
@given(w=st.integers(1, 8192), h=st.integers(1, 8192), buffers=st.integers(1, 4),
       msaa=st.sampled_from(rules.MSAA_SAMPLES), fmt=st.sampled_from(list(rules.COLOR_FORMATS)),
       depth=st.sampled_from(list(rules.DEPTH_FORMATS)), tex=st.integers(0, 2**34))
def test_render_parts_sum(w, h, buffers, msaa, fmt, depth, tex):
    v = rules.render(w, h, color_format=fmt, buffers=buffers, msaa=msaa, depth=depth, textures=tex).values
    bpp, dbpp = rules.COLOR_FORMATS[fmt], rules.DEPTH_FORMATS[depth]
    assert v["color_bytes"] == w * h * bpp * buffers
    assert v["msaa_color_bytes"] == (w * h * bpp * msaa if msaa > 1 else 0)
    assert v["depth_bytes"] == w * h * dbpp * msaa
    assert v["total_bytes"] == v["color_bytes"] + v["msaa_color_bytes"] + v["depth_bytes"] + tex


@pytest.mark.parametrize("kw", [{"msaa": 3}, {"color_format": "rgb9"}, {"depth": "d8"}, {"fps": 0},
                                {"buffers": 0}, {"textures": -1}])
def test_render_rejects_bad_input(kw):
    with pytest.raises(VramplanError):
        rules.render(1920, 1080, **kw)


# --- video --------------------------------------------------------------------------


def test_video_per_session_by_hand_and_geforce_cap():
    r = rules.video("h264", "rtx-4090")
    frame = 1920 * 1088 * 3 // 2  # NV12, height aligned to 32
    assert frame == 3_133_440
    assert r.values["bytes_per_session"] == (4 + 4 + 2) * frame + 4 * (frame // 2) == 37_601_280
    assert r.values["driver_session_cap"] == 8
    assert r.values["sessions"] == 8  # memory would allow hundreds
    usable = usable_capacity(get_gpu("rtx-4090"))[0]
    assert r.values["sessions_by_memory"] < usable // 37_601_280


def test_video_datacentre_has_no_cap_and_h100_no_encoder():
    l4 = rules.video("hevc", "l4", width=3840, height=2160)
    assert l4.values["driver_session_cap"] is None
    assert l4.values["sessions"] == l4.values["sessions_by_memory"] > 8
    assert l4.values["nvenc_engines"] == 2
    h100 = rules.video("h264", "h100")
    assert h100.values["sessions"] == 0 and h100.values["codec_supported"] is False


def test_video_av1_needs_ada_and_b_frames_add_surfaces():
    assert rules.video("av1", "t4").values["codec_supported"] is False
    assert rules.video("av1", "l4").values["codec_supported"] is True
    frame = 1920 * 1088 * 3 // 2
    r = rules.video("hevc", "l4", b_frames=3)  # max(4, 4 x 4) = 16 surfaces
    assert r.values["bytes_per_session"] == (16 + 4 + 2) * frame + 16 * (frame // 2)
    r10 = rules.video("hevc", "l4", bit_depth=10)
    assert r10.values["bytes_per_session"] == 2 * rules.video("hevc", "l4").values["bytes_per_session"]


@pytest.mark.parametrize("args, kw", [(("vp9", "l4"), {}), (("h264", "mi300x"), {}),
                                      (("h264", "l4"), {"bit_depth": 12}), (("h264", "l4"), {"width": 0})])
def test_video_rejects_bad_input(args, kw):
    with pytest.raises(VramplanError):
        rules.video(*args, **kw)


# --- array --------------------------------------------------------------------------


def test_array_by_hand():
    r = rules.array("4096,4096,4096", "float64", working_set=3, gpu="h100")
    v = r.values
    assert v["array_bytes"] == 4096**3 * 8 == 512 * GiB
    assert v["needed_bytes"] == 3 * 512 * GiB == int(1.5 * TiB)
    assert v["fits"] is False
    assert v["gpus_needed"] == math.ceil(v["needed_bytes"] / v["available_bytes"])
    assert v["available_bytes"] == v["usable_bytes"] - v["context_bytes"]


def test_small_array_fits_and_shape_forms():
    v = rules.array("4096x4096", "bf16", gpu="rtx-4090").values
    assert v["array_bytes"] == 4096 * 4096 * 2 and v["fits"] is True
    assert rules.parse_shape("2, 3 ,4") == (2, 3, 4)
    assert "fits" not in rules.array((10,), "int8").values


@pytest.mark.parametrize("shape, dtype, ws", [("4096,-1", "float32", 1), ("a,b", "float32", 1),
                                              ("", "float32", 1), ("10", "float128", 1), ("10", "float32", 0)])
def test_array_rejects_bad_input(shape, dtype, ws):
    with pytest.raises(VramplanError):
        rules.array(shape, dtype, working_set=ws)


def test_array_unknown_gpu():
    with pytest.raises(UnknownNameError):
        rules.array("10", gpu="h999")


# --- CLI ----------------------------------------------------------------------------


def _run(capsys, argv):
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_bandwidth(capsys):
    code, out, _ = _run(capsys, ["rules", "bandwidth", "--bus", "384", "--rate", "21", "--efficiency", "0.9"])
    assert code == 0 and "384 bit × 21 Gbps ÷ 8 = 1,008 GB/s" in out and "907" in out
    code, out, _ = _run(capsys, ["rules", "bandwidth", "--bus", "384", "--rate", "21", "--json"])
    assert json.loads(out)["peak_bytes_per_s"] == pytest.approx(1.008e12)


def test_cli_render_format_takes_pixel_and_output_formats(capsys):
    argv = ["rules", "render", "--width", "3840", "--height", "2160", "--format", "rgba16f", "--buffers", "3",
            "--msaa", "4", "--depth", "d32", "--textures", "4GiB", "--bvh-triangles", "10M", "--fps", "60",
            "--gpu", "rtx-4090"]
    code, out, _ = _run(capsys, [*argv, "--format", "json"])
    d = json.loads(out)
    assert code == 0 and d["color_format"] == "rgba16f" and d["bvh_bytes"] == 640_000_000
    assert d["texture_bytes"] == 4 * GiB and isinstance(d["total_bytes"], int)
    code, out, _ = _run(capsys, [*argv, "--format", "markdown"])
    assert code == 0 and out.startswith("### Rendering memory")


def test_cli_video_and_array(capsys):
    code, out, _ = _run(capsys, ["rules", "video", "--codec", "h264", "--gpu", "rtx-4090"])
    assert code == 0 and "GeForce driver cap 8" in " ".join(out.split())
    code, out, _ = _run(capsys, ["rules", "array", "--shape", "4096,4096,4096", "--dtype", "float64",
                                 "--working-set", "3", "--gpu", "h100", "--json"])
    assert code == 0 and json.loads(out)["needed_bytes"] == 3 * 512 * GiB


@pytest.mark.parametrize("argv", [
    ["rules", "video", "--codec", "h264", "--gpu", "mi300x"],
    ["rules", "array", "--shape", "x", "--gpu", "h100"],
    ["rules", "bandwidth", "--bus", "384", "--rate", "21", "--efficiency", "2"],
    ["rules"],
])
def test_cli_errors_exit_2_on_one_line(capsys, argv):
    code, _, err = _run(capsys, argv)
    assert code == 2
    if argv != ["rules"]:
        assert err.startswith("error:") and "\n" not in err.strip()


def test_cli_usage_errors(capsys):
    for argv in (["rules", "render", "--width", "10", "--height", "10", "--format", "xyz"],
                 ["rules", "bandwidth", "--bus", "384"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        assert "\n" not in capsys.readouterr().err.strip()
