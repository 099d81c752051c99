"""Train an EAGLE-1/2 draft head for a target model by self-distillation (EAGLE-1 recipe).

1. Prompts from templates (tasks x topics, chat-templated, plus some raw-text continuations),
   tokenised on the CPU: `python -m eaglekv.training.train_draft prompts --out prompts.json`.
2. `python -m eaglekv.training.train_draft train --prompts prompts.json --out DIR ...` (on a GPU):
   the target (Hugging Face transformers, built from eaglekv's loader so the weights are the
   ones the engine serves) writes the responses (`generate`, batched, left padding, sampled at
   temperature 0.7 / top-p 0.95 and some greedy), then one forward per batch gives the feature
   f_p of every position = the target's last hidden state after the final norm (what its LM
   head reads).
3. The head (`EagleHead`, a plain nn.Module in the published key layout) learns, for every
   position p, (tok_{p+1}, f_p) -> g_p with g_p ~ f_{p+1}:
       loss = SmoothL1(g_p, f_{p+1}) + 0.1 * CE(softmax(head(f_{p+1})), head(g_p))
   with uniform noise on the input features, causal attention over the head's own positions
   and RoPE at the token positions, exactly as the engine runs it (draft input at position p is
   (token p+1, feature p)). Top-1 accuracy = argmax head(g_p) == argmax head(f_{p+1}) (what a
   greedy verify accepts); a 3-step greedy chain on held-out greedy responses estimates the
   accept length of `--num-steps 3 --topk 1`.
4. The head is saved with `save_eagle_draft` (bf16, safetensors, no embed_tokens: the engine
   uses the target's embedding and LM head).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

# ---- prompts -------------------------------------------------------------------------------------
TASKS = [
    "Explain {t} in simple terms.", "Explain {t} to a ten-year-old.", "What is {t}?",
    "Describe {t}.", "Give me a short overview of {t}.", "Write a short story about {t}.",
    "Write a poem about {t}.", "Write a haiku about {t}.", "List five facts about {t}.",
    "List the pros and cons of {t}.", "Compare {t} and {u}.",
    "What is the difference between {t} and {u}?", "How does {t} work?",
    "Summarize the history of {t}.", "Why is {t} important?", "Give three tips about {t}.",
    "Write a short essay about {t}.", "Write a blog post introduction about {t}.",
    "What are common misconceptions about {t}?", "Explain how {t} relates to {u}.",
    "Write a dialogue between two friends about {t}.", "Write a product description for {t}.",
    "Give me a step-by-step guide to learning about {t}.", "What are the main uses of {t}?",
    "Write an email to a colleague about {t}.", "Tell me a fun fact about {t}.",
    "What questions should I ask to understand {t}?", "Describe a day in the life of {t}.",
    "Write a limerick about {t}.", "What would happen if {t} disappeared?",
    "Can you help me understand {t}?", "Write a news headline and a short article about {t}.",
    "Give an example of {t} in everyday life.", "What are the benefits of {t}?",
    "Write a letter to {t}.", "Summarize {t} in three sentences.",
    "Make a quiz with three questions about {t}.", "Describe {t} using only simple words.",
]
HOWTO = [
    "How do I {a}?", "What is the best way to {a}?", "Give me step-by-step instructions to {a}.",
    "What are some tips to {a}?", "I want to {a}. Where should I start?",
    "Write a short guide on how to {a}.", "What mistakes should I avoid when I {a}?",
]
TOPICS = [
    "photosynthesis", "black holes", "the water cycle", "volcanoes", "earthquakes",
    "climate change", "the moon", "the solar system", "gravity", "electricity", "magnetism",
    "the human heart", "the immune system", "DNA", "evolution", "dinosaurs", "bees", "whales",
    "octopuses", "penguins", "elephants", "cats", "dogs", "a lighthouse keeper", "a robot",
    "a dragon", "a wizard", "a lonely astronaut", "a detective", "a talking tree", "pirates",
    "the ocean", "rainforests", "deserts", "mountains", "rivers", "the Arctic", "autumn",
    "winter", "spring", "summer", "friendship", "kindness", "courage", "happiness", "time",
    "music", "jazz", "classical music", "painting", "photography", "poetry", "chess", "soccer",
    "basketball", "the Olympic Games", "yoga", "meditation", "sleep", "healthy eating",
    "coffee", "tea", "chocolate", "bread", "pizza", "sushi", "cooking pasta", "gardening",
    "composting", "recycling", "solar energy", "wind power", "nuclear energy", "batteries",
    "electric cars", "airplanes", "trains", "bicycles", "the internet", "email",
    "social media", "smartphones", "computers", "programming", "Python", "JavaScript",
    "databases", "machine learning", "neural networks", "artificial intelligence", "robots",
    "cryptography", "passwords", "cloud computing", "video games", "virtual reality",
    "3D printing", "the printing press", "the Roman Empire", "ancient Egypt", "the pyramids",
    "the Renaissance", "the Industrial Revolution", "the French Revolution", "World War I",
    "the Cold War", "the moon landing", "democracy", "taxes", "inflation", "money", "banks",
    "the stock market", "budgeting", "saving money", "entrepreneurship", "marketing",
    "leadership", "teamwork", "public speaking", "job interviews", "remote work",
    "time management", "procrastination", "habits", "learning a language", "reading books",
    "libraries", "museums", "newspapers", "the theater", "movies", "cartoons", "comic books",
    "fairy tales", "mythology", "Greek gods", "the Vikings", "castles", "knights", "samurai",
    "volunteering", "charity", "cities", "villages", "farming", "cows", "horses", "honey",
    "apples", "bananas", "rice", "potatoes", "vitamins", "exercise", "running", "swimming",
    "hiking", "camping", "travel", "maps", "compasses", "stars", "galaxies", "Mars", "Jupiter",
    "comets", "telescopes", "microscopes", "bacteria", "viruses", "vaccines", "antibiotics",
    "the brain", "memory", "dreams", "emotions", "empathy", "curiosity", "creativity",
    "mathematics", "prime numbers", "fractions", "geometry", "probability", "statistics",
    "algebra", "calculus", "physics", "chemistry", "biology", "geology", "weather", "clouds",
    "rainbows", "lightning", "snow", "hurricanes", "tides", "coral reefs", "sharks",
    "butterflies", "ants", "spiders", "birds", "owls", "eagles", "trees", "flowers", "mushrooms",
    "plastic pollution", "clean water", "air quality", "a small bakery", "a busy airport",
    "a haunted house", "a secret garden", "a time machine", "a magic book", "a lost key",
    "a snowy night", "a rainy afternoon", "a birthday party", "a wedding", "a school trip",
    "a new job", "moving to a new city", "a grandmother's recipe", "an old photograph",
    "a broken clock", "the first day of school", "a football match", "a summer festival",
    "the color blue", "silence", "the wind", "the number zero", "light", "sound", "fire",
    "glass", "paper", "wood", "steel", "gold", "diamonds", "salt", "sugar", "oxygen",
    "the periodic table", "atoms", "energy", "friction", "bridges", "skyscrapers", "roads",
    "traffic", "public transport", "electric guitars", "the piano", "the violin", "drums",
    "singing", "dancing", "ballet", "sculpture", "architecture", "fashion", "recipes",
    "breakfast", "vegetarian food", "spices", "fermentation", "cheese", "ice cream", "soup",
]
ACTIONS = [
    "bake bread", "learn to code", "start a vegetable garden", "save money", "write a resume",
    "prepare for a job interview", "learn to swim", "make a cup of tea", "train a puppy",
    "reduce stress", "fall asleep faster", "study for an exam", "learn a new language",
    "start running", "clean a kitchen", "organize my desk", "plan a trip", "write a novel",
    "make new friends", "give a presentation", "change a bike tire", "cook rice",
    "make pancakes", "build a website", "take better photos", "read more books",
    "stay focused", "wake up early", "drink more water", "set goals", "learn chess",
    "paint a landscape", "write a poem", "start a podcast", "recycle at home",
    "save energy at home", "care for a houseplant", "make a budget", "learn to draw",
    "play the guitar", "meditate", "prepare a healthy lunch", "write a thank-you note",
    "back up my computer", "create a strong password", "sort a list in Python",
    "reverse a string in Python", "read a CSV file in Python", "debug my code",
]
RAW = [
    "Once upon a time, {t}", "The history of {t} begins", "{T} is", "Here are some facts about {t}:",
    "In this article, we will discuss {t}.", "Chapter 1\n\nThe morning I first saw {t},",
    "Q: What is {t}?\nA:", "Write a short story about {t}.", "Dear diary, today I learned about {t}.",
    "The most interesting thing about {t} is", "def ", "# A Python script about {t}\n",
    "Title: {T}\n\n", "Many people wonder why {t}", "Step 1:", "Introduction\n\n{T} has",
]
CODE = [
    "Write a Python function that {c}.", "Write a JavaScript function that {c}.",
    "How would I write code that {c}?", "Show me a simple program that {c}.",
]
CODE_TASKS = [
    "checks if a number is prime", "reverses a string", "computes the factorial of n",
    "sorts a list of numbers", "counts the words in a sentence", "finds the largest number in a list",
    "converts Celsius to Fahrenheit", "checks whether a word is a palindrome",
    "returns the Fibonacci numbers up to n", "removes duplicates from a list",
    "reads a file and prints each line", "computes the average of a list",
    "merges two dictionaries", "finds the vowels in a string", "adds two matrices",
]


def build_prompts(n: int, seed: int = 0, raw_frac: float = 0.15) -> list[dict]:
    """`n` distinct prompts: {"text", "chat": bool}; chat ones get the chat template later."""
    rng = random.Random(seed)
    seen, out = set(), []
    while len(out) < n:
        r = rng.random()
        t, u = rng.sample(TOPICS, 2)
        if r < raw_frac:
            text = rng.choice(RAW).format(t=t, T=t[:1].upper() + t[1:])
            chat = False
        elif r < raw_frac + 0.15:
            text, chat = rng.choice(HOWTO).format(a=rng.choice(ACTIONS)), True
        elif r < raw_frac + 0.22:
            text, chat = rng.choice(CODE).format(c=rng.choice(CODE_TASKS)), True
        else:
            text, chat = rng.choice(TASKS).format(t=t, u=u), True
        if (text, chat) in seen:
            continue
        seen.add((text, chat))
        out.append({"text": text, "chat": chat})
    return out


def tokenize_prompts(tokenizer, prompts: list[dict]) -> list[dict]:
    """Add "ids": chat prompts through the chat template (as `Engine.apply_chat_template`)."""
    for p in prompts:
        if p["chat"]:
            text = tokenizer.apply_chat_template([{"role": "user", "content": p["text"]}],
                                                 tokenize=False, add_generation_prompt=True)
            p["ids"] = tokenizer.encode(text, add_special_tokens=False)
        else:
            p["ids"] = tokenizer.encode(p["text"], add_special_tokens=False)
    return prompts


# ---- the target ---------------------------------------------------------------------------------
def load_target(model: str, device, dtype=torch.float32):
    """(HF model, eaglekv ModelConfig): transformers' Llama with the weights eaglekv loads."""
    from transformers import AutoModelForCausalLM
    from eaglekv.model.loader import load_checkpoint
    ck = load_checkpoint(model, load_tokenizer=False)
    hf = AutoModelForCausalLM.from_config(ck.config.hf_config, dtype=dtype)
    missing, unexpected = hf.load_state_dict(ck.state_dict, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and ck.config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"target weights: missing {missing[:4]}, unexpected {unexpected[:4]}")
    if ck.config.tie_word_embeddings:
        hf.tie_weights()
    return hf.to(device).eval(), ck.config


