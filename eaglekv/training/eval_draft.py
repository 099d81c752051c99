"""`eaglekv eval-draft`: a draft head measured by the real engine on held-out prompts (issue 14).

Every shape x temperature runs all prompts through an Engine fixed to that shape (adaptive
off); the same prompts with the same SamplingParams run once per temperature through a plain
engine, in this process. The figures come from the requests' own SpecStats, summed:

    accept length   = (accepted drafts + verify steps) / verify steps   (the bonus included)
    position rate i = verify steps that accepted >= i + 1 drafts / verify steps
                      (vLLM's and llama.cpp's; a tree: depth i + 1 along the accepted path)
    histogram       = verify steps per accept length (key: tokens the step gave, bonus in)
    tokens/s        = output tokens / wall seconds of Engine.generate over all the prompts
                      (prefill included, `batch` requests in flight), speculative and plain

`adaptive` in the shapes runs the engine's default instead (adaptive over the device's
candidate shapes, plain decoding among its choices): its figures count its speculative steps,
its tokens/s the whole run, and its row lists the engine steps per choice.
`adaptive:S1K1N2/S3K1N4/S5K1N6` runs adaptive over those candidates only (no gated shape),
e.g. beside the default in one process.

At temperature 0 every speculative output must equal the plain one token for token; each one
that does not is counted and listed. At T > 0 request i samples with seed `seed + i` in both
engines (the outputs differ: speculative sampling draws differently, from the same law).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from eaglekv.config import EngineConfig, SamplingParams, SpecConfig
from eaglekv.core import Output, SpecStats
from eaglekv.engine import Engine
from eaglekv.errors import ConfigError

SHAPE_RE = re.compile(r"(?:(chain|tree):)?S(\d+)K(\d+)N(\d+)", re.IGNORECASE)


ADAPTIVE = "adaptive"


def parse_shapes(text: str) -> list[tuple[int, int, int] | str]:
    """"S3K1N4,tree:S4K2N8" -> [(3, 1, 4), (4, 2, 8)]: (num_steps, topk, num_draft_tokens);
    the optional "chain:" / "tree:" must agree with topk (1: a chain). "adaptive": the engine's
    default, choosing among the device's candidate shapes and plain decoding each step;
    "adaptive:S3K1N4/S5K1N6": adaptive over those candidates -> ("adaptive", ((3, 1, 4),
    (5, 1, 6)))."""
    shapes = []
    for item in text.split(","):
        if item.strip().lower() == ADAPTIVE:
            if ADAPTIVE in shapes:
                raise ConfigError(f"--shapes {text!r} names adaptive twice")
            shapes.append(ADAPTIVE)
            continue
        head, _, rest = item.strip().partition(":")
        if head.lower() == ADAPTIVE:
            if not rest.strip():
                raise ConfigError(f"--shapes item {item!r}: write adaptive:S3K1N4/S5K1N6")
            cands = tuple(parse_shapes(rest.replace("/", ",")))
            if any(not isinstance(c, tuple) or len(c) != 3 or isinstance(c[1], tuple)
                   for c in cands):
                raise ConfigError(f"--shapes item {item!r}: write adaptive:S3K1N4/S5K1N6")
            entry = (ADAPTIVE, cands)
            if entry in shapes:
                raise ConfigError(f"--shapes {text!r} names {item.strip()} twice")
            shapes.append(entry)
            continue
        m = SHAPE_RE.fullmatch(item.strip())
        if m is None:
            raise ConfigError(f"--shapes item {item!r}: write S<num_steps>K<topk>N<num draft "
                              f"tokens>, optionally after 'chain:' or 'tree:', e.g. S3K1N4 or "
                              f"tree:S4K2N8, or adaptive")
        label, shape = m.group(1), tuple(int(v) for v in m.group(2, 3, 4))
        if label and (label.lower() == "tree") != (shape[1] > 1):
            raise ConfigError(f"--shapes item {item!r}: a {label} needs topk "
                              f"{'> 1' if label.lower() == 'tree' else '= 1'}, not K{shape[1]}")
        if shape in shapes:
            raise ConfigError(f"--shapes {text!r} names S{shape[0]}K{shape[1]}N{shape[2]} twice")
        shapes.append(shape)
    return shapes


def parse_temperatures(text: str) -> list[float]:
    try:
        temps = [float(t) for t in text.split(",")]
    except ValueError:
        raise ConfigError(f"--temperatures {text!r}: give comma-separated numbers, e.g. "
                          f"0,0.7") from None
    temps = [SamplingParams(temperature=t).temperature for t in temps]   # its bounds; < 1e-5: 0
    if len(set(temps)) != len(temps):
        raise ConfigError(f"--temperatures {text!r} names a temperature twice")
    return temps


def load_prompts(path: str, max_prompts: int | None = None) -> list[dict]:
    """--prompts: a JSON list of {"ids": token ids (chat-templated already), "kind": "chat",
    "code", ...} ("kind" optional: "chat", or "text" where "chat" is false, as in a
    `train-draft prompts` file) or of strings (user messages: the engine's chat template is
    applied, kind "chat"). Returns {"kind", "ids"} or {"kind", "text"} each; the first
    `max_prompts`."""
    try:
        items = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"--prompts {path!r}: cannot read a JSON list from it: {e}") from None
    if not isinstance(items, list) or not items:
        raise ConfigError(f"--prompts {path!r}: expected a non-empty JSON list of prompts")
    if max_prompts is not None and max_prompts < 1:
        raise ConfigError(f"--max-prompts={max_prompts} must be >= 1")
    out = []
    for i, p in enumerate(items[:max_prompts]):
        if isinstance(p, str) and p:
            out.append({"kind": "chat", "text": p})
        elif isinstance(p, dict) and isinstance(p.get("ids"), list) and p["ids"] and all(
                isinstance(t, int) and not isinstance(t, bool) for t in p["ids"]):
            kind = p.get("kind") or ("chat" if p.get("chat", True) else "text")
            out.append({"kind": str(kind), "ids": p["ids"]})
        else:
            raise ConfigError(f"--prompts {path!r}: item {i} is neither a non-empty string nor "
                              f"an object with a non-empty list of int token 'ids': "
                              f"{json.dumps(p)[:80]}")
    return out


def prompt_ids(engine: Engine, prompts: list[dict]) -> list[list[int]]:
    """Token ids of each prompt: its own, or its text as a user message through the chat
    template (as `eaglekv generate --chat` does)."""
    if engine.tokenizer is None and any("ids" not in p for p in prompts):
        raise ConfigError(f"text prompts need the model's tokenizer and chat template, but "
                          f"{engine.config.model!r} has no tokenizer: give token 'ids'")
    return [p["ids"] if "ids" in p else
            engine.apply_chat_template([{"role": "user", "content": p["text"]}])
            for p in prompts]


@dataclasses.dataclass
class Run:
    """All the prompts through one engine at one temperature."""

    outputs: list[Output]
    seconds: float

    @property
    def tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def run_prompts(engine: Engine, ids: list[list[int]], params: list[SamplingParams]) -> Run:
    t = time.perf_counter()
    outputs = engine.generate(ids, params)     # tokens read on the host: the device is done
    return Run(outputs, time.perf_counter() - t)


def greedy_mismatches(spec: list[Output], plain: list[Output]) -> list[dict]:
    """Prompts whose speculative greedy output differs from the plain one: the first index
    where they differ and both lengths."""
    out = []
    for i, (s, p) in enumerate(zip(spec, plain)):
        if s.token_ids != p.token_ids:
            first = next((j for j, (a, b) in enumerate(zip(s.token_ids, p.token_ids))
                          if a != b), min(len(s.token_ids), len(p.token_ids)))
            out.append({"prompt": i, "first_difference": first,
                        "spec_tokens": len(s.token_ids), "plain_tokens": len(p.token_ids)})
    return out


def shape_name(spec: SpecConfig) -> str:
    if spec.adaptive:
        if spec.shapes is None:
            return ADAPTIVE
        return ADAPTIVE + ":" + "/".join(f"S{S}K{K}N{N}" for S, K, N in spec.shapes)
    kind = "chain" if spec.topk == 1 else "tree"
    return f"{kind}_S{spec.num_steps}K{spec.topk}N{spec.num_draft_tokens}"


def run_figures(spec: SpecConfig, temperature: float, run: Run, plain: Run,
                kinds: list[str], device_type: str = "cpu",
                choices: dict[str, int] | None = None) -> dict:
    """One shape at one temperature, against the plain run of the same prompts and params.
    Adaptive: its speculative steps' figures (rates up to its deepest candidate), `choices`
    (engine steps per choice, plain ones included), and tokens/s of the whole run."""
    st = SpecStats.total(o.spec for o in run.outputs)
    depth = max(S for S, _, _ in spec.candidate_shapes(device_type))
    by_kind = {k: SpecStats.total(o.spec for o, ok in zip(run.outputs, kinds) if ok == k)
               for k in sorted(set(kinds))}
    bad = greedy_mismatches(run.outputs, plain.outputs) if temperature == 0 else None
    return {"shape": shape_name(spec), "num_steps": spec.num_steps, "topk": spec.topk,
            "num_draft_tokens": spec.num_draft_tokens, "temperature": temperature,
            "accept_length_mean": st.accept_length_mean, "verify_steps": st.verify_steps,
            "draft_tokens": st.draft_tokens, "accepted_tokens": st.accepted_tokens,
            "accept_histogram": dict(sorted(st.accept_histogram.items())),
            "position_rates": st.position_rates(depth),
            **({"choices": dict(sorted((choices or {}).items()))} if spec.adaptive else {}),
            "accept_length_by_kind": {k: s.accept_length_mean for k, s in by_kind.items()},
            "tokens": run.tokens, "seconds": run.seconds, "tokens_per_s": run.tokens_per_s,
            "plain_tokens_per_s": plain.tokens_per_s,
            "speedup": run.tokens_per_s / plain.tokens_per_s if plain.tokens_per_s else None,
            "greedy_mismatches": None if bad is None else len(bad), "mismatched": bad}


def engine_choices(engine: Engine) -> dict[str, int]:
    """Engine steps per adaptive choice so far ("plain", "S3K1N4", ...; {} for a fixed
    shape): the worker counts them engine-wide, not per request."""
    st = getattr(engine.runner, "stats", None)
    return dict(getattr(st, "choices", None) or {})


def parse_also(items: list[str] | None, algorithm: str) -> list[tuple[str, str]]:
    """--also-draft values, each "ALGORITHM:PATH" or a PATH for --spec's algorithm ->
    [(algorithm, draft)]."""
    out = []
    for item in items or []:
        alg, sep, path = item.partition(":")
        if not sep or alg not in ("eagle", "eagle3", "multi_layer_eagle"):
            alg, path = algorithm, item
        if alg == "none" or not path:
            raise ConfigError(f"--also-draft {item!r}: give ALGORITHM:PATH (eagle, eagle3, "
                              f"multi_layer_eagle) or a PATH for --spec {algorithm}")
        out.append((alg, path))
    return out


def check_drafts(drafts: list[tuple[str, str]]) -> None:
    """Every (algorithm, draft) to be measured has a checkpoint directory with a config and
    weights ("default": the shipped head of that algorithm; "random": none needed), checked
    before the first model loads: a bad --also-draft fails at once, not after the runs
    before it (whose figures a failure at the end would lose)."""
    from eaglekv.config import SpecConfig
    from eaglekv.model.draft_io import check_draft_dir
    from eaglekv.speculative.factory import draft_path
    for alg, draft in drafts:
        if draft not in (None, "random"):
            check_draft_dir(draft_path(SpecConfig(algorithm=alg, draft_model=draft)),
                            f"{alg} draft")


def evaluate(base: EngineConfig, algorithm: str, draft: str, prompts: list[dict],
             shapes: list[tuple[int, int, int]], temperatures: list[float],
             max_new_tokens: int = 128, seed: int = 0,
             make_engine: Callable[[EngineConfig], Engine] = Engine,
             log: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr),
             also: list[tuple[str, str]] = ()) -> dict:
    """Every shape x temperature against plain decoding (see the module doc). `base`: the
    engine's config without speculation (its max_running_requests: the requests in flight);
    `make_engine` builds each engine from its config (tests pass a scripted drafter). `also`:
    more (algorithm, draft) pairs measured in the same process against the same plain runs,
    so two heads compare side by side; each run records its algorithm and draft."""
    if base.speculative.enabled:
        raise ConfigError("evaluate's base config must be plain; the shapes set speculation")
    if algorithm == "none":
        raise ConfigError("--spec none has no draft to evaluate; give eagle or eagle3")
    specs = [SpecConfig(alg, d, adaptive=True) if sh == ADAPTIVE else
             SpecConfig(alg, d, adaptive=True, shapes=sh[1]) if sh[0] == ADAPTIVE else
             SpecConfig(alg, d, *sh, adaptive=False)
             for alg, d in [(algorithm, draft), *also] for sh in shapes]
    params = {T: [SamplingParams(max_new_tokens=max_new_tokens, temperature=T, seed=seed + i)
                  for i in range(len(prompts))] for T in temperatures}
    kinds = [p["kind"] for p in prompts]
    warm = SamplingParams(max_new_tokens=min(8, max_new_tokens))
    # 1. plain decoding, once per temperature
    engine = make_engine(base)
    ids = prompt_ids(engine, prompts)
    engine.generate(ids[:1], warm)
    plain = {T: run_prompts(engine, ids, params[T]) for T in temperatures}
    for T, r in plain.items():
        log(f"plain T={T}: {r.tokens} tokens in {r.seconds:.1f}s = {r.tokens_per_s:.1f} tok/s")
    del engine
    # 2. each shape, fixed, at each temperature
    runs = []
    for spec in specs:
        engine = make_engine(dataclasses.replace(base, speculative=spec))
        engine.generate(ids[:1], warm)
        for T in temperatures:
            before = engine_choices(engine)
            run = run_prompts(engine, ids, params[T])
            after = engine_choices(engine)
            runs.append({"algorithm": spec.algorithm, "draft": spec.draft_model,
                         **run_figures(spec, T, run, plain[T], kinds,
                                       torch.device(base.device).type,
                                       {c: n - before.get(c, 0) for c, n in after.items()
                                        if n > before.get(c, 0)})})
            log(row(runs[-1], label=bool(also)))
        del engine
    dev = torch.device(base.device)
    return {"date": datetime.datetime.now().isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "machine": f"{platform.machine()} {os.cpu_count()} cpus", "torch": torch.__version__,
            "model": base.model, "dtype": base.dtype, "algorithm": algorithm, "draft": draft,
            "also": [list(a) for a in also],
            "batch": base.max_running_requests, "max_new_tokens": max_new_tokens, "seed": seed,
            "prompts": len(prompts), "prompt_tokens_mean": sum(map(len, ids)) / len(ids),
            "prompts_by_kind": {k: kinds.count(k) for k in sorted(set(kinds))},
            "plain": [{"temperature": T, "tokens": r.tokens, "seconds": r.seconds,
                       "tokens_per_s": r.tokens_per_s} for T, r in plain.items()],
            "runs": runs}


def row(r: dict, label: bool = False) -> str:
    """One run's table line; `label`: prefixed by its algorithm and draft (several drafts)."""
    head = f"{r['algorithm']}:{r['draft']}  " if label else ""
    rates = " ".join(f"{x:.2f}" for x in r["position_rates"])
    kinds = " ".join(f"{k} {v:.2f}" for k, v in r["accept_length_by_kind"].items())
    bad = "-" if r["greedy_mismatches"] is None else str(r["greedy_mismatches"])
    speedup = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"
    steps = ""
    if r.get("choices"):      # adaptive: engine steps per choice, most first
        steps = "  steps " + " ".join(f"{c} {n}" for c, n in sorted(
            r["choices"].items(), key=lambda cn: -cn[1]))
    return (f"{head}{r['shape']:<14} {r['temperature']:>4g} {r['accept_length_mean']:>6.2f}  "
            f"{rates:<30} {r['tokens_per_s']:>8.1f} {r['plain_tokens_per_s']:>8.1f} "
            f"{speedup:>7} {bad:>4}  {kinds}{steps}")


