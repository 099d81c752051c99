"""Plot issue 14's H200 runs side by side: held-out accept length and top-1 over training, and
eval-draft's acceptance rate per draft position, for the first head (v1: 1.05M tokens, two
resumed calls), the second (v2: 4.84M tokens, one call), the third (v3: v2 trained on for
two more calls on the same data, `--init-from`, steps counted on from v2's) and the fourth
(v4: v3 trained on for one more call).
    python bench/plot_issue14.py  ->  bench/results/train_eagle3_h200.png"""

import json
from pathlib import Path

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt

R = Path(__file__).resolve().parent / "results"


def load(names: list[str], offsets: tuple[int, ...] = ()) -> dict:
    """Training logs of one head; `offsets`: the steps before each log (a run started
    `--init-from` a head counts its steps from 0)."""
    logs = [json.loads((R / n).read_text()) for n in names]
    offs = offsets or (0,) * len(logs)
    return {"log": logs[-1],
            "held": {o + e["step"]: e for lg, o in zip(logs, offs) for e in lg["held_out"]
                     if "accept_length" in e},
            "hist": {o + h["step"]: h for lg, o in zip(logs, offs) for h in lg["history"]}}


def runs_of(ev: dict, draft: str | None) -> dict:
    """eval-draft's JSON keeping only the runs of one draft (it measures several at once)."""
    return {**ev, "runs": [r for r in ev["runs"] if draft is None or r["draft"] == draft]}


RUNS = {"v1": (load(["train_eagle3_h200_part1.json", "train_eagle3_h200_part2.json"]),
               json.loads((R / "eval_draft_eagle3_h200.json").read_text())),
        "v2": (load(["train_eagle3_h200_v2.json"]),
               json.loads((R / "eval_draft_eagle3_v2_h200.json").read_text())),
        "v3": (load(["train_eagle3_h200_v2.json", "train_eagle3_h200_v3a.json",
                     "train_eagle3_h200_v3.json"], (0, 1669, 1669 + 1580)),
               runs_of(json.loads((R / "eval_draft_eagle3_v3_h200.json").read_text()),
                       "/root/head3")),
        "v4": (load(["train_eagle3_h200_v2.json", "train_eagle3_h200_v3a.json",
                     "train_eagle3_h200_v3.json", "train_eagle3_h200_v4.json"],
                    (0, 1669, 1669 + 1580, 1669 + 1580 + 1427)),
               runs_of(json.loads((R / "eval_draft_eagle3_v4_h200.json").read_text()),
                       "/root/head3"))}

fig, ax = plt.subplots(1, 3, figsize=(17, 4.8))
for (name, (run, ev)), style in zip(RUNS.items(), (":", "--", "-.", "-")):
    held, hist, log = run["held"], run["hist"], run["log"]
    steps = sorted(held)
    hist = run["hist"]
    tag = f"{name} ({log['data']['tokens'] / 1e6:.2f}M tokens, {max(hist)} steps)"
    for S in ("3", "5", "7"):
        ax[0].plot(steps, [held[s]["accept_length"][S] for s in steps], "o" + style,
                   label=f"{tag}: chain S{S}")
    hs = sorted(hist)
    ax[1].plot(hs, [hist[s]["top1_0"] for s in hs], style, label=f"{tag}: train top-1, step 0")
    ax[1].plot(steps, [held[s]["top1_0"] for s in steps], "o" + style,
               label=f"{tag}: held-out top-1, step 0")
    for r in ev["runs"]:
        if r["temperature"] == 0:
            ax[2].plot(range(1, len(r["position_rates"]) + 1), r["position_rates"], "o" + style,
                       label=f"{name} {r['shape']}: accept {r['accept_length_mean']:.2f}, "
                             f"{r['speedup']:.2f}x plain")
ax[0].set(xlabel="training step", ylabel="accept length (offline, held-out greedy)",
          title="held-out accept length")
ax[0].legend(fontsize=7)
ax[1].set(xlabel="training step", ylabel="top-1", title="train vs held-out")
ax[1].legend(fontsize=7)
ax[2].set(xlabel="draft position", ylabel="acceptance rate",
          title="eval-draft, 24 held-out prompts, b1, greedy, H200 bf16")
ax[2].legend(fontsize=7)
fig.suptitle("EAGLE-3 heads for SmolLM2-135M-Instruct trained here (H200, 2026-12-04): "
             "v1 02:09 UTC, v2 12:18 UTC, v3 14:48 UTC, v4 17:00 UTC")
fig.tight_layout()
fig.savefig(R / "train_eagle3_h200.png", dpi=90)
print(R / "train_eagle3_h200.png")