@torch.no_grad()
def generate(model, prompts: list[dict], *, batch: int, max_new: int, greedy: bool,
             temperature: float, top_p: float, eos: list[int], pad: int,
             deadline: float = math.inf) -> list[dict]:
    """Responses for `prompts` (batched, left padding); stops starting batches at `deadline`.
    Returns [{"ids": prompt + response (through the first EOS), "n_prompt", "greedy", "chat"}]."""
    dev = next(model.parameters()).device
    out = []
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]["ids"]))
    for s in range(0, len(order), batch):
        if time.time() > deadline:
            break
        chunk = [prompts[i] for i in order[s:s + batch]]
        P = max(len(p["ids"]) for p in chunk)
        ids = torch.full((len(chunk), P), pad, dtype=torch.long)
        mask = torch.zeros((len(chunk), P), dtype=torch.long)
        for b, p in enumerate(chunk):
            ids[b, P - len(p["ids"]):] = torch.tensor(p["ids"])
            mask[b, P - len(p["ids"]):] = 1
        kw = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=temperature,
                                                       top_p=top_p, top_k=0)
        gen = model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev),
                             max_new_tokens=max_new, pad_token_id=pad, eos_token_id=eos,
                             **kw).cpu()
        resp = gen[:, P:]
        for b, p in enumerate(chunk):
            r = resp[b].tolist()
            ends = [i for i, tok in enumerate(r) if tok in eos]
            r = r[:ends[0] + 1] if ends else r
            out.append({"ids": list(p["ids"]) + r, "n_prompt": len(p["ids"]), "greedy": greedy,
                        "chat": p["chat"]})
    return out


