"""Whole diffusers pipelines from the catalog (issue 32): their published configs and exact
parameter counts, one call traced as `vramplan run` traces a script and compared with the same
script run for real on the CPU, the part of the call the peak falls in, the CLI."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import vramplan
from vramplan.engine.diffusion import estimate_pipeline, peak_part
from vramplan.engine.resolve import resolve_gpu
from vramplan.errors import WorkloadError
from vramplan.models import pipeline_run
from vramplan.models.pipelines import (
    PipelineConfigs,
    build_pipeline,
    count_component_params,
    pipeline_entries,
    pipeline_folder,
    read_pipeline,
)
from vramplan.workload import Workload

pytest.importorskip("diffusers")
CONFIGS = Path(vramplan.__file__).parent / "models" / "configs"
DRIVER = Path(pipeline_run.__file__)


def _built_counts(cfg: PipelineConfigs) -> tuple[dict[str, int], dict[str, int]]:
    """Each model's parameters, and the values its checkpoint stores: the parameters (shared ones
    once) and its persistent buffers (a safetensors total counts both: SD3's pos_embed)."""
    import torch

    with torch.device("meta"):
        pipe = build_pipeline(cfg, torch.float32)
    params, stored = {}, {}
    for key in cfg.components:
        m = getattr(pipe, key, None)
        if isinstance(m, torch.nn.Module):
            params[key] = sum(p.numel() for p in m.parameters())
            unique = {id(t): t.numel() for t in m.state_dict(keep_vars=True).values()}
            stored[key] = sum(unique.values())
    return params, stored


@pytest.mark.parametrize("alias", list(pipeline_entries()))
def test_each_pipeline_component_has_its_exact_count_and_published_figure(alias: str) -> None:
    entry = pipeline_entries()[alias]
    cfg = read_pipeline(entry.path)
    params, stored = _built_counts(cfg)
    assert set(params.items()) == {(k, c.params) for k, c in entry.components.items()}
    for name, c in entry.components.items():
        assert c.published_source, name
        if c.published_kind == "exact":  # a checkpoint's total: the parameters and the persistent buffers
            assert stored[name] == c.published_params, name
        elif c.published_kind == "rounded":  # the published figure's precision: its 2 or 3 significant digits
            assert c.published_params is not None
            digits = len(str(c.published_params).rstrip("0"))
            assert round(c.params, digits - len(str(c.params))) == c.published_params, name
        else:
            assert c.published_kind == "none" and c.published_params is None
    assert pipeline_folder(alias) == entry.path and pipeline_folder(alias.upper()) == entry.path


def test_the_flux_pipelines_transformer_is_the_catalogs_flux_transformer() -> None:
    # two verbatim copies of the same published file: one home for the figure, byte for byte
    pipe = (CONFIGS / "pipelines" / "flux1-dev" / "transformer" / "config.json").read_bytes()
    assert pipe == (CONFIGS / "flux1-dev-transformer.json").read_bytes()
    entry = pipeline_entries()["flux.1-dev-pipeline"]
    assert entry.components["transformer"].params == vramplan.models.resolve("flux.1-dev").params


def _tiny_flux(root: Path) -> Path:
    """FLUX.1-dev's published configs with every width cut (the zoo's diffusers_flux.py sizes):
    the same pipeline class, components, scheduler and layer kinds."""
    src = CONFIGS / "pipelines" / "flux1-dev"
    out = root / "tiny-flux"
    shutil.copytree(src, out)
    cut = {
        "text_encoder": {"vocab_size": 303, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                         "num_attention_heads": 2, "projection_dim": 32, "pad_token_id": 0, "bos_token_id": 2,
                         "eos_token_id": 1},
        "text_encoder_2": {"vocab_size": 303, "d_model": 64, "d_kv": 32, "d_ff": 128, "num_layers": 2,
                           "num_decoder_layers": 2, "num_heads": 2},
        "transformer": {"num_layers": 1, "num_single_layers": 2, "attention_head_dim": 16, "num_attention_heads": 4,
                        "joint_attention_dim": 64, "pooled_projection_dim": 32, "axes_dims_rope": [4, 6, 6]},
        "vae": {"block_out_channels": [16, 32, 32, 32], "layers_per_block": 1, "norm_num_groups": 8,
                "sample_size": 128},
    }
    for name, changes in cut.items():
        file = out / name / "config.json"
        file.write_text(json.dumps(json.loads(file.read_text()) | changes))
    return out


def test_a_tiny_flux_pipeline_estimate_matches_its_real_cpu_run(tmp_path: Path) -> None:
    from vramplan.script.truth import compare, cpu_truth

    folder = _tiny_flux(tmp_path)
    w = Workload(task="infer", precision="fp32", image_size=256, denoising_steps=4)
    r = estimate_pipeline("tiny-flux", folder, w, resolve_gpu("h100-sxm"), workspaces=False)
    truth = cpu_truth(DRIVER, [str(folder), "--size", "256", "--steps", "2", "--dtype", "fp32"], steps=1 << 30)
    c = compare(r, truth)
    assert c.unexplained == 0 and c.residual == 0, (c.only_predicted[:6], c.only_truth[:6])  # the same storages
    assert 0 <= c.rounding <= (1 << 20) * len(truth.at_peak)  # the allocator's 512-byte blocks
    assert r.params == sum(count_component_params(read_pipeline(folder)).values())
    assert "the peak is in the VAE decode (Decoder)" in r.notes[0]  # (the 256-pixel image in fp32)
    assert "4 denoising steps (given): 2 traced" in r.notes[1]


def test_the_peak_does_not_grow_with_denoising_steps(tmp_path: Path) -> None:
    folder = _tiny_flux(tmp_path)
    args = [str(folder), "--size", "64", "--dtype", "fp32"]
    two, four = (vramplan.run_script(DRIVER, [*args, "--steps", n], gpu="h100-sxm", steps=1 << 30)
                 for n in ("2", "4"))
    assert two.ran is not None and four.ran is not None and four.ran.forwards == two.ran.forwards + 2
    assert (four.peak.allocated, four.peak.reserved) == (two.peak.allocated, two.peak.reserved)


def test_peak_part_names_the_call_the_peak_falls_in() -> None:
    cfg = read_pipeline(CONFIGS / "pipelines" / "flux1-dev")
    calls = [("CLIPTextModel", 0, 10), ("T5EncoderModel", 10, 40), ("FluxTransformer2DModel", 45, 90),
             ("FluxTransformer2DModel", 92, 140), ("Decoder", 150, 200)]
    assert peak_part(calls, 20, cfg) == "text encoding (T5EncoderModel, text_encoder_2)"
    assert peak_part(calls, 100, cfg) == "denoising step 2 (FluxTransformer2DModel)"
    assert peak_part(calls, 160, cfg) == "the VAE decode (Decoder)"
    assert peak_part(calls, 145, cfg) == ("the pipeline's own code between denoising step 2 "
                                          "(FluxTransformer2DModel) and the VAE decode (Decoder)")
    assert peak_part(calls, 250, cfg) == "the pipeline's own code after the VAE decode (Decoder)"


def test_pipeline_fields_are_refused_where_they_do_not_apply() -> None:
    with pytest.raises(WorkloadError, match="cpu_offload=model"):
        vramplan.estimate("llama-3.2-1b", Workload(cpu_offload="model"), method="analytic")
    with pytest.raises(WorkloadError, match="task=infer"):
        vramplan.estimate("flux.1-dev-pipeline", Workload(task="train"))
    with pytest.raises(WorkloadError, match="no closed-form"):
        vramplan.estimate("flux.1-dev-pipeline", Workload(task="infer"), method="analytic")
    with pytest.raises(WorkloadError, match="`seq=512` does not apply"):
        vramplan.estimate("flux.1-dev-pipeline", Workload(task="infer", seq=512))


@pytest.mark.slow
def test_the_cli_estimates_the_full_size_flux_pipeline(capsys: pytest.CaptureFixture[str]) -> None:
    from vramplan.cli.main import main

    assert main(["estimate", "flux.1-dev-pipeline", "--image-size", "1024", "--gpu", "h100-sxm", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["workload"]["task"] == "infer" and d["workload"]["precision"] == "bf16"  # (no --task: the call)
    assert d["params"] == pipeline_entries()["flux.1-dev-pipeline"].params == 16_870_599_139
    weights = 2 * d["params"]  # every model resident in bf16 (pipe.to("cuda")), CLIP's position ids besides
    assert weights <= d["breakdown"]["weights"] < weights + (1 << 20)
    assert any(n.startswith("the peak is in the VAE decode") for n in d["notes"])
    assert d["fits"]


def _tiny_wan(root: Path) -> Path:
    """A WanPipeline folder at a small width (the zoo's diffusers_wan.py sizes: these configs are
    the test's own, not published ones): the UMT5 encoder, the 3-D transformer, the causal 3-D VAE
    with Wan's 4x temporal and 8x spatial compression."""
    out = root / "tiny-wan"
    files = {
        "model_index.json": {"_class_name": "WanPipeline", "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
                             "text_encoder": ["transformers", "UMT5EncoderModel"],
                             "tokenizer": ["transformers", "T5TokenizerFast"],
                             "transformer": ["diffusers", "WanTransformer3DModel"],
                             "vae": ["diffusers", "AutoencoderKLWan"]},
        "scheduler/scheduler_config.json": {"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 3.0},
        "text_encoder/config.json": {"model_type": "umt5", "vocab_size": 303, "d_model": 64, "d_kv": 16, "d_ff": 128,
                                     "num_layers": 2, "num_heads": 4, "pad_token_id": 0, "eos_token_id": 1,
                                     "decoder_start_token_id": 0, "feed_forward_proj": "gated-gelu"},
        "transformer/config.json": {"_class_name": "WanTransformer3DModel", "num_attention_heads": 4,
                                    "attention_head_dim": 16, "in_channels": 16, "out_channels": 16, "text_dim": 64,
                                    "freq_dim": 32, "ffn_dim": 128, "num_layers": 2, "rope_max_seq_len": 256},
        "vae/config.json": {"_class_name": "AutoencoderKLWan", "base_dim": 16, "z_dim": 16, "dim_mult": [1, 2, 4, 4],
                            "num_res_blocks": 1, "temperal_downsample": [False, True, True]},
    }
    for name, data in files.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(json.dumps(data))
    return out


def test_a_tiny_wan_video_pipeline_estimate_matches_its_real_cpu_run(tmp_path: Path) -> None:
    from vramplan.script.truth import compare, cpu_truth

    folder = _tiny_wan(tmp_path)
    w = Workload(task="infer", precision="fp32", image_size=128, frames=10, denoising_steps=4)
    r = estimate_pipeline("tiny-wan", folder, w, resolve_gpu("h100-sxm"), workspaces=False)
    truth = cpu_truth(DRIVER, [str(folder), "--size", "128", "--frames", "10", "--steps", "2", "--dtype", "fp32"],
                      steps=1 << 30)
    c = compare(r, truth)
    assert c.unexplained == 0 and c.residual == 0, (c.only_predicted[:6], c.only_truth[:6])  # the same storages
    assert 0 <= c.rounding <= (1 << 20) * len(truth.at_peak)
    # diffusers rounds 10 frames to 9 (num_frames - 1 a multiple of 4): the VAE decodes 3 latent frames
    assert "the peak is in the VAE decode (WanDecoder3d)" in r.notes[0]
    assert "9 frames (`frames=10` rounded as WanPipeline rounds it" in r.notes[0] and "128 × 128 pixels" in r.notes[0]


def test_wan_takes_its_own_default_size_and_frames() -> None:
    cfg = read_pipeline(_tiny_wan_cfg_root())
    from vramplan.engine.diffusion import _frames_text, _size, call_defaults

    call = call_defaults(cfg)
    assert (call["width"], call["height"], call["num_frames"], call["num_inference_steps"]) == (832, 480, 81, 50)
    assert _size(Workload(task="infer"), call) == (832, 480, True)
    assert _size(Workload(task="infer", image_size=224, image_height=224), call) == (224, 224, False)
    assert _size(Workload(task="infer", image_size=1024), call_defaults(read_pipeline(CONFIGS / "pipelines" /
                                                                                        "flux1-dev"))) \
        == (1024, 1024, False)
    assert _frames_text(cfg, 0, 81) == "81 frames (the pipeline's default)"
    assert _frames_text(cfg, 80, 81).startswith("81 frames (`frames=80` rounded")  # 80 // 4 * 4 + 1
    assert _frames_text(cfg, 78, 81).startswith("77 frames (`frames=78` rounded")


_TINY_WAN_ROOT: list[Path] = []


def _tiny_wan_cfg_root() -> Path:
    import tempfile

    if not _TINY_WAN_ROOT:
        _TINY_WAN_ROOT.append(_tiny_wan(Path(tempfile.mkdtemp())))
    return _TINY_WAN_ROOT[0]


def test_peak_part_names_the_guided_call_within_a_wan_step() -> None:
    cfg = read_pipeline(_tiny_wan_cfg_root())
    calls = [("UMT5EncoderModel", 0, 10), ("UMT5EncoderModel", 10, 20), ("WanTransformer3DModel", 25, 40),
             ("WanTransformer3DModel", 40, 55), ("WanTransformer3DModel", 60, 75), ("WanTransformer3DModel", 75, 90),
             ("WanCausalConv3d", 95, 96), ("WanDecoder3d", 96, 120)]
    assert peak_part(calls, 45, cfg, 2) == "denoising step 1 (WanTransformer3DModel, call 2 of 2)"
    assert peak_part(calls, 61, cfg, 2) == "denoising step 2 (WanTransformer3DModel, call 1 of 2)"
    assert peak_part(calls, 100, cfg, 2) == "the VAE decode (WanDecoder3d)"
    assert peak_part(calls, 5, cfg, 2) == "text encoding (UMT5EncoderModel, text_encoder)"


def test_frames_are_refused_where_they_do_not_apply(tmp_path: Path) -> None:
    with pytest.raises(WorkloadError, match="`frames=33` applies to a whole diffusers pipeline"):
        vramplan.estimate("llama-3.2-1b", Workload(frames=33), method="analytic")
    with pytest.raises(WorkloadError, match="`frames=33`: FluxPipeline makes images"):
        estimate_pipeline("tiny-flux", _tiny_flux(tmp_path), Workload(task="infer", frames=33), None)
    with pytest.raises(WorkloadError, match="`frames` must be an integer >= 0"):
        Workload(frames=-1)


@pytest.mark.parametrize(("args", "message"), [
    (["estimate", "flux.1-dev-pipeline", "--frames", "33"], "--frames 33: FluxPipeline makes images"),
    (["estimate", "llama-3.2-1b", "--frames", "33"], "--frames 33 applies to a whole diffusers pipeline"),
    (["estimate", "flux.1-dev-pipeline", "--frames", "-1"], "--frames must be an integer >= 0"),
])
def test_the_cli_refuses_frames_in_one_line(args: list[str], message: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    from vramplan.cli.main import main

    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err  # one line (the hint in parentheses), no traceback
