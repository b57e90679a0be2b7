"""``vramplan serve-plan MODEL``: an inference server's start-up sizing of its KV-cache pool."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

from .common import add_output_args, hint

ENGINES = ("vllm", "sglang", "tgi", "trtllm")


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _limits(text: str) -> dict[str, int]:
    """``--limit-mm-per-prompt`` as vLLM takes it: JSON (``'{"image": 1, "video": 0}'``) or the older
    ``image=1,video=0``."""
    try:
        got = json.loads(text) if text.strip().startswith("{") else {
            k.strip(): int(v) for k, v in (t.split("=", 1) for t in text.split(",") if t.strip())}
    except ValueError:
        raise argparse.ArgumentTypeError(f'expected \'{{"image": 1, "video": 0}}\' or image=1,video=0, got {text!r}') \
            from None
    if not isinstance(got, dict):
        raise argparse.ArgumentTypeError(f'expected \'{{"image": 1, "video": 0}}\', got {text!r}')
    return got


def _json_object(example: str) -> Callable[[str], dict[str, object]]:
    """An argparse type: a JSON object (``example`` in the message when it is not one)."""

    def parse(text: str) -> dict[str, object]:
        try:
            got = json.loads(text)
        except ValueError:
            got = None
        if not isinstance(got, dict):
            raise argparse.ArgumentTypeError(f"expected a JSON object such as '{example}', got {text!r}")
        return got

    return parse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve-plan", help="plan an inference server's KV-cache pool (vLLM, SGLang, TGI, TensorRT-LLM)",
        description="The figures the engine would log at start-up (weights, profile peak, KV cache GiB, "
        "blocks, tokens, maximum concurrency) or its own error when it would not start; the largest "
        "context that starts; the cheapest GPU/instance and TP size for a target.",
    )
    p.add_argument("model", help="catalog alias (llama-3.1-8b), Hub id, or path to a config.json")
    p.add_argument("--gpu", help="catalog GPU (see `vramplan gpus`); not needed with --cheapest")
    p.add_argument("--engine", choices=(*ENGINES, "all"), default="vllm",
                   help="serving engine (default vllm); all: the four side by side")
    g = p.add_argument_group("engine settings (engine defaults when omitted)")
    g.add_argument("--engine-version", help="the release to follow (default the newest): vLLM 0.9.2 … 0.34.0, "
                   "SGLang 0.4.6 … 0.5.23, TGI 3.0.0 … 3.3.7")
    g.add_argument("--kv-offloading-size", type=float,
                   help="vLLM ≥ 0.11.1: GiB of host KV tier over all ranks (host RAM, tokens, /dev/shm)")
    g.add_argument("--kv-offloading-backend", default="native", choices=["native", "lmcache"],
                   help="vLLM: the tier's backend (default native)")
    g.add_argument("--no-enable-extensible-kv-cache", dest="extensible_kv_cache", action="store_const", const=False,
                   default=None, help="vLLM 0.34: size the KV cache from the profile, not after warm-up and capture")
    g.add_argument("--tp", "--tensor-parallel-size", "--num-shard", dest="tp", type=int, default=1,
                   help="tensor-parallel GPUs (default 1)")
    g.add_argument("--pp", "--pipeline-parallel-size", dest="pp", type=int, default=1,
                   help="pipeline-parallel stages (default 1)")
    g.add_argument("--dp", "--data-parallel-size", dest="data_parallel_size", type=int, default=1,
                   help="vLLM: engine replicas of --tp GPUs each (default 1); MoE experts span tp × dp")
    g.add_argument("--enable-expert-parallel", action="store_true",
                   help="vLLM, MoE: whole experts split over tp × dp GPUs instead of every expert TP-sharded")
    g.add_argument("--all2all-backend", choices=["naive", "allgather_reducescatter", "deepep_high_throughput",
                                                 "deepep_low_latency", "pplx"],
                   help="vLLM EP with --dp > 1: the token exchange (default the release's)")
    g.add_argument("--num-redundant-experts", type=int, default=0,
                   help="vLLM EPLB: extra physical experts (implies --enable-eplb)")
    g.add_argument("--routing", choices=["even", "worst"], default="even",
                   help="vLLM EP: token routing for the buffers that depend on it (worst: the whole batch to one "
                        "rank's experts; default even)")
    g.add_argument("--quantization", "--quantize", dest="quantization", default="none",
                   choices=["none", "fp8", "awq", "gptq", "bitsandbytes", "mxfp4"], help="weight quantisation (default none)")
    g.add_argument("--dtype", default="auto", help="auto | bf16 | fp16 (default auto)")
    g.add_argument("--kv-cache-dtype", default="auto", help="auto | fp8 | fp8_e4m3 | fp8_e5m2 (default auto)")
    g.add_argument("--memory-fraction", "--gpu-memory-utilization", "--mem-fraction-static",
                   "--cuda-memory-fraction", "--free-gpu-memory-fraction", dest="memory_fraction", type=float,
                   help="the engine's memory fraction (vLLM: 0.9, 0.92 from 0.20, unset = 1.0 in 0.34; SGLang by TP, "
                        "TGI 1.0, TensorRT-LLM 0.9)")
    g.add_argument("--max-model-len", "--context-length", "--max-total-tokens", "--max-seq-len",
                   dest="max_model_len", type=int, help="longest request (default: the model's positions)")
    g.add_argument("--max-num-seqs", "--max-running-requests", "--max-batch-size", "--max-concurrent-requests",
                   dest="max_num_seqs", type=int, help="concurrent sequences the engine schedules")
    g.add_argument("--max-num-batched-tokens", "--chunked-prefill-size", "--max-batch-prefill-tokens",
                   "--max-num-tokens", dest="max_num_batched_tokens", type=int,
                   help="tokens per step; the profile / warm-up forward runs at this size")
    g.add_argument("--block-size", "--page-size", "--tokens-per-block", dest="block_size", type=int)
    g.add_argument("--enforce-eager", "--disable-cuda-graph", dest="enforce_eager", action="store_true")
    g.add_argument("--cuda-graph-sizes", type=_ints, default=(), help="vLLM: capture sizes (one value = the max; default: the engine's)")
    g.add_argument("--no-enable-prefix-caching", dest="prefix_caching", action="store_false")
    g.add_argument("--disable-hybrid-kv-cache-manager", action="store_true")
    g.add_argument("--enable-lora", action="store_true", help="vLLM: multi-LoRA serving (GPU slots for adapters)")
    g.add_argument("--max-loras", type=int, default=1, help="vLLM: adapters in GPU slots at once (default 1)")
    g.add_argument("--max-lora-rank", type=int, default=16, help="vLLM: the slots' rank (default 16)")
    g.add_argument("--max-cpu-loras", type=int, help="vLLM: adapters cached in host RAM (default max-loras)")
    g.add_argument("--fully-sharded-loras", action="store_true", help="vLLM: shard the adapters' ranks over TP")
    g.add_argument("--limit-mm-per-prompt", type=_limits,
                   help='vLLM, vision-language models: items per prompt, \'{"image": 1, "video": 0}\' (default 999 each)')
    g.add_argument("--mm-processor-kwargs", type=_json_object('{"max_pixels": 1003520}'),
                   help='vLLM, Qwen-VL: the processor\'s pixel bounds, \'{"max_pixels": 1003520}\'')
    g.add_argument("--skip-mm-profiling", action="store_true",
                   help="vLLM, vision-language models: no encoder profile at start-up")
    g.add_argument("--speculative-config",
                   type=_json_object('{"method": "eagle", "num_speculative_tokens": 3}'),
                   help='vLLM: speculative decoding, \'{"method": "eagle", "model": "head/config.json", '
                        '"num_speculative_tokens": 3}\' (eagle, eagle3, deepseek_mtp, ngram)')
    g.add_argument("--method", choices=["analytic", "trace"], default="analytic",
                   help="how vramplan estimates the profile forward (default analytic)")
    q = p.add_argument_group("questions")
    q.add_argument("--avg-request-len", type=int, help="also report concurrency at this request length (tokens)")
    q.add_argument("--largest-context", action="store_true", help="the largest max_model_len that starts")
    q.add_argument("--cheapest", action="store_true",
                   help="cheapest catalog GPU/instance and TP size for --concurrency × --context")
    q.add_argument("--concurrency", type=int, help="target concurrent requests (with --cheapest)")
    q.add_argument("--context", type=int, help="target tokens per request (with --cheapest)")
    q.add_argument("--provider", help="restrict --cheapest to one cloud provider")
    q.add_argument("--sweep", choices=["utilization", "context"], default="utilization",
                   help="x axis of --plot (default utilization)")
    add_output_args(p, plot_help="plot weights, activation budget and KV pool vs --sweep (.png, .svg, .html)")
    p.set_defaults(func=run)


def _kwargs(args: argparse.Namespace) -> dict[str, object]:
    return dict(engine=args.engine, tp=args.tp, pp=args.pp, quantization=args.quantization, dtype=args.dtype,
                kv_cache_dtype=args.kv_cache_dtype, memory_fraction=args.memory_fraction,
                max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
                enforce_eager=args.enforce_eager, cuda_graph_sizes=args.cuda_graph_sizes,
                enable_prefix_caching=args.prefix_caching,
                disable_hybrid_kv_cache_manager=args.disable_hybrid_kv_cache_manager, method=args.method,
                **(dict(enable_lora=True, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
                        max_cpu_loras=args.max_cpu_loras, fully_sharded_loras=args.fully_sharded_loras)
                   if args.enable_lora else {}),
                **({"limit_mm_per_prompt": args.limit_mm_per_prompt} if args.limit_mm_per_prompt is not None else {}),
                **({"mm_processor_kwargs": args.mm_processor_kwargs} if args.mm_processor_kwargs is not None else {}),
                **({"skip_mm_profiling": True} if args.skip_mm_profiling else {}),
                **({"speculative_config": args.speculative_config} if args.speculative_config is not None else {}),
                **({"engine_version": args.engine_version} if args.engine_version else {}),
                **({"extensible_kv_cache": False} if args.extensible_kv_cache is False else {}),
                **({"kv_offloading_size": args.kv_offloading_size, "kv_offloading_backend": args.kv_offloading_backend}
                   if args.kv_offloading_size is not None else {}),
                **({"data_parallel_size": args.data_parallel_size} if args.data_parallel_size != 1 else {}),
                **({"enable_expert_parallel": True} if args.enable_expert_parallel else {}),
                **({"all2all_backend": args.all2all_backend} if args.all2all_backend else {}),
                **({"num_redundant_experts": args.num_redundant_experts} if args.num_redundant_experts else {}),
                **({"routing": args.routing} if args.routing != "even" else {}))


def run(args: argparse.Namespace) -> int:
    from ..errors import VramplanError
    from ..report import serving as rs
    from ..report.render import emit
    from ..serving import api

    if args.plot:
        from ..report.plot import check_plot_path

        check_plot_path(args.plot)
    kw = _kwargs(args)
    if args.cheapest:
        if args.engine == "all":
            raise VramplanError("--cheapest needs one engine", hint="add --engine vllm, sglang, tgi or trtllm")
        if not args.concurrency or not args.context:
            raise VramplanError("--cheapest needs a target", hint="add --concurrency N --context TOKENS")
        kw.pop("tp")
        opts = api.cheapest(args.model, concurrency=args.concurrency, context=args.context,
                            provider=args.provider, **kw)  # type: ignore[arg-type]
        doc = rs.options_doc(opts, concurrency=args.concurrency, context=args.context, engine=args.engine)
        emit(doc, args.format, sys.stdout, [dict(gpu=o.gpu, tp=o.tp, instance=o.instance, provider=o.provider,
                                                 usd_per_hour=o.usd_per_hour, concurrency=o.concurrency,
                                                 plan=o.plan.to_dict()) for o in opts])
        return 0
    if not args.gpu:
        raise VramplanError("serve-plan needs a GPU", hint="add --gpu h100-sxm (see `vramplan gpus`), or use --cheapest")
    if args.engine == "all":
        if args.largest_context or args.cheapest or args.plot:
            raise VramplanError("--engine all only compares start-up plans",
                                hint="drop --largest-context/--cheapest/--plot or name one engine")
        plans = []
        for engine in ENGINES:
            kw["engine"] = engine
            plans.append(api.serve_plan(args.model, args.gpu, avg_request_len=args.avg_request_len, **kw))  # type: ignore[arg-type]
        emit(rs.compare_doc(plans), args.format, sys.stdout, [p.to_dict() for p in plans])
        return 0
    if args.largest_context:
        n = api.largest_max_model_len(args.model, args.gpu, avg_request_len=args.avg_request_len, **kw)  # type: ignore[arg-type]
        if n == 0:
            raise VramplanError(f"{args.model} does not start on {args.gpu} with any max_model_len",
                                hint="use more GPUs (--tp), quantise, or raise the memory fraction")
        kw["max_model_len"] = n
        plan = api.serve_plan(args.model, args.gpu, avg_request_len=args.avg_request_len, **kw)  # type: ignore[arg-type]
        emit(rs.largest_doc(plan, n), args.format, sys.stdout, {"largest_max_model_len": n, "plan": plan.to_dict()})
    else:
        plan = api.serve_plan(args.model, args.gpu, avg_request_len=args.avg_request_len, **kw)  # type: ignore[arg-type]
        emit(rs.to_doc(plan), args.format, sys.stdout, plan.to_dict())
    if args.plot:
        points = api.sweep(args.model, args.gpu, over=args.sweep, avg_request_len=args.avg_request_len, **kw)  # type: ignore[arg-type]
        rs.plot_serving(points, args.plot, over=args.sweep)
        hint(f"plot written to {args.plot}")
    if not plan.starts:
        hint(f"note: {plan.engine} would not start with these settings (see \"Does not start\")")
    return 0