def save_seqs(path, seqs: list[dict]) -> None:
    """The generated sequences, compactly: flat int32 ids, lengths, prompt lengths, flags."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    torch.save({"ids": torch.tensor([t for s in seqs for t in s["ids"]], dtype=torch.int32),
                "lens": torch.tensor([len(s["ids"]) for s in seqs], dtype=torch.int32),
                "n_prompt": torch.tensor([s["n_prompt"] for s in seqs], dtype=torch.int32),
                "greedy": torch.tensor([s["greedy"] for s in seqs]),
                "chat": torch.tensor([s["chat"] for s in seqs])}, path)


def load_seqs(path) -> list[dict]:
    d = torch.load(path, weights_only=True)
    ids = d["ids"].tolist()
    out, o = [], 0
    for n, p, g, c in zip(d["lens"].tolist(), d["n_prompt"].tolist(), d["greedy"].tolist(),
                          d["chat"].tolist()):
        out.append({"ids": ids[o:o + n], "n_prompt": p, "greedy": g, "chat": c})
        o += n
    return out


class FeatureData:
    """Sequences packed flat: tokens (N+1,), features (N+1, H) on the device (row N is zeros,
    the padding row), offsets per sequence, and the index batches that gather them."""

    def __init__(self, seqs: list[dict], tokens: torch.Tensor, feats: torch.Tensor,
                 offsets: list[int]):
        self.seqs, self.tokens, self.feats, self.offsets = seqs, tokens, feats, offsets
        self.pad_row = tokens.shape[0] - 1

    @property
    def num_tokens(self) -> int:
        return self.pad_row

    def batch(self, which: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """ids (B, T), feats (B, T, H), valid (B, T) of sequences `which`, right padded."""
        T = max(len(self.seqs[i]["ids"]) for i in which)
        idx = torch.full((len(which), T), self.pad_row, dtype=torch.long)
        for b, i in enumerate(which):
            n = len(self.seqs[i]["ids"])
            idx[b, :n] = torch.arange(self.offsets[i], self.offsets[i] + n)
        idx = idx.to(self.tokens.device)
        return self.tokens[idx], self.feats[idx], idx != self.pad_row


@torch.no_grad()
def extract_features(model, seqs: list[dict], *, max_batch_tokens: int = 65536) -> FeatureData:
    """f = the target's final-norm hidden state at every position (HF `hidden_states[-1]`)."""
    dev = next(model.parameters()).device
    H = model.config.hidden_size
    lens = [len(s["ids"]) for s in seqs]
    offsets = [0]
    for n in lens:
        offsets.append(offsets[-1] + n)
    N = offsets[-1]
    tokens = torch.zeros(N + 1, dtype=torch.long, device=dev)
    feats = torch.zeros(N + 1, H, dtype=torch.float32, device=dev)
    order = sorted(range(len(seqs)), key=lambda i: lens[i])
    s = 0
    while s < len(order):
        e = s + 1
        while e < len(order) and (e + 1 - s) * lens[order[e]] <= max_batch_tokens:
            e += 1
        which = order[s:e]
        T = max(lens[i] for i in which)
        ids = torch.zeros((len(which), T), dtype=torch.long)
        mask = torch.zeros((len(which), T), dtype=torch.long)
        for b, i in enumerate(which):
            ids[b, :lens[i]] = torch.tensor(seqs[i]["ids"])
            mask[b, :lens[i]] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        h = model.model(input_ids=ids, attention_mask=mask).last_hidden_state.float()
        for b, i in enumerate(which):
            tokens[offsets[i]:offsets[i + 1]] = ids[b, :lens[i]]
            feats[offsets[i]:offsets[i + 1]] = h[b, :lens[i]]
        s = e
    return FeatureData(seqs, tokens, feats, offsets[:-1])


