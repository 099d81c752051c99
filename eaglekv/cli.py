"""The `eaglekv` command: `generate` a completion, `serve` the OpenAI API, `bench` against
HF transformers, `train-draft` an EAGLE draft head, or `eval-draft` one on held-out prompts."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time

from eaglekv.config import (DEFAULT_SCHEDULER_STEPS, SPEC_ALGORITHMS, EngineConfig, SamplingParams,
                            SpecConfig)
from eaglekv.errors import ConfigError, EaglekvError
from eaglekv.training.cli import DESCRIPTION as TRAIN_DRAFT_DESCRIPTION
from eaglekv.training.cli import add_arguments as train_draft_args

CLI_MAX_TOTAL_TOKENS = 4096     # KV pool slots when neither a size nor a memory fraction is given
SPEC_FLAGS = {"spec": "--spec/--speculative-algorithm",       # dest -> its flags (eaglekv/SGLang)
              "draft": "--draft/--speculative-draft-model-path",
              "num_steps": "--num-steps/--speculative-num-steps",
              "topk": "--topk/--speculative-eagle-topk",
              "num_draft_tokens": "--num-draft-tokens/--speculative-num-draft-tokens",
              "adaptive": "--adaptive/--no-adaptive"}


def _engine_args(p: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    p.add_argument("--model", "--model-path", default=d.model, help="'default' "
                   "(SmolLM2-135M-Instruct), a HF directory or a .gguf file")
    p.add_argument("--dtype", default=d.dtype)
    p.add_argument("--device", default=d.device)
    p.add_argument("--page-size", type=int, default=d.page_size)
    p.add_argument("--max-total-tokens", type=int, default=CLI_MAX_TOTAL_TOKENS,
                   help=f"KV pool slots (default {CLI_MAX_TOTAL_TOKENS} for the CLI; serve "
                   "with a memory fraction: sized from it)")
    p.add_argument("--chunked-prefill-size", type=int, default=None,
                   help="prefill tokens a step; a longer prompt is prefilled over several "
                   "steps while the others keep decoding (default: 512 on CPU, 2048 on CUDA; "
                   "0: a prompt at once)")
    p.add_argument("--attention-backend", choices=("auto", "torch", "triton"),
                   default=d.attention_backend, help="auto: Triton kernels on CUDA, the "
                   "PyTorch reference on CPU")
    p.add_argument("--disable-cuda-graph", action="store_true",
                   help="CUDA: run every decode step eagerly, not as a captured graph")
    p.add_argument("--cuda-graph-max-bs", type=int, default=None,
                   help="largest decode batch captured as a CUDA graph (default: "
                   "--max-running-requests)")
    p.add_argument("--cuda-graph-prefill-tokens", type=int, default=None,
                   help="replay one request's prefill (or chunk) of fewer than this many "
                   "tokens as a CUDA graph per token bucket (0: eager; default: 256 under "
                   "CUDA graphs), a step's prefills packed up to 16 requests a replay "
                   "(EAGLEKV_PREFILL_PACK=0: one request a replay, several eagerly)")
    p.add_argument("--waiting-served-ratio", type=float, default=d.waiting_served_ratio,
                   help="while requests decode, admit newcomers once they are this fraction "
                   "of the running ones (TGI's flag; 0: at once)")
    p.add_argument("--max-waiting-steps", type=int, default=d.max_waiting_steps,
                   help="with --waiting-served-ratio: admit the waiting ones after this many "
                   "engine steps in any case")
    p.add_argument("--num-scheduler-steps", type=int, default=None,
                   help="greedy decode steps per engine step, one sync for all (default: "
                   f"{DEFAULT_SCHEDULER_STEPS} with CUDA graphs, else 1); a speculative engine "
                   "chains ceil(this / (num_steps + 1)) greedy speculative steps")
    # No defaults here: spec_config fills them from SpecConfig, and `serve` can tell a flag given.
    # The second names are SGLang's.
    p.add_argument("--spec", "--speculative-algorithm", type=str.lower, choices=SPEC_ALGORITHMS,
                   help="speculative decoding algorithm (default none)")
    p.add_argument("--draft", "--speculative-draft-model-path",
                   help="draft checkpoint directory (published layout of --spec), 'default' "
                   "(the head shipped for SmolLM2-135M-Instruct), or 'random'")
    p.add_argument("--num-steps", "--speculative-num-steps", type=int,
                   help="draft steps (default: chosen each step for --draft default, else 3)")
    p.add_argument("--topk", "--speculative-eagle-topk", type=int,
                   help="branches a draft step (default 1: a chain)")
    p.add_argument("--num-draft-tokens", "--speculative-num-draft-tokens", type=int,
                   help="tokens verified a step, the root included (default: num_steps + 1 "
                   "for a chain)")
    p.add_argument("--adaptive", "--speculative-adaptive", action=argparse.BooleanOptionalAction,
                   default=None, help="choose plain decoding or a draft shape each step from "
                   "measured costs and live acceptance (default: on for --draft default when no "
                   "shape is given)")


def kernel_options(args) -> dict:
    """The engine's kernel and graph flags, as EngineConfig fields."""
    return {"attention_backend": args.attention_backend,
            "disable_cuda_graph": args.disable_cuda_graph,
            "cuda_graph_max_bs": args.cuda_graph_max_bs,
            "cuda_graph_prefill_tokens": args.cuda_graph_prefill_tokens,
            "num_scheduler_steps": args.num_scheduler_steps,
            "waiting_served_ratio": args.waiting_served_ratio,
            "max_waiting_steps": args.max_waiting_steps}


