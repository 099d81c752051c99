"""A batch-1 replay of the adaptive policy against fixed shapes, with the GPU's step mechanics
(issue 15): a held speculative choice runs as a chain of whole steps before one sync, as
`AdaptiveWorker` runs it under CUDA graphs; any other speculative choice is one step and a
sync; an all-plain choice decodes its horizon as one chain, and the draft catches up on those
tokens before the next speculative step. Acceptance comes in runs, as real text's does: the
text alternates between easy stretches (each next draft accepted with `q_easy`) and hard ones
(`q_hard`), Markov in the token position, and a response starts hard (its first tokens
depend on the prompt the draft has not seen much of).

The costs are the H100's at batch 1 (bench/results/gpu_bench_h100_20261206_diag.json, the
adaptive rows' step traces, prefill graphs on): an S5 chain of six steps took ~10.0 ms, an S3
chain of eight ~8.1 ms, a plain chain of 32 tokens ~19.4 ms, a single S5 step ~2.0 ms, and
the draft's catch-up over 32 plain tokens ~3 ms (~2 ms over 16).

    python -m eaglekv.testing.adaptive_sim   # adaptive against the fixed shapes and plain, 40
                                             # requests of 256 tokens, six kinds of text
    python -m eaglekv.testing.adaptive_sim --learn   # the cost table learnt as the worker
                                             # learns it, with and without chained costs

A held choice is held for the longest shape's chain and its held steps are consumed at once,
each shape cutting the chain to its own length (AdaptiveWorker; until 2026-12-06 evening the
replay held for the shortest shape's chain).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from eaglekv.speculative.adaptive import (CATCHUP, CHAIN, PLAIN, AdaptivePolicy, CostTable,
                                          Shape)

SHAPES = (Shape(3, 1, 4), Shape(5, 1, 6), Shape(4, 2, 8))


@dataclass
class Mechanics:
    """Milliseconds of the step parts (batch 1, H100, 2026-12-06)."""
    step_ms: dict = field(default_factory=lambda: {"S5K1N6": 1.60, "S3K1N4": 1.30,
                                                   "S4K2N8": 1.85})
    sync_ms: float = 0.40           # a replay's launch and the host's sync after it
    plain_token_ms: float = 0.60    # a token of a plain chain
    catchup_ms: float = 1.0         # the draft's catch-up over plainly decoded tokens: a
    catchup_token_ms: float = 0.06  # launch, and this a token (~3 ms after 32, ~2 after 16)
    decode_steps: int = 32          # num_scheduler_steps: the plain chain's longest

    def chain_steps(self, shape: Shape) -> int:
        return max(1, -(-self.decode_steps // (shape.S + 1)))

    def costs(self) -> CostTable:
        """What the policy's cost table settles at: a chained step's ms with its share of the
        sync, a plain chain's ms a token, the catch-up's ms a token."""
        t = CostTable(drop_first=False)
        for label, ms in self.step_ms.items():
            s = Shape(*map(int, label[1:].replace("K", " ").replace("N", " ").split()))
            t.cells[CostTable.key(label, 1)] = [
                1e-3 * (ms + self.sync_ms / self.chain_steps(s)), t.seed]
        t.cells[CostTable.key(CHAIN, 1)] = [1e-3 * (self.plain_token_ms
                                                    + self.sync_ms / self.decode_steps), t.seed]
        t.cells[CostTable.key(PLAIN, 1)] = [1e-3 * (self.plain_token_ms + self.sync_ms), t.seed]
        t.cells[CostTable.key(CATCHUP, 1)] = [1e-3 * (self.catchup_token_ms + self.catchup_ms
                                                     / self.decode_steps), t.seed]
        t.frozen = True
        return t


class Text:
    """Where drafts are easy and hard: a two-state Markov chain over token positions."""

    def __init__(self, rng: np.random.Generator, q_easy: float = 0.99, q_hard: float = 0.3,
                 easy_run: float = 150.0, hard_run: float = 4.0, hard_start: int = 12,
                 collapse_at: int | None = None, q_collapsed: float = 0.05):
        """The defaults give fixed S5 4.7 tokens a step and S3 3.4 (the H100 bench's prompts:
        4.72 and 3.25). `collapse_at`: from that position on every draft is accepted with
        `q_collapsed` (the text turned random)."""
        self.rng, self.q = rng, (q_easy, q_hard)
        self.collapse_at, self.q_collapsed = collapse_at, q_collapsed
        self.leave = (1.0 / easy_run, 1.0 / hard_run)
        self.hard, self.pos, self.hard_start = True, 0, hard_start

    def _advance(self) -> None:
        self.pos += 1
        if self.collapse_at is not None and self.pos == self.collapse_at:
            self.q = (self.q_collapsed, self.q_collapsed)
        if self.pos > self.hard_start and self.rng.random() < self.leave[self.hard]:
            self.hard = not self.hard

    def accepted(self, shape: Shape) -> int:
        """Drafts a step of `shape` accepts here (a tree: a little more likely each);
        the position moves past them and the bonus token."""
        a = 0
        while a < shape.S:
            q = self.q[self.hard] + (0.03 if shape.K > 1 else 0.0)
            if self.rng.random() >= min(q, 1.0):
                break
            a += 1
            self._advance()
        self._advance()
        return a

    def plain(self, k: int) -> None:
        for _ in range(k):
            self._advance()


# text like the held-out prompts' on an H100 (2026-12-06): fixed S3 / S5 / S7 accept 2.5 / 2.8 /
# 3.0 tokens a step here (2.77 / 3.05 / 3.12 measured on the first held-out prompt)
HELDOUT_LIKE = dict(q_easy=0.9, q_hard=0.35, easy_run=12, hard_run=6, hard_start=4)


class _Req:
    def __init__(self, rid: int):
        self.rid = self.row = rid


def run_fixed(shape: Shape, seed: int, tokens: int, mech: Mechanics,
              text_options: dict | None = None) -> float:
    """ms for one request of `tokens` under a fixed shape, chained as the engine chains it."""
    text, made, ms = Text(np.random.default_rng(seed), **(text_options or {})), 0, 0.0
    n = mech.chain_steps(shape)
    while made < tokens:
        ms += mech.sync_ms
        for _ in range(n):
            if made >= tokens:
                break
            made += 1 + text.accepted(shape)
            ms += mech.step_ms[shape.label]
    return ms


def run_adaptive(policy: AdaptivePolicy, seed: int, tokens: int, mech: Mechanics,
                 rid: int, text_options: dict | None = None, learn: bool = False,
                 chained_costs: bool = False) -> tuple[float, dict]:
    """ms for one request under the policy, and its choices' counts. `learn`: the policy's
    cost table is not frozen and observes each step as AdaptiveWorker does (a plain chain per
    token, the draft's catch-up per lagging token, a speculative chain per step, each with its
    launch and sync); `chained_costs`: AdaptiveWorker.chained_costs (an exploring step runs as
    a whole chain; a chain cut short is not observed once its cell is known)."""
    text = Text(np.random.default_rng(seed), **(text_options or {}))
    made, ms, lag = 0, 0.0, 0
    r, counts = _Req(rid), {}
    costs = policy.costs
    while made < tokens:
        c = policy.choose([r], chain=True)
        counts[c.label] = counts.get(c.label, 0) + 1
        if c.shape is None:
            k = min(policy.plain_horizon([r], mech.decode_steps), tokens - made)
            if c.explore:            # measuring the chain cell: a chain (EXPLORE_CHAIN)
                k = min(max(k, 8), tokens - made)
            text.plain(k)
            policy.observe_plain([r], k)
            step = k * mech.plain_token_ms + mech.sync_ms
            made, lag, ms = made + k, lag + k, ms + step
            if learn:
                costs.observe(CHAIN if k > 1 else PLAIN, 1, 1e-3 * step / k)
            continue
        offered = 1 + policy.held_steps()      # a held choice's steps, consumed all at once
        steps = min(offered, mech.chain_steps(c.shape))     # (AdaptiveWorker._speculate)
        if chained_costs and c.explore:
            steps = mech.chain_steps(c.shape)
        if lag:
            catch = mech.catchup_ms + lag * mech.catchup_token_ms
            ms += catch
            if learn:
                costs.observe(CATCHUP, 1, 1e-3 * catch / lag)
        ms += mech.sync_ms
        lag = 0
        done = 0
        acc = []
        for _ in range(steps):
            if made >= tokens:
                break
            a = text.accepted(c.shape)
            acc.append(a)
            made += 1 + a
            ms += mech.step_ms[c.shape.label]
            done += 1
        policy.consume_held(offered - 1)
        for a in acc:
            policy.observe_spec([r], c.shape, [a])
        if learn and not (chained_costs and done < steps and costs.known(c.shape.label, 1)):
            costs.observe(c.shape.label, 1, 1e-3 * (mech.sync_ms
                                                    + done * mech.step_ms[c.shape.label]) / done)
    return ms, counts


def compare(requests: int = 40, tokens: int = 256, mech: Mechanics | None = None,
            policy_options: dict | None = None, text_options: dict | None = None,
            learn: bool = False, chained_costs: bool = False, warmup: int = 0,
            shapes=SHAPES, gated_depth: int | None = None) -> dict:
    """Adaptive (one policy across the requests, as an engine keeps it, with the settings
    AdaptiveWorker gives it under chains unless `policy_options` says otherwise) against
    each fixed shape and plain chains, over the same texts: their total ms and the ratios.
    `learn` / `chained_costs`: `run_adaptive`'s; `warmup`: requests the policy serves first,
    not counted (an engine's earlier requests and its cost cache on disk); `shapes` the
    candidates, `gated_depth` the policy's gate (AdaptivePolicy.gated_depth)."""
    mech = mech or Mechanics()
    opts = {**AdaptivePolicy.CHAINED, **(policy_options or {})}   # as AdaptiveWorker sets
    policy = AdaptivePolicy(list(shapes), CostTable(drop_first=True) if learn
                            else mech.costs())                      # them under chains
    for name, value in opts.items():
        setattr(policy, name, value)
    policy.gated_depth = gated_depth
    # as AdaptiveWorker: held for the longest chain, each shape cutting it to its own
    policy.hold_spec = max(policy.hold_spec, max(mech.chain_steps(s) for s in shapes) - 1)
    fixed = {s.label: sum(run_fixed(s, seed, tokens, mech, text_options)
                          for seed in range(requests))
             for s in shapes}
    plain = requests * (tokens * mech.plain_token_ms + -(-tokens // mech.decode_steps)
                        * mech.sync_ms)
    for seed in range(requests, requests + warmup):        # other texts of the same kind
        run_adaptive(policy, seed, tokens, mech, seed + 1, text_options, learn, chained_costs)
    total, counts = 0.0, {}
    for seed in range(requests):
        ms, c = run_adaptive(policy, seed, tokens, mech, seed + 1 + requests + warmup,
                             text_options, learn, chained_costs)
        total += ms
        for k, v in c.items():
            counts[k] = counts.get(k, 0) + v
    best = min(fixed.values())
    return {"adaptive_ms": total, "fixed_ms": fixed, "plain_ms": plain,
            "adaptive_vs_best_fixed": best / total, "adaptive_vs_plain": plain / total,
            "choices": counts}


if __name__ == "__main__":
    import datetime
    import json
    import sys
    texts = {"bench-like": {}, "longer-dips": dict(hard_run=10, easy_run=60),
             "flat": dict(q_hard=0.99, hard_start=0), "poor": dict(q_easy=0.5, q_hard=0.3),
             "random": dict(q_easy=0.05, q_hard=0.05), "collapse-at-100": dict(collapse_at=100)}
    out = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "device": "host only: a replay of the policy with the H100's batch-1 step costs",
           "command": "python -m eaglekv.testing.adaptive_sim " + " ".join(sys.argv[1:]),
           "settings": {"as shipped under chains": {}, "before 2026-12-06": {
               "shrink": 0.0, "alpha": 0.3, "hold_all": False, "engine_after": 0}},
           "results": {}}
    if "--gate" in sys.argv:
        # the 7-step chain among the candidates, ungated and behind the gate at depth 5
        # (config.ADAPTIVE_GATED_SHAPES), the cost table learnt, at the H100's batch-1 costs
        # after the decode-kernel verify with S7's step ~0.33 ms past S5's (S3 -> S5 cost that)
        mech = Mechanics(step_ms={"S3K1N4": 1.03, "S5K1N6": 1.355, "S4K2N8": 1.75,
                                  "S7K1N8": 1.68}, sync_ms=0.6)
        s7 = (*SHAPES, Shape(7, 1, 8))
        texts = {"bench-like": {}, "heldout-like": HELDOUT_LIKE, "flat": texts["flat"],
                 **{k: texts[k] for k in ("longer-dips", "poor", "random")}}
        out["device"] += " (after the decode-kernel verify), the cost table learnt"
        settings = {"S3, S5, S4K2N8 (before)": {},
                    "and S7, ungated": dict(shapes=s7),
                    "and S7, gated at depth 5 (shipped)": dict(shapes=s7, gated_depth=5)}
        out["settings"] = {k: {n: ([sh.label for sh in v] if n == "shapes" else v)
                               for n, v in o.items()} for k, o in settings.items()}
        for name, opts in settings.items():
            out["results"][name] = {t: compare(24, 128, mech, text_options=kw, warmup=24,
                                               learn=True, chained_costs=True, **opts)
                                    for t, kw in texts.items()}
    elif "--learn" in sys.argv:
        # the cost table learnt as AdaptiveWorker learns it (after 24 requests of warm-up, as
        # an engine with its cost cache), with and without chained costs, at the H100's batch-1
        # costs after the decode-kernel verify (2026-12-06 14:00: chains of 8 S3 steps 8.85 ms,
        # of 6 S5 steps 8.73 ms, a launch and sync ~0.6 ms), 24 requests of 128 tokens
        mech = Mechanics(step_ms={"S3K1N4": 1.03, "S5K1N6": 1.355, "S4K2N8": 1.75},
                         sync_ms=0.6)
        texts = {"bench-like": {}, "heldout-like": HELDOUT_LIKE, **{
            k: texts[k] for k in ("longer-dips", "poor", "random")}}
        out["device"] += " (after the decode-kernel verify), the cost table learnt"
        out["settings"] = {"costs frozen at the mechanics": {}, "learnt": dict(learn=True),
                           "learnt, chained costs": dict(learn=True, chained_costs=True)}
        for name, opts in out["settings"].items():
            out["results"][name] = {t: compare(24, 128, mech, text_options=kw, warmup=24,
                                               **opts) for t, kw in texts.items()}
    else:
        for name, opts in out["settings"].items():
            out["results"][name] = {t: compare(policy_options=opts, text_options=kw)
                                    for t, kw in texts.items()}
    print(json.dumps(out, indent=1))