# ---- the head ------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        return (self.weight.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True)
                                                       + self.eps))).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, H, heads, kv_heads, D):
        super().__init__()
        self.heads, self.kv_heads, self.D = heads, kv_heads, D
        self.q_proj = nn.Linear(H, heads * D, bias=False)
        self.k_proj = nn.Linear(H, kv_heads * D, bias=False)
        self.v_proj = nn.Linear(H, kv_heads * D, bias=False)
        self.o_proj = nn.Linear(heads * D, H, bias=False)


class MLP(nn.Module):
    def __init__(self, H, I):
        super().__init__()
        self.gate_proj = nn.Linear(H, I, bias=False)
        self.up_proj = nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, H, heads, kv_heads, D, I, eps):
        super().__init__()
        self.self_attn = Attention(H, heads, kv_heads, D)
        self.mlp = MLP(H, I)
        self.post_attention_layernorm = RMSNorm(H, eps)


def rotate_half(x):
    a, b = x.chunk(2, -1)
    return torch.cat([-b, a], -1)


class EagleHead(nn.Module):
    """The published EAGLE-1/2 head (SafeAILab/EAGLE cnets1.py `Model` without embed_tokens):
    state_dict keys fc.weight, fc.bias, layers.0.self_attn.{q,k,v,o}_proj.weight,
    layers.0.mlp.{gate,up,down}_proj.weight, layers.0.post_attention_layernorm.weight.
    q/k in Hugging Face's rotate-half RoPE layout."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 intermediate_size: int, rms_norm_eps: float, rope_theta: float,
                 fc_bias: bool = True, init_std: float = 0.02, seed: int = 0):
        super().__init__()
        H = hidden_size
        self.fc = nn.Linear(2 * H, H, bias=fc_bias)
        self.layers = nn.ModuleList([Layer(H, num_heads, num_kv_heads, head_dim,
                                           intermediate_size, rms_norm_eps)])
        inv = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        self.register_buffer("inv_freq", inv.float(), persistent=False)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name == "fc.bias":
                    p.zero_()
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * init_std)

    @property
    def layer(self) -> Layer:
        return self.layers[0]

    def rope(self, positions: torch.Tensor):
        """positions (..., T) -> cos, sin (..., 1, T, D) for (B, heads, T, D) tensors."""
        f = positions.float()[..., None] * self.inv_freq                    # (..., T, D/2)
        emb = torch.cat([f, f], -1)
        return emb.cos().unsqueeze(-3), emb.sin().unsqueeze(-3)

    def qkv(self, x, positions):
        """x (B, T, H) -> q (B, h, T, D), k, v (B, h, T, D) (kv heads repeated), RoPE applied."""
        a = self.layer.self_attn
        B, T, _ = x.shape
        q = a.q_proj(x).view(B, T, a.heads, a.D).transpose(1, 2)
        k = a.k_proj(x).view(B, T, a.kv_heads, a.D).transpose(1, 2)
        v = a.v_proj(x).view(B, T, a.kv_heads, a.D).transpose(1, 2)
        cos, sin = self.rope(positions)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        rep = a.heads // a.kv_heads
        return q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)

    def finish(self, x, attn):
        """x (B, T, H), attn (B, h, T, D) -> g (B, T, H)."""
        B, T, _ = x.shape
        r = x + self.layer.self_attn.o_proj(attn.transpose(1, 2).reshape(B, T, -1))
        return r + self.layer.mlp(self.layer.post_attention_layernorm(r))

    def forward(self, emb, feat, positions=None):
        """emb = embed(tok_{p+1}), feat = f_p, both (B, T, H) -> g (B, T, H); causal."""
        x = self.fc(torch.cat([emb, feat], -1))
        if positions is None:
            positions = torch.arange(x.shape[1], device=x.device)
        q, k, v = self.qkv(x, positions)
        return self.finish(x, F.scaled_dot_product_attention(q, k, v, is_causal=True))

    def published_state_dict(self, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
        return {n: p.detach().to("cpu", dtype).contiguous() for n, p in self.state_dict().items()}


def head_for_target(cfg, **kw) -> tuple[EagleHead, dict]:
    """A fresh head shaped like the target's layers, and its config.json (published layout)."""
    from eaglekv.model.draft_checkpoint import random_eagle_draft
    cfg_dict, _ = random_eagle_draft(cfg, with_embed=False, fc_bias=True)
    cfg_dict["torch_dtype"] = "bfloat16"
    head = EagleHead(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                     cfg.intermediate_size, cfg.rms_norm_eps, cfg_dict["rope_theta"], **kw)
    return head, cfg_dict