def chunk_arg(value: int | None) -> int | str | None:
    """--chunked-prefill-size: not given -> "auto" (the device's default), 0 -> None (off)."""
    return "auto" if value is None else (value or None)


def engine_config(args, speculative: SpecConfig, max_running_requests: int) -> EngineConfig:
    """EngineConfig from the flags of _engine_args (`serve` sizes its pool its own way)."""
    return EngineConfig(model=args.model, dtype=args.dtype, device=args.device,
                        page_size=args.page_size, max_total_tokens=args.max_total_tokens,
                        chunked_prefill_size=chunk_arg(args.chunked_prefill_size),
                        max_running_requests=max_running_requests, speculative=speculative,
                        **kernel_options(args))


def spec_config(options: dict) -> SpecConfig:
    """SpecConfig from the options given (None: not given, SpecConfig's default: a chain of
    num_steps drafts verifies num_steps + 1 tokens; no shape with the default draft: adaptive)."""
    return SpecConfig(**{k: v for k, v in options.items() if v is not None})


def spec_from_args(args) -> SpecConfig:
    return spec_config({"algorithm": args.spec, "draft_model": args.draft,
                        "num_steps": args.num_steps, "topk": args.topk,
                        "num_draft_tokens": args.num_draft_tokens,
                        "adaptive": args.adaptive})


