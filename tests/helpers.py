"""Shared test helpers (plain functions and constants; the fixtures are in conftest.py): tiny
random Llama-family checkpoints and engines on them, the HF greedy oracle, the prompts, scripted
oracles and fresh-prefill K/V of the speculative engine tests, and the tree tests' random
candidate pools. Test modules import these; they never import each other.

conftest.py imports this module, so it imports nothing from eaglekv at module level: a Triton
test file run on its own sets TRITON_INTERPRET before its first eaglekv import."""

from __future__ import annotations

import random

import torch


# ---- tiny random checkpoints and engines on them -----------------------------------------------
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            rms_norm_eps=1e-5, tie_word_embeddings=False)


def make_tiny(path, model_type: str = "llama", seed: int = 0, **overrides):
    """Save a random HF model of `model_type` to `path`; returns the HF model (fp32, eval)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(model_type, **{**TINY, **overrides})
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # weights big enough that the greedy argmax is rarely a near-tie
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)
            elif p.dim() == 2:
                p.normal_(0, 0.08)
            else:
                p.normal_(0, 0.02)
    model.save_pretrained(path, safe_serialization=True)
    return model


def tiny_engine(tiny_dir, **options):
    from eaglekv import Engine, EngineConfig
    options.setdefault("max_total_tokens", 2048)
    drafter = options.pop("drafter", None)
    return Engine(EngineConfig(model=str(tiny_dir), **options), drafter=drafter)


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    """HF transformers greedy continuation (stops at EOS like eaglekv does)."""
    with torch.inference_mode():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                          attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()


def forward_chunks(engine, ids: list[int], chunks: list[int]) -> torch.Tensor:
    """Run `ids` through the engine's model as a prefill plus extends of the given sizes on
    the paged cache; returns the logits of every position (len(ids), V). Frees its KV."""
    from eaglekv.core import ForwardBatch
    assert sum(chunks) == len(ids)
    row = engine.req_to_token.alloc()
    pos, last, logits = 0, -1, []
    try:
        for n in chunks:
            slots = engine.allocator.alloc(n, pos, last)
            engine.req_to_token.req_to_token[row, pos:pos + n] = slots.int()
            batch = ForwardBatch.build([ids[pos:pos + n]], [pos], [row], slots)
            logits.append(engine.model.forward(batch, engine.backend).logits)
            pos, last = pos + n, int(slots[-1])
    finally:
        engine.allocator.free(engine.req_to_token.req_to_token[row, :pos])
        engine.req_to_token.free(row)
    return torch.cat(logits)


# ---- the speculative engine tests: prompts, scripted oracles, fresh prefill ---------------------
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], list(range(20, 47)), [100, 3, 100, 3]]


def oracle(prompts, refs, wrong=lambda j: False, topk=1):
    """propose(context): the reference's next token (or a wrong one where wrong(j) for output
    index j), then topk - 1 other tokens."""
    def propose(ctx):
        for p, r in zip(prompts, refs):
            n = len(ctx) - len(p)
            if n >= 0 and ctx[:len(p)] == p and ctx[len(p):] == r[:n] and n < len(r):
                tok = r[n]
                first = (tok + 1) % 256 if wrong(n) else tok
                return [first] + [(tok + 2 + i) % 256 for i in range(topk - 1)]
        return [0]
    return propose


def expected_accepts(ref_len_needed, S, wrong, max_new):
    """Simulate a chain script: the root is output index r; depth d proposes index r + d."""
    accepts, r = [], 0   # output[0] comes from prefill
    while r + 1 < max_new:
        a = 0
        while a < S and not wrong(r + a + 1):
            a += 1
        accepts.append(a)
        r += a + 1
    return accepts


def fresh_kv(model, ids, device="cpu"):
    """Target K/V (per layer) and hidden states of a fresh prefill of `ids` on its own pool."""
    from eaglekv.attention import TorchAttentionBackend
    from eaglekv.core import ForwardBatch
    from eaglekv.memory import KVPool, ReqToTokenPool
    cfg = model.cfg
    n = len(ids)
    pool = KVPool(n + 1, 1, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, model.dtype,
                  device)
    r2t = ReqToTokenPool(1, n + 1, device=device)
    slots = torch.arange(1, n + 1, device=device)
    r2t.req_to_token[1, :n] = slots.to(torch.int32)
    batch = ForwardBatch.build([ids], [0], [1], slots, device)
    out = model.forward(batch, TorchAttentionBackend(pool, r2t), return_hidden=True)
    return pool, slots, out.hidden, r2t, batch


def spec(alg, S=3, K=1, N=None, draft="random"):
    return dict(algorithm=alg, draft_model=draft, num_steps=S, topk=K,
                num_draft_tokens=N or S + 1)


# ---- the tree tests: random EAGLE candidate pools ----------------------------------------------
def random_pool(rng: random.Random, B: int, K: int, S: int, coarse: bool = True, V: int = 40):
    """Candidate pools laid out as the drafter writes them (step-major, see
    eaglekv/speculative/tree.py), tokens in [0, V).

    Child log-probs on a coarse grid (many exact ties, 0.0 = a child tying its parent) when
    `coarse`; siblings carry distinct tokens; step i's K branches are the best K of step i-1.
    Returns python lists tokens, scores, parents (B x M) and roots (B)."""
    M = K + (S - 1) * K * K
    toks, scores, parents = [], [], []
    for _ in range(B):
        tok, sc, par = [0] * M, [0.0] * M, [-1] * M

        def children(base, parent_idx, parent_score):
            lp = sorted(((-0.5 * rng.randint(0, 3)) if coarse else -rng.random() * 3
                         for _ in range(K)), reverse=True)
            for c, (t, l) in enumerate(zip(rng.sample(range(V), K), lp)):
                tok[base + c], sc[base + c], par[base + c] = t, parent_score + l, parent_idx

        children(0, -1, 0.0)
        branches = list(range(K))
        for i in range(1, S):
            base = K + (i - 1) * K * K
            for t, b in enumerate(branches):
                children(base + t * K, b, sc[b])
            step = range(base, base + K * K)
            branches = sorted(step, key=lambda m: (-sc[m], m))[:K]
        toks.append(tok)
        scores.append(sc)
        parents.append(par)
    roots = [rng.randrange(V) for _ in range(B)]
    return toks, scores, parents, roots


def make_predictable(engine, o_scale: float = 0.1, hidden_mix: float = 0.005) -> None:
    """Turn a tiny engine's target into a near-bigram model (every layer's MLP off, attention
    scaled by `o_scale`) and, if it has an EAGLE-1/2 draft, make the draft predict that
    target's bigram part exactly (its feature w_norm * embed(token): the same argmax as the
    target's head on norm(embed(token))). With o_scale 0 every draft is accepted; at 0.1 the
    attention flips some of them, so accept lengths vary (a random draft accepts none), and
    the target's tokens still depend on its KV. A plain engine given the same call decodes
    the same target. `hidden_mix`: the draft's feature also takes a little of its input
    feature (random weights of that scale), so a stale or wrong feature changes its logits."""
    m = engine.model
    for layer in m.layers:
        layer.o.mul_(o_scale)
        layer.down.zero_()
        if getattr(layer, "down_rows", None) is not None:   # the fused MLP's copy of down
            layer.down_rows.zero_()
    worker = getattr(engine, "worker", None)
    if worker is None:
        return
    dm = worker.drafter.model
    H = m.cfg.hidden_size
    fc = torch.zeros_like(dm.fc)
    fc[:H] = torch.diag(m.norm.to(fc.dtype))
    g = torch.Generator().manual_seed(0)
    fc[H:] = hidden_mix * torch.randn(fc.shape[0] - H, H, generator=g).to(fc.dtype)
    dm.fc.copy_(fc)
    if dm.fc_bias is not None:
        dm.fc_bias.zero_()
    dm.layer.o.zero_()
    dm.layer.down.zero_()