# ---- training -----------------------------------------------------------------------------------
def target_embed_head(model) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's (frozen) embedding (V, H) and LM head (V, H) weights."""
    return (model.get_input_embeddings().weight.detach(),
            model.get_output_embeddings().weight.detach())


def step_loss(head: EagleHead, embed, lm_head, ids, feats, valid, *, noise: float = 0.0,
              p_weight: float = 0.1, feat_std: float = 1.0, amp: bool = False):
    """One batch: returns (loss, stats dict of floats). ids (B, T), feats (B, T, H)."""
    inp_tok, inp_f, tgt_f = ids[:, 1:], feats[:, :-1], feats[:, 1:]
    m = valid[:, 1:]                                        # target feature f_{p+1} exists
    if noise > 0:
        inp_f = inp_f + (torch.rand_like(inp_f) - 0.5) * (2 * noise * feat_std)
    tok2 = F.pad(ids[:, 2:], (0, 1))
    v2 = F.pad(valid[:, 2:], (0, 1))                        # the data token tok_{p+2} exists
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=amp):
        g = head(embed[inp_tok], inp_f)                     # (B, T-1, H)
        gm, tm = g[m], tgt_f[m]                              # (M, H)
        logits = gm @ lm_head.t()                            # (M, V)
        with torch.no_grad():
            tlogits = tm @ lm_head.t()
    vloss = F.smooth_l1_loss(gm.float(), tm.float(), reduction="none").mean(-1).mean()
    tp = tlogits.float().softmax(-1)
    logp = logits.float().log_softmax(-1)
    ploss = -(tp * logp).sum(-1).mean()
    loss = vloss + p_weight * ploss
    with torch.no_grad():
        pred = logits.argmax(-1)
        top1 = (pred == tlogits.argmax(-1)).float().mean()
        sel = v2[m]
        tok_acc = (pred[sel] == tok2[m][sel]).float().mean() if sel.any() else top1 * 0
    return loss, {"loss": float(loss.detach()), "vloss": float(vloss.detach()),
                  "ploss": float(ploss.detach()),
                  "top1": float(top1), "tok_acc": float(tok_acc), "n": int(m.sum())}


def batches(data: FeatureData, which: list[int], max_tokens: int, rng: random.Random,
            shuffle: bool = True) -> list[list[int]]:
    """Groups of sequences of similar length with at most `max_tokens` padded tokens each."""
    lens = {i: len(data.seqs[i]["ids"]) for i in which}
    order = sorted(which, key=lambda i: (lens[i], rng.random()))
    out, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * max(lens[i], lens[cur[0]]) > max_tokens:
            out.append(cur)
            cur = []
        cur.append(i)
    if cur:
        out.append(cur)
    if shuffle:
        rng.shuffle(out)
    return out


@torch.no_grad()
def evaluate(head, embed, lm_head, data, which, max_tokens, amp, feat_std) -> dict:
    head.eval()
    tot, n = {}, 0
    for b in batches(data, which, max_tokens, random.Random(0), shuffle=False):
        ids, feats, valid = data.batch(b)
        _, st = step_loss(head, embed, lm_head, ids, feats, valid, amp=amp, feat_std=feat_std)
        for k, v in st.items():
            if k != "n":
                tot[k] = tot.get(k, 0.0) + v * st["n"]
        n += st["n"]
    head.train()
    return {k: v / max(n, 1) for k, v in tot.items()} | {"tokens": n}


