"""Stage 2 of the draft trainer: the target writes the training data.

The target (Hugging Face transformers, built from eaglekv's loader so the weights are the ones
the engine serves) answers the prompts (`generate`, batched, left padding), then one forward
per batch gives the feature f_p of every position = the target's last hidden state after the
final norm (what its LM head reads). `FeatureData` holds them packed flat and gathers batches.
"""

from __future__ import annotations

import math
import random
import time
from pathlib import Path

import torch


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


def flat_offsets(seqs: list[dict]) -> list[int]:
    """Start of each sequence in the flat packing, and the total at the end (len + 1 entries)."""
    offsets = [0]
    for s in seqs:
        offsets.append(offsets[-1] + len(s["ids"]))
    return offsets


def padded_groups(seqs: list[dict], max_batch_tokens: int, device):
    """Yield (which, ids (b, T), mask (b, T)) on `device`: sequences in length order, grouped so
    that a group's padded size stays within `max_batch_tokens` (one sequence at least)."""
    lens = [len(s["ids"]) for s in seqs]
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
        yield which, ids.to(device), mask.to(device)
        s = e


@torch.no_grad()
def extract_features(model, seqs: list[dict], *, max_batch_tokens: int = 65536) -> FeatureData:
    """f = the target's final-norm hidden state at every position (HF `hidden_states[-1]`)."""
    dev = next(model.parameters()).device
    H = model.config.hidden_size
    offsets = flat_offsets(seqs)
    N = offsets[-1]
    tokens = torch.zeros(N + 1, dtype=torch.long, device=dev)
    feats = torch.zeros(N + 1, H, dtype=torch.float32, device=dev)
    for which, ids, mask in padded_groups(seqs, max_batch_tokens, dev):
        h = model.model(input_ids=ids, attention_mask=mask).last_hidden_state.float()
        for b, i in enumerate(which):
            n = offsets[i + 1] - offsets[i]
            tokens[offsets[i]:offsets[i + 1]] = ids[b, :n]
            feats[offsets[i]:offsets[i + 1]] = h[b, :n]
    return FeatureData(seqs, tokens, feats, offsets[:-1])


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
