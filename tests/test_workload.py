import pytest
from hypothesis import given
from hypothesis import strategies as st

from vramplan.errors import WorkloadError
from vramplan.workload import Parallel, Peft, Precision, Quant, Task, Workload


def test_strings_become_enums():
    w = Workload(task="infer", precision="BF16", optimizer="adamw-8bit", checkpointing="full")
    assert w.task is Task.INFER and w.precision is Precision.BF16
    assert w.to_dict()["precision"] == "bf16"


@pytest.mark.parametrize("field", ["batch", "seq", "grad_accum", "lora_rank"])
@pytest.mark.parametrize("value", [0, -3, 1.5, True])
def test_sizes_must_be_positive_ints(field, value):
    with pytest.raises(WorkloadError, match=f"`{field}`") as e:
        Workload(**{field: value})
    assert e.value.field == field


def test_unknown_choice_lists_choices():
    with pytest.raises(WorkloadError) as e:
        Workload(precision="fp8-mixed")
    assert "bf16-mixed" in str(e.value) and "\n" not in str(e.value)


def test_qlora_rules():
    w = Workload(peft="qlora")
    assert w.quant is Quant.NF4
    with pytest.raises(WorkloadError, match="bf16-mixed"):
        Workload(peft="qlora", precision="fp32")
    with pytest.raises(WorkloadError, match="NF4"):
        Workload(peft="qlora", quant="int8")


def test_peft_only_for_training_and_quant_training_needs_peft():
    with pytest.raises(WorkloadError):
        Workload(task="infer", peft=Peft.LORA)
    with pytest.raises(WorkloadError, match="`peft=lora`"):
        Workload(task="train", quant="int4")
    assert Workload(task="infer", quant="int4").quant is Quant.INT4


def test_generate_defaults_new_tokens():
    assert Workload(task="generate").new_tokens == 128
    assert Workload(task="generate", new_tokens=7).new_tokens == 7


def test_parallel_validation():
    with pytest.raises(WorkloadError, match="`tp=2`"):
        Parallel(sp=True)
    with pytest.raises(WorkloadError, match="ZeRO"):
        Parallel(zero=4)
    with pytest.raises(WorkloadError, match="`zero=3`"):
        Parallel(offload_params=True, zero=2)
    with pytest.raises(WorkloadError):
        Workload(task="infer", parallel=Parallel(dp=8, zero=3))
    p = Parallel(dp=4, tp=2, pp=2, microbatches=0)
    assert p.world_size == 16 and p.in_flight == 2


def test_fused_only_where_torch_has_it():
    with pytest.raises(WorkloadError, match="fused"):
        Workload(optimizer="lion", optimizer_impl="fused")


def test_replace_routes_parallel_fields():
    w = Workload().replace(batch=8, dp=8, zero=3)
    assert w.batch == 8 and w.parallel.dp == 8 and w.parallel.zero == 3
    with pytest.raises(WorkloadError):
        Workload().replace(batch=0)


@given(batch=st.integers(1, 4096), seq=st.integers(1, 1 << 20))
def test_tokens(batch, seq):
    assert Workload(batch=batch, seq=seq).tokens == batch * seq


def test_auto_precision_depends_on_task():
    assert Workload(task="train").precision is Precision.BF16_MIXED
    assert Workload(task="infer").precision is Precision.BF16
    assert Workload(task="generate", precision="auto").precision is Precision.BF16
    assert Workload(task="infer", precision="fp32").precision is Precision.FP32
    # replace keeps the resolved precision rather than re-resolving it
    assert Workload(task="train").replace(batch=2).precision is Precision.BF16_MIXED