@torch.no_grad()
def chain_accept(head, embed, lm_head, data, which, steps: int = 3, amp: bool = False,
                 response_only: bool = False) -> dict:
    """Greedy chain of `steps` drafts from every position of the held-out sequences: the prefix
    is teacher-forced (target features, as after each verify), draft step s >= 2 feeds its own
    token and feature at position p + s - 1 and attends to the prefix, its earlier drafts and
    itself. A draft counts when it equals the data token (greedy responses: the target's argmax).
    `response_only`: only chains whose root token (p + 1) is a response token, as in serving
    (otherwise the shared chat-template prefix, which the head learns by heart, counts too).
    Returns the per-step conditional accept rates and 1 + expected accepted drafts."""
    head.eval()
    hits = torch.zeros(steps)
    count = 0
    for b in batches(data, which, 16384, random.Random(0), shuffle=False):
        ids, feats, valid = data.batch(b)
        B, T = ids.shape
        n = T - 1
        with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=amp):
            pos = torch.arange(n, device=ids.device)
            x = head.fc(torch.cat([embed[ids[:, 1:]], feats[:, :-1]], -1))
            q, k, v = head.qkv(x, pos)
            g = head.finish(x, F.scaled_dot_product_attention(q, k, v, is_causal=True))
            ks, vs = [k], [v]
            ok = torch.ones(B, n, dtype=torch.bool, device=ids.device)
            causal = torch.ones(n, n, dtype=torch.bool, device=ids.device).tril()
            eye = torch.eye(n, dtype=torch.bool, device=ids.device)
            acc = []
            for s in range(steps):
                pred = (g @ lm_head.t()).argmax(-1)                         # (B, n): tok p+2+s
                want = F.pad(ids[:, 2 + s:], (0, s + 1), value=-1)[:, :n]
                ok = ok & (pred == want)
                acc.append(ok)
                if s + 1 == steps:
                    break
                x = head.fc(torch.cat([embed[pred], g], -1))
                q, k, v = head.qkv(x, pos + s + 1)
                ks.append(k)
                vs.append(v)
                mask = torch.cat([causal] + [eye] * (s + 1), -1)            # (n, (s+2) n)
                a = F.scaled_dot_product_attention(q, torch.cat(ks, 2), torch.cat(vs, 2),
                                                   attn_mask=mask)
                g = head.finish(x, a)
        lens = valid.sum(1)
        full = pos[None, :] + 1 + steps < lens[:, None]      # tokens p+2 .. p+1+steps exist
        if response_only:
            starts = torch.tensor([data.seqs[i]["n_prompt"] for i in b], device=ids.device)
            full &= pos[None, :] + 1 >= starts[:, None]
        for s in range(steps):
            hits[s] += float(acc[s][full].sum())
        count += int(full.sum())
    head.train()
    rates = (hits / max(count, 1)).tolist()
    cond = [rates[0]] + [rates[s] / rates[s - 1] if rates[s - 1] > 0 else 0.0
                         for s in range(1, steps)]
    return {"positions": count, "p_first_s_accepted": rates, "conditional_accept": cond,
            "accept_length": 1.0 + sum(rates)}


def train(head, embed, lm_head, data, train_ids, eval_ids, *, lr: float, time_budget: float,
          max_steps: int, max_tokens: int, warmup: int, noise: float, amp: bool, seed: int,
          log_every: int = 100, eval_every_s: float = 60.0, min_lr_frac: float = 0.1,
          weight_decay: float = 0.0, grad_clip: float = 0.5, out=print) -> dict:
    """AdamW, linear warmup then cosine over the time budget (or max_steps, whichever ends
    first). Returns the log (history of train and held-out stats)."""
    dev = embed.device
    rng = random.Random(seed)
    torch.manual_seed(seed)
    feat_std = float(data.feats[:data.num_tokens].std())
    opt = torch.optim.AdamW(head.parameters(), lr=lr, betas=(0.9, 0.95),
                            weight_decay=weight_decay, fused=dev.type == "cuda")
    hist, evals = [], []
    t0 = time.time()
    last_eval = t0
    step, epoch, acc = 0, 0, {}
    done = False
    while not done:
        for b in batches(data, train_ids, max_tokens, rng):
            frac = max((time.time() - t0) / time_budget, step / max_steps)
            if frac >= 1.0:
                done = True
                break
            scale = min(1.0, (step + 1) / warmup) * (
                min_lr_frac + (1 - min_lr_frac) * 0.5 * (1 + math.cos(math.pi * frac)))
            for gr in opt.param_groups:
                gr["lr"] = lr * scale
            ids, feats, valid = data.batch(b)
            loss, st = step_loss(head, embed, lm_head, ids, feats, valid, noise=noise, amp=amp,
                                 feat_std=feat_std)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gn = float(torch.nn.utils.clip_grad_norm_(head.parameters(), grad_clip))
            opt.step()
            step += 1
            for k, v in st.items():
                acc[k] = acc.get(k, 0.0) + v
            acc["gnorm"] = acc.get("gnorm", 0.0) + gn
            acc["k"] = acc.get("k", 0) + 1
            if step % log_every == 0:
                rec = {k: v / acc["k"] for k, v in acc.items() if k not in ("k", "n")}
                rec.update(step=step, epoch=epoch, t=round(time.time() - t0, 1),
                           lr=lr * scale, tokens_per_step=acc["n"] / acc["k"])
                hist.append(rec)
                acc = {}
                out(f"[train] step {step} ep {epoch} t {rec['t']}s loss {rec['loss']:.4f} "
                    f"v {rec['vloss']:.4f} p {rec['ploss']:.3f} top1 {rec['top1']:.3f} "
                    f"tok {rec['tok_acc']:.3f} lr {rec['lr']:.2e}")
            if eval_ids and time.time() - last_eval > eval_every_s:
                last_eval = time.time()
                ev = evaluate(head, embed, lm_head, data, eval_ids, max_tokens, amp, feat_std)
                ev.update(step=step, t=round(time.time() - t0, 1))
                evals.append(ev)
                out(f"[eval] step {step} loss {ev['loss']:.4f} top1 {ev['top1']:.3f} "
                    f"tok {ev['tok_acc']:.3f}")
        epoch += 1
    if dev.type == "cuda":
        torch.cuda.synchronize()
    ev = evaluate(head, embed, lm_head, data, eval_ids, max_tokens, amp, feat_std) \
        if eval_ids else {}
    ev.update(step=step, t=round(time.time() - t0, 1))
    evals.append(ev)
    out(f"[eval] final step {step} {ev}")
    return {"steps": step, "epochs": epoch, "train_seconds": round(time.time() - t0, 1),
            "feature_std": feat_std, "history": hist, "held_out": evals}


