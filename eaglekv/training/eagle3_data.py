"""What an EAGLE-3 head learns from: the target's features of every position of the generated data.

For each position j of each sequence, one target forward gives
- aux_j (3H): the outputs of the three captured layers, concatenated in layer order (what the
  engine's `LlamaForCausalLM.forward(capture_layers=...)` hands the draft). Hugging Face's
  `hidden_states[i + 1]` is layer i's output (index 0 is the embedding);
- final_j (H): the final-norm hidden state, which the LM head reads, so the target's logits over
  any vocabulary subset are `final_j @ lm_head[ids].T` (computed per batch, not stored);
- argmax_j: the target's argmax over its full vocabulary (greedy verify's token).
Packed flat on the device (bf16 features), row N the padding row, as `FeatureData` does.
"""

from __future__ import annotations

import torch

from eaglekv.training.data import FeatureData, flat_offsets, padded_groups


class Eagle3Data(FeatureData):
    """tokens (N+1,), aux (N+1, 3H), feats = final (N+1, H), argmax (N+1,), offsets."""

    def __init__(self, seqs, tokens, aux, final, argmax, offsets):
        super().__init__(seqs, tokens, final, offsets)
        self.aux, self.argmax = aux, argmax

    def batch3(self, which: list[int]):
        """ids (B, T), aux (B, T, 3H), final (B, T, H), argmax (B, T), mask (B, T) of sequences
        `which`, right padded; mask = the position is in the sequence and its next token is a
        response token (j >= n_prompt - 1), i.e. its prediction is one a draft is asked for."""
        T = max(len(self.seqs[i]["ids"]) for i in which)
        idx = torch.full((len(which), T), self.pad_row, dtype=torch.long)
        start = torch.zeros(len(which), 1, dtype=torch.long)
        for b, i in enumerate(which):
            n = len(self.seqs[i]["ids"])
            idx[b, :n] = torch.arange(self.offsets[i], self.offsets[i] + n)
            start[b] = max(self.seqs[i]["n_prompt"] - 1, 0)
        idx = idx.to(self.tokens.device)
        mask = (idx != self.pad_row) & (torch.arange(T, device=idx.device) >= start.to(idx.device))
        aux, final = self.aux, self.feats
        if aux.device != idx.device:     # features kept in host memory: gather there, then copy
            hidx = idx.cpu()
            return (self.tokens[idx], aux[hidx].to(idx.device, non_blocking=True),
                    final[hidx].to(idx.device, non_blocking=True), self.argmax[idx], mask)
        return self.tokens[idx], aux[idx], final[idx], self.argmax[idx], mask


ARGMAX_CHUNK = 8192     # positions whose full-vocabulary logits exist at once


@torch.no_grad()
def feature_bytes(num_tokens: int, hidden: int, dtype=torch.bfloat16) -> int:
    """Bytes of the stored features (aux 3H + final H a token) of `num_tokens` tokens."""
    return (num_tokens + 1) * 4 * hidden * torch.empty(0, dtype=dtype).element_size()


def features_device(where: str, dev: torch.device, nbytes: int,
                    fraction: float = 0.6) -> torch.device:
    """Where the features live: `device` (dev), `cpu` (host memory, each batch gathered there
    and copied; not pinned: the caching host allocator rounds a pinned block up to a power of
    two, 64 GiB for a 47 GB store, and a gathered batch is a new pageable tensor anyway), or `auto`: dev while they take at most
    `fraction` of its free memory (the training batches need the rest), else the host."""
    if where not in ("auto", "device", "cpu"):
        raise ValueError(f"features on {where!r}: expected auto, device or cpu")
    if where == "device" or dev.type != "cuda":
        return dev
    if where == "cpu":
        return torch.device("cpu")
    free, _ = torch.cuda.mem_get_info(dev)
    return dev if nbytes <= fraction * free else torch.device("cpu")


@torch.no_grad()
def extract_eagle3_features(model, seqs: list[dict], aux_layers: tuple[int, ...], *,
                            max_batch_tokens: int = 65536, dtype=torch.bfloat16,
                            store: torch.device | None = None) -> Eagle3Data:
    """`model`: the Hugging Face target (training/data.py `load_target`); `aux_layers`: layer
    output ids (Eagle3DraftModel.aux_layers). Features stored in `dtype` on `store` (default the
    model's device; the host's memory when the device cannot hold them beside the
    training: `features_device`)."""
    dev = next(model.parameters()).device
    store = dev if store is None else torch.device(store)
    H = model.config.hidden_size
    L = model.config.num_hidden_layers
    if not all(0 <= i < L - 1 for i in aux_layers):
        raise ValueError(f"aux layers {list(aux_layers)} must be outputs of layers [0, {L - 1}) "
                         f"(the last layer's output is only seen after the final norm)")
    lm_head = model.get_output_embeddings().weight                           # (V, H)
    offsets = flat_offsets(seqs)
    N = offsets[-1]
    tokens = torch.zeros(N + 1, dtype=torch.long, device=dev)
    aux = torch.zeros(N + 1, 3 * H, dtype=dtype, device=store)
    final = torch.zeros(N + 1, H, dtype=dtype, device=store)
    argmax = torch.zeros(N + 1, dtype=torch.long, device=dev)
    for which, ids, mask in padded_groups(seqs, max_batch_tokens, dev):
        out = model.model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        a = torch.cat([out.hidden_states[i + 1] for i in aux_layers], -1)   # (b, T, 3H)
        f = out.last_hidden_state                                            # (b, T, H)
        # the target's argmax a chunk of positions at a time: (b * T, V) logits at once were
        # 12 GiB for a 65536-token group (fp32, SmolLM2), an OOM beside 10M tokens' features
        flat = f.reshape(-1, H)
        top = torch.cat([(flat[i:i + ARGMAX_CHUNK] @ lm_head.t()).argmax(-1)
                         for i in range(0, flat.shape[0], ARGMAX_CHUNK)]).view(f.shape[:2])
        a, f = a.to(store, dtype), f.to(store, dtype)    # one copy a group to a host store
        for b, i in enumerate(which):
            sl, n = slice(offsets[i], offsets[i + 1]), offsets[i + 1] - offsets[i]
            tokens[sl] = ids[b, :n]
            aux[sl] = a[b, :n]
            final[sl] = f[b, :n]
            argmax[sl] = top[b, :n]
    return Eagle3Data(seqs, tokens, aux, final, argmax, offsets[:-1])