def _serve_args(v: argparse.ArgumentParser) -> None:
    """`serve` also takes the flags of `vllm serve` and SGLang's `launch_server` (issue 11)."""
    v.add_argument("model_arg", nargs="?", metavar="MODEL", help="the model, as --model "
                   "(vLLM's form: eaglekv serve MODEL)")
    v.set_defaults(model=None, max_total_tokens=None)   # serve_configs tells given from default
    v.add_argument("--host", default="127.0.0.1")
    v.add_argument("--port", type=int, default=8000)
    v.add_argument("--served-model-name", default=None,
                   help="the `model` clients must send (default: the model)")
    v.add_argument("--max-running-requests", "--max-num-seqs", type=int,
                   default=EngineConfig().max_running_requests)
    v.add_argument("--max-context-len", "--max-model-len", "--context-length", type=int,
                   help="most tokens (prompt + output) a request may reach (default: the "
                   "model's max_position_embeddings)")
    v.add_argument("--mem-fraction", "--mem-fraction-static", type=float,
                   help="fraction of the device's FREE memory, measured after the weights "
                   "are loaded, that the KV pool takes (default 0.2, at most 0.95; the pool is "
                   "capped at max-running-requests x max-context-len). SGLang's "
                   "--mem-fraction-static counts weights + KV cache against TOTAL memory, so "
                   "the same number gives eaglekv a larger pool. Without --max-total-tokens "
                   "this sizes the pool")
    v.add_argument("--gpu-memory-utilization", type=float,
                   help="as --mem-fraction: a fraction of FREE memory after the weights, for "
                   "the KV pool alone. vLLM's counts weights, activations and KV cache against "
                   "TOTAL memory (default 0.9 there), so leave room for activations here")
    v.add_argument("--seed", type=int, default=None,
                   help=f"seeds the requests that give no seed (default {EngineConfig.seed})")
    v.add_argument("--speculative-config", metavar="JSON",
                   help="vLLM's form, e.g. '{\"method\": \"eagle\", \"model\": \"default\", "
                   "\"num_speculative_tokens\": 3}'; methods eagle, eagle3, multi_layer_eagle; "
                   "extra keys topk, num_draft_tokens. Instead of --spec/--draft/--num-steps/"
                   "--topk/--num-draft-tokens")
    v.add_argument("--chat-template", help="a Jinja chat template file, or the template "
                   "itself, used instead of the tokenizer's")
    v.add_argument("--api-key", help="clients must send `Authorization: Bearer KEY` (default: "
                   "$EAGLEKV_API_KEY, else $VLLM_API_KEY, else no auth)")
    v.add_argument("--default-max-tokens", type=int, default=None,
                   help="max_tokens of a chat request that does not set it (default 256)")
    v.add_argument("--max-request-bytes", type=int, default=None,
                   help="larger request bodies are answered 413 (default 4 MiB)")
    v.add_argument("--max-sub-requests", type=int, default=None,
                   help="most prompts x n in one call (default 256)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eaglekv", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate a completion and print it with tokens/s")
    g.add_argument("prompt")
    _engine_args(g)
    s = SamplingParams()
    g.add_argument("--chat", action="store_true", help="apply the model's chat template")
    g.add_argument("--max-new-tokens", type=int, default=s.max_new_tokens)
    g.add_argument("--temperature", type=float, default=s.temperature)
    g.add_argument("--top-p", type=float, default=s.top_p)
    g.add_argument("--top-k", type=int, default=s.top_k)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stream", action="store_true", help="print tokens as they come")
    g.add_argument("--verbose", action="store_true", help="adaptive speculation: print the "
                   "measured cost of each choice against plain decoding")
    v = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, "
                       "/v1/chat/completions, /metrics)")
    _engine_args(v)
    _serve_args(v)
    bs = sub.add_parser("bench-serve", help="the OpenAI server under concurrent clients vs the "
                        "engine called directly, JSON out")
    _engine_args(bs)
    bs.add_argument("--max-running-requests", type=int, default=4)
    bs.add_argument("--max-tokens", type=int, default=48)
    bs.add_argument("--concurrency", default="1,4", help="comma-separated client counts")
    bs.add_argument("--out", default=None, help="also write the JSON here")
    b = sub.add_parser("bench", help="eaglekv vs HF transformers greedy tokens/s, JSON out")
    _engine_args(b)
    b.add_argument("--new-tokens", type=int, default=128)
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--no-hf", action="store_true", help="skip the HF transformers rows")
    b.add_argument("--out", default=None, help="also write the JSON here (with --device "
                   "cuda: a directory for the JSON and the PNG)")
    b.add_argument("--table", action="store_true", help="the table of modes x batch sizes "
                   "(the default with --device cuda): JSON + PNG into --out")
    b.add_argument("--batches", default="1,4,16,64", help="--table: batch sizes")
    b.add_argument("--waves", type=int, default=1, help="--table: B requests in flight and "
                   "B * waves in all, a new one as each finishes (continuous batching, as a "
                   "loaded server); 1: one batch of B, done when its slowest request is")
    b.add_argument("--modes", default="plain,eagle_chain_S3K1N4,eagle_tree_S4K2N8,adaptive",
                   help="--table: plain, the EAGLE shapes (eagle_chain_S1K1N2, "
                   "eagle_chain_S3K1N4, eagle_chain_S5K1N6, eagle_tree_S4K2N8) and adaptive")
    b.add_argument("--floor", default=None, metavar="GRAPH_FLOOR_PY", help="--device cuda: "
                   "run the floor script (../shared/tools/graph_floor.py) in this process "
                   "after the modes, into the JSON and the plot")
    b.add_argument("--prompts", default=None, help="--table: a JSON list of prompts "
                   "(eval-draft's format, e.g. bench/data/heldout_prompts_smollm2.json), "
                   "request i takes prompt i mod their count; default: one story prompt with "
                   "a numbered suffix per request")
    b.add_argument("--checks-replay", action="store_true", help="--device cuda: the "
                   "decode and verify graphs captured checked and unchecked, replayed in "
                   "alternation (what the index checks cost a step, device side)")
    b.add_argument("--llama8b", action="store_true", help="--device cuda: add the decode "
                   "step of a Llama-3.1-8B shape (random weights) against its roofline, "
                   "measured before the modes' engines are built")
    b.add_argument("--llama8b-after", action="store_true", help="with --llama8b: measure it "
                   "again after the modes (the same process once every engine has run)")
    t = sub.add_parser("train-draft", help="train an EAGLE-1/2 draft head by self-distillation "
                       "(`prompts` on the CPU, then `train`)", description=TRAIN_DRAFT_DESCRIPTION)
    train_draft_args(t)
    _eval_draft_args(sub.add_parser(
        "eval-draft", help="a draft head on held-out prompts with the real engine: accept "
        "length, rate per draft position, histogram, tokens/s vs plain, greedy lossless check"))
    return parser