def table(result: dict) -> str:
    head = (f"{'shape':<14} {'T':>4} {'accept':>6}  {'rate per draft position':<30} "
            f"{'spec t/s':>8} {'plain':>8} {'speedup':>7} {'mism':>4}  accept by kind")
    return "\n".join([f"{result['algorithm']} draft {result['draft']!r} on {result['model']!r}"
                      f" ({result['device']}, {result['prompts']} prompts, batch "
                      f"{result['batch']}, {result['max_new_tokens']} new tokens)"
                      + "".join(f", also {a}:{d}" for a, d in result.get("also", [])), head]
                     + [row(r, label=bool(result.get("also"))) for r in result["runs"]])


def main(args, base: EngineConfig) -> dict:
    """`eaglekv eval-draft`: `args` its parsed flags, `base` the plain engine config the CLI
    built from them; prints the table and writes the JSON to --out."""
    shapes, temps = parse_shapes(args.shapes), parse_temperatures(args.temperatures)
    prompts = load_prompts(args.prompts, args.max_prompts)   # all checked before a model loads
    also = parse_also(getattr(args, "also_draft", None), args.spec)
    check_drafts([(args.spec, args.draft)] + also)
    result = evaluate(base, args.spec, args.draft, prompts, shapes, temps,
                      args.max_new_tokens, args.seed, also=also)
    result = {"command": args.command_line, "prompts_file": args.prompts, **result}
    print(table(result))
    out = Path(args.out or f"bench/results/eval_draft_{args.spec}_"
                           f"{torch.device(base.device).type}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"[eaglekv] -> {out}", file=sys.stderr)
    return result
