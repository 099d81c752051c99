"""The `eaglekv` command: `generate` a completion, `serve` the OpenAI API, or `bench` against
HF transformers."""

from __future__ import annotations

import argparse
import shlex
import sys
import time

from eaglekv.config import SPEC_ALGORITHMS, EngineConfig, SamplingParams, SpecConfig
from eaglekv.errors import EaglekvError


def _engine_args(p: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    p.add_argument("--model", default=d.model, help="'default' (SmolLM2-135M-Instruct), a HF "
                   "directory or a .gguf file")
    p.add_argument("--dtype", default=d.dtype)
    p.add_argument("--device", default=d.device)
    p.add_argument("--page-size", type=int, default=d.page_size)
    p.add_argument("--max-total-tokens", type=int, default=4096,
                   help="KV pool slots (default 4096 for the CLI)")
    p.add_argument("--chunked-prefill-size", type=int, default=d.chunked_prefill_size,
                   help="prefill tokens a step; a longer prompt is prefilled over several "
                   "steps while the others keep decoding (0: a prompt at once)")
    sp = SpecConfig()
    p.add_argument("--spec", default=sp.algorithm, choices=SPEC_ALGORITHMS,
                   help="speculative decoding algorithm")
    p.add_argument("--draft", default=sp.draft_model,
                   help="draft checkpoint directory (published layout of --spec), 'default' "
                   "(the head shipped for SmolLM2-135M-Instruct), or 'random'")
    p.add_argument("--num-steps", type=int, default=sp.num_steps)
    p.add_argument("--topk", type=int, default=sp.topk)
    p.add_argument("--num-draft-tokens", type=int, default=sp.num_draft_tokens)


def spec_from_args(args) -> SpecConfig:
    return SpecConfig(algorithm=args.spec, draft_model=args.draft, num_steps=args.num_steps,
                      topk=args.topk, num_draft_tokens=args.num_draft_tokens)


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
    v = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, "
                       "/v1/chat/completions, /metrics)")
    _engine_args(v)
    v.add_argument("--host", default="127.0.0.1")
    v.add_argument("--port", type=int, default=8000)
    v.add_argument("--served-model-name", default=None,
                   help="the `model` clients must send (default: --model)")
    v.add_argument("--max-running-requests", type=int, default=EngineConfig().max_running_requests)
    v.add_argument("--default-max-tokens", type=int, default=256,
                   help="max_tokens of a chat request that does not set it")
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
    b.add_argument("--out", default=None, help="also write the JSON here")
    return parser


def cmd_generate(args) -> None:
    from eaglekv.engine import Engine
    t0 = time.perf_counter()
    engine = Engine(EngineConfig(model=args.model, dtype=args.dtype, device=args.device,
                                 page_size=args.page_size, max_total_tokens=args.max_total_tokens,
                                 chunked_prefill_size=args.chunked_prefill_size or None,
                                 max_running_requests=1, speculative=spec_from_args(args)))
    load_s = time.perf_counter() - t0
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    prompt = (engine.apply_chat_template([{"role": "user", "content": args.prompt}])
              if args.chat else args.prompt)
    print(f"[eaglekv] model {engine.config.model} loaded in {load_s:.1f}s", file=sys.stderr)
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
    st = engine.spec_stats()
    spec = ("accept length n/a (plain decoding: no draft model configured)" if st is None else
            f"accept length {st.accept_length_mean:.2f} over {st.verify_steps} verify steps "
            f"({args.spec}, steps={args.num_steps}, topk={args.topk}, "
            f"draft tokens={args.num_draft_tokens})")
    print(f"[eaglekv] {n} tokens in {dt:.2f}s = {n / dt:.1f} tokens/s, finish_reason={reason}, "
          f"{spec}", file=sys.stderr)


def cmd_serve(args) -> None:
    import uvicorn

    from eaglekv.engine import Engine
    from eaglekv.server import EngineLoop, create_app
    engine = Engine(EngineConfig(model=args.model, dtype=args.dtype, device=args.device,
                                 page_size=args.page_size, max_total_tokens=args.max_total_tokens,
                                 chunked_prefill_size=args.chunked_prefill_size or None,
                                 max_running_requests=args.max_running_requests,
                                 speculative=spec_from_args(args)))
    loop = EngineLoop(engine).start()
    app = create_app(loop, args.served_model_name or args.model, args.default_max_tokens)
    print(f"[eaglekv] serving {args.model} on http://{args.host}:{args.port}/v1 "
          f"(speculative: {args.spec})", file=sys.stderr)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    finally:
        loop.shutdown()


def cmd_bench_serve(args) -> None:
    from eaglekv.bench.serve import main as bench_main
    args.command_line = "eaglekv " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    bench_main(args)


def cmd_bench(args) -> None:
    from eaglekv.bench.e2e import main as bench_main
    args.command_line = "eaglekv " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    bench_main(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        {"generate": cmd_generate, "serve": cmd_serve, "bench": cmd_bench,
         "bench-serve": cmd_bench_serve}[args.cmd](args)
    except EaglekvError as e:
        print(f"eaglekv: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
