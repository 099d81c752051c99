"""The compact store of generated sequences (training/selfgen.py writes it, the trainer reads it).

A directory of safetensors shards, each under `max_file_bytes` (the GPU machine returns at most
8 files of 16 MiB), plus `manifest.json`. Every shard holds whole sequences, packed flat:

    ids       (T,) uint16   tokens of its sequences back to back (the vocabulary must be < 65536)
    lens      (n,) int32    tokens of each sequence (prompt + response)
    n_prompt  (n,) int32    prompt tokens of each (the response is ids[o + n_prompt : o + len])
    greedy, chat, held_out  (n,) uint8 flags
    kind      (n,) uint8    index into KINDS (also in the shard's metadata and the manifest)

    # ids: [s0: prompt | response] [s1: prompt | response] ...; o_i = lens[0] + ... + lens[i-1]

`load_gen_data` returns the sequences as `data.load_seqs` does ({"ids", "n_prompt", "greedy",
"chat"}) plus "kind" (its name) and "held_out", all of them, only train or only held-out.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

KINDS = ("chat", "explanation", "lists", "code", "math", "multi_turn", "raw")
MAX_FILE_BYTES = 15 * 2 ** 20
FORMAT = "eaglekv-gen-data-1"
UINT16_MAX = 2 ** 16 - 1
HEADER_BYTES = 4096           # room left in a shard for the safetensors header
SEQ_BYTES = 4 + 4 + 4         # per sequence beside its tokens: lens, n_prompt, 4 flag bytes
SPLITS = ("all", "train", "held_out")


def _check_ids(seqs: list[dict]) -> None:
    """Every id must fit uint16; the first one that does not is named with where it is."""
    for i, s in enumerate(seqs):
        top = max(s["ids"], default=0)
        if top > UINT16_MAX or min(s["ids"], default=0) < 0:
            j, bad = next((j, t) for j, t in enumerate(s["ids"]) if not 0 <= t <= UINT16_MAX)
            raise ValueError(f"token id {bad} (sequence {i}, position {j}) does not fit uint16 "
                             f"[0, {UINT16_MAX}]: this store holds vocabularies of at most "
                             f"65536 tokens; keep int32 ids (data.save_seqs) for this model")


def _shards(seqs: list[dict], max_file_bytes: int) -> list[list[int]]:
    """Consecutive groups of sequence indices whose shard stays under `max_file_bytes`."""
    room = max_file_bytes - HEADER_BYTES
    out, cur, size = [], [], 0
    for i, s in enumerate(seqs):
        need = 2 * len(s["ids"]) + SEQ_BYTES
        if need > room:
            raise ValueError(f"sequence {i} of {len(s['ids'])} tokens needs {need} bytes, more "
                             f"than a shard of max_file_bytes={max_file_bytes} holds ({room} "
                             f"after the header); raise max_file_bytes or lower max_new")
        if cur and size + need > room:
            out.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += need
    return out + ([cur] if cur else [])


def _shard_tensors(seqs: list[dict]) -> dict[str, torch.Tensor]:
    flag = lambda k: torch.tensor([bool(s[k]) for s in seqs], dtype=torch.uint8)  # noqa: E731
    ids = torch.tensor([t for s in seqs for t in s["ids"]], dtype=torch.int32)
    return {"ids": ids.to(torch.uint16),
            "lens": torch.tensor([len(s["ids"]) for s in seqs], dtype=torch.int32),
            "n_prompt": torch.tensor([s["n_prompt"] for s in seqs], dtype=torch.int32),
            "greedy": flag("greedy"), "chat": flag("chat"), "held_out": flag("held_out"),
            "kind": torch.tensor([KINDS.index(s["kind"]) for s in seqs], dtype=torch.uint8)}


def summarize(seqs: list[dict], eos_ids=()) -> dict:
    """Counts for the manifest: sequences, tokens, response tokens, per kind and flag."""
    eos = set(eos_ids)
    by_kind = {}
    for s in seqs:
        k = by_kind.setdefault(s["kind"], {"sequences": 0, "held_out": 0, "greedy": 0,
                                           "response_tokens": 0})
        k["sequences"] += 1
        k["held_out"] += int(bool(s["held_out"]))
        k["greedy"] += int(bool(s["greedy"]))
        k["response_tokens"] += len(s["ids"]) - s["n_prompt"]
    return {"sequences": len(seqs), "tokens": sum(len(s["ids"]) for s in seqs),
            "response_tokens": sum(len(s["ids"]) - s["n_prompt"] for s in seqs),
            "held_out": sum(bool(s["held_out"]) for s in seqs),
            "greedy": sum(bool(s["greedy"]) for s in seqs),
            "chat": sum(bool(s["chat"]) for s in seqs),
            "ended_with_eos": sum(bool(s["ids"]) and s["ids"][-1] in eos for s in seqs),
            "by_kind": by_kind}


def save_gen_data(out_dir, seqs: list[dict], manifest: dict | None = None, *,
                  max_file_bytes: int = MAX_FILE_BYTES, eos_ids=()) -> list[Path]:
    """Write `seqs` ({"ids", "n_prompt", "greedy", "chat", "kind", "held_out"}) as shards
    `data-00000.safetensors`, ... under `out_dir` and `manifest.json` = `manifest` + the counts
    and the shard list. Checks every id before writing anything. Returns the shard paths."""
    from safetensors.torch import save_file
    _check_ids(seqs)
    groups = _shards(seqs, max_file_bytes)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("data-*.safetensors"):    # a re-run never mixes with an older one
        old.unlink()
    paths, files = [], []
    for j, g in enumerate(groups):
        p = out / f"data-{j:05d}.safetensors"
        part = [seqs[i] for i in g]
        save_file(_shard_tensors(part), str(p), metadata={"format": FORMAT,
                                                          "kinds": ",".join(KINDS)})
        paths.append(p)
        files.append({"name": p.name, "sequences": len(part), "bytes": p.stat().st_size,
                      "tokens": sum(len(s["ids"]) for s in part)})
    man = {"format": FORMAT, "kinds": list(KINDS), **(manifest or {}),
           **summarize(seqs, eos_ids), "max_file_bytes": max_file_bytes, "files": files}
    (out / "manifest.json").write_text(json.dumps(man, indent=1))
    return paths


def load_gen_data(path, split: str = "all") -> list[dict]:
    """The sequences of the store at `path` (its directory or its manifest.json): `split` =
    "all", "train" (held_out == 0) or "held_out"."""
    from safetensors import safe_open
    if split not in SPLITS:
        raise ValueError(f"split={split!r}; choose one of {list(SPLITS)}")
    root = Path(path)
    root = root.parent if root.is_file() else root
    man = root / "manifest.json"
    names = ([f["name"] for f in json.loads(man.read_text())["files"]] if man.exists()
             else sorted(p.name for p in root.glob("data-*.safetensors")))
    out = []
    for name in names:
        with safe_open(str(root / name), "pt") as f:
            kinds = f.metadata()["kinds"].split(",")
            d = {k: f.get_tensor(k) for k in f.keys()}
        pieces = d["ids"].to(torch.int32).split(d["lens"].tolist())      # n x (len_i,)
        cols = zip(pieces, d["n_prompt"].tolist(), d["greedy"].tolist(), d["chat"].tolist(),
                   d["kind"].tolist(), d["held_out"].tolist())
        for ids, n_prompt, greedy, chat, kind, held_out in cols:
            if split == "all" or (split == "held_out") == bool(held_out):
                out.append({"ids": ids.tolist(), "n_prompt": n_prompt, "greedy": bool(greedy),
                            "chat": bool(chat), "kind": kinds[kind], "held_out": bool(held_out)})
    return out


def write_heldout_prompts(path, prompts: list[dict]) -> None:
    """The held-out prompt set as JSON for the eval tools: a list of {"text" (a single user
    message, or raw text when chat is false) or "conversation" (messages, the last a user's),
    "ids" (the prompt's tokens as the engine runs them), "kind", "chat"}."""
    rows = []
    for p in prompts:
        key = "conversation" if "conversation" in p else "text"
        rows.append({key: p[key], "ids": list(p["ids"]), "kind": p["kind"], "chat": p["chat"]})
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(rows, indent=1))