def _eval_draft_args(e: argparse.ArgumentParser) -> None:
    _engine_args(e)            # --spec / --draft here: the draft to evaluate
    e.set_defaults(spec="eagle", draft="default")
    e.add_argument("--prompts", required=True, help="JSON list of prompts: {\"ids\": [token "
                   "ids, chat-templated], \"kind\": \"chat\" | \"code\" | ...} or strings "
                   "(user messages, chat-templated here)")
    e.add_argument("--max-prompts", type=int, default=None, help="the first n prompts")
    e.add_argument("--max-new-tokens", type=int, default=128)
    e.add_argument("--batch", type=int, default=1, help="requests in flight")
    e.add_argument("--shapes", default="S3K1N4,S5K1N6,tree:S4K2N8", help="draft shapes, each fixed: "
                   "S<num_steps>K<topk>N<num_draft_tokens>, 'tree:' before a topk > 1; "
                   "'adaptive': the engine's default choice among the device's candidates")
    e.add_argument("--temperatures", default="0,0.7", help="0: greedy, checked "
                   "token for token against plain decoding")
    e.add_argument("--seed", type=int, default=0, help="request i samples with seed + i")
    e.add_argument("--also-draft", action="append", default=None, metavar="[ALG:]PATH",
                   help="another draft measured in the same process against the same plain "
                   "runs (repeatable), e.g. eagle3:/root/head3 or eagle:default")
    e.add_argument("--out", default=None, help="the JSON (default: bench/results/"
                   "eval_draft_<spec>_<device type>.json)")