# ---- command line ---------------------------------------------------------------------------------
def cmd_prompts(args) -> None:
    from eaglekv.model.loader import load_checkpoint
    tok = load_checkpoint(args.model, load_tokenizer=True).tokenizer
    prompts = tokenize_prompts(tok, build_prompts(args.n, args.seed, args.raw_frac))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(prompts))
    lens = [len(p["ids"]) for p in prompts]
    print(f"{len(prompts)} prompts, {sum(p['chat'] for p in prompts)} chat, "
          f"{min(lens)}-{max(lens)} tokens (mean {sum(lens) / len(lens):.1f}) -> {args.out}")


def cmd_train(args) -> None:
    from eaglekv.model.draft_checkpoint import save_eagle_draft
    T0 = time.time()
    log = {"command": "python -m eaglekv.training.train_draft " + " ".join(sys.argv[1:]),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}

    def out(msg):
        print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True)

    dev = torch.device(args.device if args.device != "auto" else
                       ("cuda" if torch.cuda.is_available() else "cpu"))
    log["device"] = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    log["torch"] = torch.__version__
    torch.backends.cuda.matmul.allow_tf32 = False
    model, cfg = load_target(args.model, dev, torch.float32)
    out(f"target loaded on {log['device']}")
    eos = sorted(set(cfg.eos_token_ids) | set(args.extra_eos))
    prompts = json.loads(Path(args.prompts).read_text())[:args.max_prompts]
    # 1. data
    if args.data:
        seqs = load_seqs(args.data)
        out(f"reusing {len(seqs)} sequences from {args.data}")
        log["data_source"] = args.data
    else:
        rng = random.Random(args.seed)
        rng.shuffle(prompts)
        n_greedy = int(len(prompts) * args.greedy_frac)
        gen_model = copy.deepcopy(model).to(torch.bfloat16) if args.gen_bf16 else model
        t = time.time()
        deadline = t + args.gen_budget
        seqs = generate(gen_model, prompts[:n_greedy], batch=args.gen_batch,
                        max_new=args.max_new, greedy=True, temperature=1.0, top_p=1.0, eos=eos,
                        pad=args.pad_id, deadline=t + args.gen_budget * args.greedy_frac)
        out(f"generated {len(seqs)} greedy")
        seqs += generate(gen_model, prompts[n_greedy:], batch=args.gen_batch,
                         max_new=args.max_new, greedy=False, temperature=args.temperature,
                         top_p=args.top_p, eos=eos, pad=args.pad_id, deadline=deadline)
        del gen_model
        log["generate_seconds"] = round(time.time() - t, 1)
        out(f"generated {len(seqs)} sequences in {log['generate_seconds']}s")
        if args.save_data:
            save_seqs(args.save_data, seqs)
    t = time.time()
    data = extract_features(model, seqs)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    log["feature_seconds"] = round(time.time() - t, 1)
    resp = [len(s["ids"]) - s["n_prompt"] for s in seqs]
    log["data"] = {"sequences": len(seqs), "tokens": data.num_tokens,
                   "response_tokens": sum(resp), "greedy": sum(s["greedy"] for s in seqs),
                   "chat": sum(s["chat"] for s in seqs), "prompts_offered": len(prompts),
                   "max_new_tokens": args.max_new, "temperature": args.temperature,
                   "top_p": args.top_p, "ended_with_eos": sum(s["ids"][-1] in eos for s in seqs),
                   "generate_dtype": "bfloat16" if args.gen_bf16 else "float32",
                   "feature_dtype": "float32"}
    out(f"features: {log['data']}")
    # 2. split: held-out prompts (every `eval_every`-th sequence), greedy ones for the chain
    eval_ids = [i for i in range(len(seqs)) if i % args.eval_every == 0]
    train_ids = [i for i in range(len(seqs)) if i % args.eval_every != 0]
    chain_ids = [i for i in eval_ids if seqs[i]["greedy"]]
    embed, lm_head = target_embed_head(model)
    head, cfg_dict = head_for_target(cfg, seed=args.seed)
    head.to(dev)
    log["head_params"] = sum(p.numel() for p in head.parameters())
    log["recipe"] = {"lr": args.lr, "warmup": args.warmup, "schedule": "cosine over time budget",
                     "min_lr_frac": 0.1, "optimizer": "AdamW(0.9, 0.95), wd 0, clip 0.5",
                     "max_tokens_per_batch": args.max_tokens, "noise": args.noise,
                     "loss": "SmoothL1(g, f_next) + 0.1 * CE(softmax(head(f_next)), head(g))",
                     "amp_bf16": args.amp, "train_sequences": len(train_ids),
                     "eval_sequences": len(eval_ids), "chain_sequences": len(chain_ids)}
    budget = args.train_budget if args.deadline <= 0 else \
        min(args.train_budget, args.deadline - (time.time() - T0))
    res = train(head, embed, lm_head, data, train_ids, eval_ids, lr=args.lr,
                time_budget=budget, max_steps=args.max_steps, max_tokens=args.max_tokens,
                warmup=args.warmup, noise=args.noise, amp=args.amp, seed=args.seed,
                log_every=args.log_every, eval_every_s=args.eval_every_s, out=out)
    log.update(res)
    # 3. save (bf16, no embed_tokens), then the chain accept on the saved (bf16) weights
    sd = head.published_state_dict(torch.bfloat16)
    save_eagle_draft(args.out, cfg_dict, sd, fmt="safetensors")
    out(f"saved {args.out}")
    head.load_state_dict({k: v.float() for k, v in sd.items()})
    if chain_ids:
        for key, resp in (("chain_accept_greedy_heldout", False),
                          ("chain_accept_greedy_heldout_response_only", True)):
            log[key] = chain_accept(head, embed, lm_head, data, chain_ids, steps=args.chain_steps,
                                    amp=args.amp, response_only=resp)
            out(f"{key}: {log[key]}")
    log["total_seconds"] = round(time.time() - T0, 1)
    if args.log:
        Path(args.log).parent.mkdir(parents=True, exist_ok=True)
        Path(args.log).write_text(json.dumps(log, indent=1))
    out("done")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m eaglekv.training.train_draft",
                                description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("prompts", help="build and tokenise the prompts (CPU)")
    a.add_argument("--model", default="default")
    a.add_argument("--n", type=int, default=4000)
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--raw-frac", type=float, default=0.15)
    a.add_argument("--out", required=True)
    b = sub.add_parser("train", help="generate, extract features, train, save")
    b.add_argument("--model", default="default")
    b.add_argument("--prompts", required=True)
    b.add_argument("--out", required=True, help="directory for config.json + model.safetensors")
    b.add_argument("--log", default=None)
    b.add_argument("--device", default="auto")
    b.add_argument("--data", default=None, help="reuse sequences saved with --save-data")
    b.add_argument("--save-data", default=None)
    b.add_argument("--max-prompts", type=int, default=None)
    b.add_argument("--greedy-frac", type=float, default=0.25)
    b.add_argument("--gen-batch", type=int, default=512)
    b.add_argument("--gen-bf16", action=argparse.BooleanOptionalAction, default=True)
    b.add_argument("--gen-budget", type=float, default=120.0)
    b.add_argument("--max-new", type=int, default=256)
    b.add_argument("--temperature", type=float, default=0.7)
    b.add_argument("--top-p", type=float, default=0.95)
    b.add_argument("--pad-id", type=int, default=2)
    b.add_argument("--extra-eos", type=int, nargs="*", default=[])
    b.add_argument("--eval-every", type=int, default=25, help="every n-th sequence held out")
    b.add_argument("--lr", type=float, default=5e-4)
    b.add_argument("--warmup", type=int, default=200)
    b.add_argument("--max-steps", type=int, default=10 ** 9)
    b.add_argument("--train-budget", type=float, default=240.0, help="seconds of training")
    b.add_argument("--deadline", type=float, default=0.0,
                   help="end training this many seconds after start (0: no deadline)")
    b.add_argument("--max-tokens", type=int, default=12288, help="padded tokens per batch")
    b.add_argument("--noise", type=float, default=0.1, help="U(-a, a) * feature std")
    b.add_argument("--amp", action=argparse.BooleanOptionalAction, default=None)
    b.add_argument("--log-every", type=int, default=100)
    b.add_argument("--eval-every-s", type=float, default=60.0)
    b.add_argument("--chain-steps", type=int, default=3)
    b.add_argument("--seed", type=int, default=0)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.cmd == "prompts":
        cmd_prompts(args)
    else:
        if args.amp is None:
            args.amp = torch.cuda.is_available() and args.device != "cpu"
        cmd_train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
