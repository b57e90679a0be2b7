"""Other libraries' quantised formats (AWQ, GPTQ, HQQ, torchao, compressed-tensors): the table
of stored tensors and the traced forwards, against the real libraries where they run on the CPU.

The real layers are built in a child process with ``.quant-deps`` on its path (``make test``
installs it from requirements/quant.txt): tests/quant_probe.py prints what each one stores and
the peak of new storage its forward (and compressed-tensors' decompression) allocates; the same
measure runs here on vramplan's :class:`FormatLinear` with the same shapes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vramplan.errors import TraceError, WorkloadError
from vramplan.quantformats import FORMATS, stored, stored_bytes
from vramplan.trace.quantkernels import FormatLinear
from vramplan.trace.run import TraceOptions, trace_workload
from vramplan.trace.testing import tiny_spec
from vramplan.workload import Quant, Workload

ROOT = Path(__file__).resolve().parents[1]
DEPS = ROOT / ".quant-deps"
sys.path.insert(0, str(Path(__file__).parent))
import quant_probe as qp  # noqa: E402

NO_WS = TraceOptions(workspaces=False)
INFER = dict(task="infer", batch=2, seq=64, precision="bf16")


@pytest.fixture(scope="module")
def real() -> dict:
    if not DEPS.is_dir():
        pytest.skip(".quant-deps is not installed (make test installs it from requirements/quant.txt)")
    env = dict(os.environ, PYTHONPATH=str(DEPS))
    out = subprocess.run([sys.executable, str(Path(__file__).parent / "quant_probe.py")], env=env,
                         capture_output=True, text=True, timeout=600)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("QUANT-PROBE ")]
    assert line, out.stderr[-2000:]
    return json.loads(line[0].removeprefix("QUANT-PROBE "))


@pytest.mark.parametrize("q", list(qp.PROBES))
def test_stored_tensors_are_the_librarys(real, q: str) -> None:
    ours = stored(Quant(q), qp.D_IN, qp.D_OUT, "bfloat16")
    assert sorted((n, d, list(s)) for n, d, s in ours) == sorted(tuple(x) for x in real[q]["stored"])


def _ours(q: str) -> dict[str, int]:
    layer = FormatLinear(qp._linear(), Quant(q), torch.bfloat16)
    x = qp._x()
    out: dict[str, int] = {}
    if q.startswith("ct-"):
        out["decompress"] = qp.peak_of(layer.decompress, [x, *layer.buffers(), *layer.parameters()])
    out["forward"] = qp.peak_of(lambda: layer(x), [x, *layer.buffers(), *layer.parameters()])
    return out


@pytest.mark.parametrize("q", ["hqq", "ao-int8", "ao-fp8", "ct-w4a16", "ct-w8a8", "ct-fp8"])
def test_forward_allocates_what_the_library_allocates(real, q: str) -> None:
    ours, theirs = _ours(q), real[q]
    if "decompress" in theirs:
        assert ours["decompress"] == theirs["decompress"]
    # compressed-tensors' per-token qparams ([T, 1] scale and zero point) differ by a few hundred
    # bytes in how many small intermediates they keep; every input- and weight-sized tensor agrees
    slack = 1024 if q in ("ct-w8a8", "ct-fp8") else 0
    assert abs(ours["forward"] - theirs["forward"]) <= slack, (ours, theirs)


@pytest.fixture(scope="module")
def llama():
    """A 4-layer Llama of width 128 (the grouped formats quantise groups of 128 inputs)."""
    from vramplan.models.catalog import resolve
    from vramplan.models.normalize import spec_from_config
    from vramplan.trace.testing import tiny_config

    cfg = tiny_config(dict(resolve("llama-3.1-8b").config), 4)
    cfg.update(hidden_size=128, intermediate_size=256)
    return spec_from_config(cfg, name="tiny-llama-128", source="test")


LINEARS = [(128, 128), (128, 64), (128, 64), (128, 128), (128, 256), (128, 256), (256, 128)]  # q k v o gate up down


def _stored(q: Quant, **kw) -> int:
    return 4 * sum(stored_bytes(q, i, o, "bfloat16", **kw) for i, o in LINEARS)


@pytest.mark.parametrize("q", [q for q in FORMATS if q not in (Quant.AO_INT4, Quant.AO_FP8_DYN)])
def test_traced_weights_are_the_tables(llama, q: Quant) -> None:
    plain = trace_workload(llama, Workload(**INFER), options=NO_WS)
    r = trace_workload(llama, Workload(**INFER, quant=q), options=NO_WS)
    dense = 4 * sum(2 * i * o for i, o in LINEARS)
    decompressed = q in (Quant.CT_W4A16, Quant.CT_W8A8, Quant.CT_FP8)
    want = plain.breakdown_at_peak.weights - dense + _stored(q, decompressed=decompressed)
    assert r.breakdown_at_peak.weights == want
    assert any(FORMATS[q].library in n for n in r.notes)


def test_sm90_formats_trace_on_hopper_and_are_refused_before(llama) -> None:
    from vramplan.hardware.catalog import get_gpu
    from vramplan.hardware.target import device_profile

    h100, a100 = device_profile(get_gpu("h100-sxm")), device_profile(get_gpu("a100-sxm4-80gb"))
    for q in (Quant.AO_INT4, Quant.AO_FP8_DYN):
        r = trace_workload(llama, Workload(**INFER, quant=q), options=NO_WS, device=h100)
        assert r.breakdown_at_peak.weights < trace_workload(llama, Workload(**INFER), options=NO_WS,
                                                            device=h100).breakdown_at_peak.weights
        with pytest.raises(TraceError, match="sm80"):
            trace_workload(llama, Workload(**INFER, quant=q), options=NO_WS, device=a100)


def test_compressed_tensors_decompress_to_dense_weights_in_the_first_forward(llama) -> None:
    # transformers keeps the packed weights until the first forward, whose hook replaces each by
    # a dense one: the model ends up holding more than the bf16 model (the scales stay)
    plain = trace_workload(llama, Workload(**INFER), options=NO_WS)
    r = trace_workload(llama, Workload(**INFER, quant="ct-w4a16"), options=NO_WS)
    assert r.breakdown_at_peak.weights > plain.breakdown_at_peak.weights
    assert r.peak_allocated > plain.peak_allocated


def test_marlin_takes_its_reduce_scratch_per_call(llama) -> None:
    # GPTQModel's Marlin: fp32 c_tmp of SMs × min(ceil16(M), 64) × 256 for each call
    layer = FormatLinear(qp._linear(), Quant.GPTQ, torch.bfloat16, sm_count=132)
    x = qp._x()  # 256 rows: the 64-row tile
    peak = qp.peak_of(lambda: layer(x), [x, *layer.buffers(), *layer.parameters()])
    assert peak == 256 * qp.D_OUT * 2 + 132 * 64 * 256 * 4
    one = torch.zeros(1, qp.D_IN, dtype=torch.bfloat16)  # a decode row: a 16-row tile
    assert qp.peak_of(lambda: layer(one), [one, *layer.buffers()]) == qp.D_OUT * 2 + 132 * 16 * 256 * 4


def test_workload_and_analytic_refuse_what_is_not_modelled() -> None:
    from vramplan import estimate

    with pytest.raises(WorkloadError, match="LoRA over awq"):
        Workload(task="train", peft="lora", quant="awq", precision="bf16-mixed")
    with pytest.raises(WorkloadError, match="full training"):
        Workload(task="train", quant="gptq")
    with pytest.raises(WorkloadError, match="method=trace"):
        estimate("llama-3.1-8b", task="infer", quant="hqq", method="analytic")


EX = Path(__file__).parent / "examples"


@pytest.mark.parametrize("method,extra", [("awq", {}), ("gptq", {}), ("nf4", {"bnb_compute_dtype": "bf16"}),
                                          ("int8", {}), ("ct-w4a16", {}), ("ct-fp8", {})])
def test_from_pretrained_quantization_config_runs_as_its_estimate(method: str, extra: dict) -> None:
    # transformers' from_pretrained(quantization_config=…) under `vramplan run`: the same layers as
    # `estimate --quant`, the dense weights never on the device
    import vramplan

    r = vramplan.run_script(EX / "pretrained_quant.py", ["qwen2.5-0.5b", method, "1", "128"], gpu="h100-sxm")
    e = vramplan.estimate("qwen2.5-0.5b", task="infer", batch=1, seq=128, precision="bf16", quant=method,
                          method="trace", gpu="h100-sxm", **extra)
    assert abs(r.breakdown.weights - e.breakdown.weights) <= 1024  # (rotary inv_freq copies)
    assert abs(r.peak.allocated - e.peak.allocated) <= 0.005 * e.peak.allocated
    assert any(n.startswith("from_pretrained: ") for n in r.notes)


def test_quantization_configs_map_to_their_formats_or_stop_with_the_reason() -> None:
    from torch import nn

    from vramplan.script import quantized
    from vramplan.target import DeviceProfile

    h100 = DeviceProfile(name="h100", sm=(9, 0), sm_count=132)

    def kind(qc: dict) -> Quant | None:
        return quantized._kind(quantized.method(qc), qc)

    assert kind({"quant_method": "torchao", "quant_type": {"default": {"_type": "Int8WeightOnlyConfig"}}}) \
        is Quant.AO_INT8
    fp8 = {"num_bits": 8, "type": "float"}
    assert kind({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": fp8}}}) is Quant.CT_FP8
    assert kind({"quant_method": "compressed-tensors", "dequantize": True}) is None  # dense weights
    asym = {"num_bits": 4, "type": "int", "symmetric": False}
    with pytest.raises(TraceError, match="asymmetric"):
        kind({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": asym}}})
    with pytest.raises(TraceError, match="desc_act"):
        kind({"quant_method": "gptq", "bits": 4, "desc_act": True})
    with pytest.raises(TraceError, match="bits=8"):
        kind({"quant_method": "awq", "bits": 8})
    with pytest.raises(TraceError, match="quant_method=eetq"):
        kind({"quant_method": "eetq"})
    model = nn.Sequential(nn.Linear(64, 64))
    with pytest.raises(TraceError, match="cannot load HQQ"):
        quantized.apply(model, {"quant_method": "hqq"}, h100)
    notes = quantized.apply(model, {"quant_method": "gptq", "bits": 4, "group_size": 32}, h100)
    assert "GPTQModel" in notes[0] and model[0].scales.shape == (2, 64)  # the config's group size


def test_load_in_4bit_keyword_stops_as_transformers_5_stops(tmp_path) -> None:
    import vramplan

    script = tmp_path / "old.py"
    script.write_text("from transformers import AutoModelForCausalLM\n"
                      "m = AutoModelForCausalLM.from_pretrained('qwen2.5-0.5b', load_in_4bit=True)\n")
    with pytest.raises(TraceError, match="BitsAndBytesConfig"):
        vramplan.run_script(script, gpu="h100-sxm")


def test_layers_a_format_cannot_pack_and_unconverted_weights_are_refused() -> None:
    from torch import nn

    from vramplan.trace.quantkernels import quantize_format

    with pytest.raises(TraceError, match="packs out_features in multiples of 8"):
        quantize_format(nn.Sequential(nn.Linear(128, 30)), Quant.AWQ, torch.float16)
    with pytest.raises(TraceError, match="groups of 128"):
        quantize_format(nn.Sequential(nn.Linear(192, 64)), Quant.GPTQ, torch.float16)
    with pytest.raises(TraceError, match="no nn.Linear"):
        quantize_format(nn.Sequential(nn.ReLU()), Quant.HQQ, torch.bfloat16)
    moe = tiny_spec("mixtral-8x7b", layers=2)
    with pytest.raises(TraceError, match="fused MoE expert"):
        trace_workload(moe, Workload(**INFER, quant="hqq"), options=NO_WS)
    with pytest.raises(WorkloadError, match="16-bit"):
        Workload(task="infer", precision="fp32", quant="awq")


def test_config_details_reach_the_layers() -> None:
    from torch import nn

    from vramplan.script import quantized
    from vramplan.target import DeviceProfile

    h100 = DeviceProfile(name="h100", sm=(9, 0), sm_count=132)
    model = nn.Sequential(nn.Sequential(nn.Linear(128, 64), nn.Linear(128, 64)))
    notes = quantized.apply(model, {"quant_method": "gptq", "bits": 4, "group_size": -1,
                                    "modules_to_not_convert": ["0.1"]}, h100)
    assert "1 linear layers" in notes[0]
    assert model[0][0].scales.shape == (1, 64) and type(model[0][1]) is nn.Linear  # per-channel; full-name skip
    assert stored(Quant.GPTQ, 256, 512, "bfloat16", group=-1)[1] == ("scales", "bfloat16", (1, 512))