def cmd_generate(args) -> None:
    from eaglekv.engine import Engine
    t0 = time.perf_counter()
    engine = Engine(engine_config(args, spec_from_args(args), max_running_requests=1))
    load_s = time.perf_counter() - t0
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    prompt = (engine.apply_chat_template([{"role": "user", "content": args.prompt}])
              if args.chat else args.prompt)
    split = ", ".join(f"{k} {v:.2f}s" for k, v in engine.load_times.items())
    print(f"[eaglekv] model {engine.config.model} loaded in {load_s:.1f}s ({split})",
          file=sys.stderr)
    t0 = time.perf_counter()
    if args.stream:
        n, reason = 0, None
        for delta in engine.stream(prompt, params):
            print(delta.text, end="", flush=True)
            n += len(delta.token_ids)
            reason = delta.finish_reason
        print()
    else:
        out = engine.generate([prompt], params)[0]
        print(out.text)
        n, reason = len(out.token_ids), out.finish_reason
    dt = time.perf_counter() - t0
    st, sp = engine.spec_stats(), engine.config.speculative
    shape = ("adaptive" if sp.adaptive else
             f"steps={sp.num_steps}, topk={sp.topk}, draft tokens={sp.num_draft_tokens}")
    spec = ("accept length n/a (plain decoding: no draft model configured)" if st is None else
            f"accept length {st.accept_length_mean:.2f} over {st.verify_steps} verify steps "
            f"({sp.algorithm}, {shape})")
    print(f"[eaglekv] {n} tokens in {dt:.2f}s = {n / dt:.1f} tokens/s, finish_reason={reason}, "
          f"{spec}", file=sys.stderr)
    policy = getattr(engine.runner, "policy", None)
    if policy is not None:     # what adaptive speculation chose, and why
        print(f"[eaglekv] {policy.summary()}", file=sys.stderr)
        if args.verbose:
            print(policy.explain(1), file=sys.stderr)


def _serve_model(args) -> str | None:
    if args.model_arg and args.model and args.model_arg != args.model:
        raise ConfigError(f"the model is given twice, as MODEL {args.model_arg!r} and as "
                          f"--model/--model-path {args.model!r}; give one")
    return args.model_arg or args.model


def _serve_spec(args) -> SpecConfig:
    if args.speculative_config is None:
        return spec_from_args(args)
    given = [flag for dest, flag in SPEC_FLAGS.items() if getattr(args, dest) is not None]
    if given:
        raise ConfigError(f"--speculative-config and {', '.join(given)} both set speculative "
                          f"decoding; give the JSON or the flags, not both")
    from eaglekv.server.spec_config import parse_speculative_config
    options = parse_speculative_config(args.speculative_config)   # its errors name the key
    try:
        return spec_config(options)
    except ConfigError as e:                                        # a rule across keys
        raise ConfigError(f"--speculative-config {args.speculative_config}: {e}") from None


def _mem_fraction(args) -> float | None:
    vllm, sglang = args.gpu_memory_utilization, args.mem_fraction
    if vllm is not None and sglang is not None and vllm != sglang:
        raise ConfigError(f"--gpu-memory-utilization={vllm} and --mem-fraction(-static)={sglang} "
                          f"both set the KV pool's fraction of free memory; give one")
    return vllm if vllm is not None else sglang


def read_chat_template(value: str | None) -> str | None:
    """vLLM's rule: an existing file is read, else the value is the template itself if it looks
    like Jinja (has '{', '}' or a newline); else it is a path with a typo."""
    if value is None:
        return None
    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"--chat-template {value!r}: cannot read the file: {e}") from None
        if not text.strip():
            raise ConfigError(f"--chat-template {value!r}: the file is empty")
        return text
    if any(c in value for c in "{}\n"):
        return value
    raise ConfigError(f"--chat-template {value!r} is neither a file nor a Jinja template; give "
                      f"the path of an existing file or the template text")


def serve_configs(args, environ=os.environ) -> tuple[EngineConfig, "ServerConfig"]:
    """`serve`'s flags (parsed) -> the engine's and the server's configs; loads nothing.
    `environ` holds EAGLEKV_API_KEY / VLLM_API_KEY, read when --api-key is not given."""
    from eaglekv.server.settings import ServerConfig
    mem = _mem_fraction(args)
    if mem is not None and args.max_total_tokens is not None:
        raise ConfigError(f"--max-total-tokens={args.max_total_tokens} sizes the KV pool, so "
                          f"the memory fraction {mem} would go unused; give one of them")
    pool = args.max_total_tokens     # None with a fraction given: plan_kv_size sizes it from that
    if pool is None and mem is None:
        pool = CLI_MAX_TOTAL_TOKENS
    engine = {"model": _serve_model(args), "dtype": args.dtype, "device": args.device,
              "page_size": args.page_size, "max_context_len": args.max_context_len,
              "max_total_tokens": pool,
              "mem_fraction": mem, "seed": args.seed,
              "chunked_prefill_size": chunk_arg(args.chunked_prefill_size),
              "max_running_requests": args.max_running_requests,
              "speculative": _serve_spec(args), **kernel_options(args)}
    # None: the field's default (max_context_len, max_total_tokens and chunked_prefill_size
    # take None as a value of their own and stay)
    optional = ("model", "mem_fraction", "seed")
    engine_config = EngineConfig(**{k: v for k, v in engine.items()
                                    if v is not None or k not in optional})
    api_key = args.api_key if args.api_key is not None else (
        environ.get("EAGLEKV_API_KEY") or environ.get("VLLM_API_KEY") or None)
    server = {"model_name": args.served_model_name or engine_config.model, "api_key": api_key,
              "chat_template": read_chat_template(args.chat_template),
              "default_max_tokens": args.default_max_tokens,
              "max_request_bytes": args.max_request_bytes,
              "max_sub_requests": args.max_sub_requests}
    return engine_config, ServerConfig(**{k: v for k, v in server.items() if v is not None})


def cmd_serve(args) -> None:
    engine_config, server_config = serve_configs(args)   # a bad flag fails before the model loads
    import uvicorn

    from eaglekv.engine import Engine
    from eaglekv.server import EngineLoop, create_app
    loop = EngineLoop(Engine(engine_config)).start()
    try:
        app = create_app(loop, server_config)
        print(f"[eaglekv] serving {engine_config.model} as {server_config.model_name!r} on "
              f"http://{args.host}:{args.port}/v1 (speculative: "
              f"{engine_config.speculative.algorithm}"
              f"{', API key required' if server_config.api_key else ''})", file=sys.stderr)
        uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    finally:
        loop.shutdown()


def cmd_bench_serve(args) -> None:
    from eaglekv.bench.serve import main as bench_main
    sp = spec_from_args(args)   # bench.serve reads the spec flags: hand it them with defaults
    args.spec, args.draft, args.num_steps, args.topk, args.num_draft_tokens = (
        sp.algorithm, sp.draft_model, sp.num_steps, sp.topk, sp.num_draft_tokens)
    bench_main(args)


def cmd_bench(args) -> None:
    if (args.device.startswith("cuda") or args.table) and args.spec is None:   # the table
        from eaglekv.bench.gpu import main as gpu_main
        args.draft = args.draft or "default"
        gpu_main(args)
        return
    from eaglekv.bench.e2e import main as bench_main
    bench_main(args, spec_from_args(args))   # the CLI resolves the flags; bench never calls back


def cmd_train_draft(args) -> None:
    from eaglekv.training.cli import run
    run(args, args.command_line)


def cmd_eval_draft(args) -> None:
    shape = [SPEC_FLAGS[d] for d in ("num_steps", "topk", "num_draft_tokens", "adaptive")
             if getattr(args, d) is not None]
    if shape:
        raise ConfigError(f"eval-draft runs each item of --shapes (fixed shapes, or "
                          f"'adaptive'), so {', '.join(shape)} would go unused; list them in "
                          f"--shapes, e.g. S3K1N4,tree:S4K2N8,adaptive")
    if args.batch < 1:
        raise ConfigError(f"--batch={args.batch} must be >= 1 (requests in flight)")
    from eaglekv.training.eval_draft import main as eval_main
    eval_main(args, engine_config(args, SpecConfig(), args.batch))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # recorded in the JSON results (in-process callers pass argv)
    args.command_line = "eaglekv " + " ".join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    try:
        {"generate": cmd_generate, "serve": cmd_serve, "bench": cmd_bench,
         "bench-serve": cmd_bench_serve, "train-draft": cmd_train_draft,
         "eval-draft": cmd_eval_draft}[args.cmd](args)
    except EaglekvError as e:
        print(f"eaglekv: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    if argv is None and args.cmd == "generate":
        # the command line's `generate` has printed everything: skip the interpreter's
        # teardown of torch (0.5-1 s on this machine); in-process callers pass argv
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
