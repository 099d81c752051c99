"""Plot issue 14's H200 run: held-out accept length and top-1 over training (both calls of
`bench/h200_issue14.sh train`), and eval-draft's acceptance rate per draft position.
    python bench/plot_issue14.py  ->  bench/results/train_eagle3_h200.png"""

import json
from pathlib import Path

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt

R = Path(__file__).resolve().parent / "results"
logs = [json.loads((R / f"train_eagle3_h200_part{i}.json").read_text()) for i in (1, 2)]
held = {e["step"]: e for log in logs for e in log["held_out"] if "accept_length" in e}
hist = {h["step"]: h for log in logs for h in log["history"]}
ev = json.loads((R / "eval_draft_eagle3_h200.json").read_text())

fig, ax = plt.subplots(1, 3, figsize=(16, 4.5))
steps = sorted(held)
for S in ("3", "5", "7"):
    ax[0].plot(steps, [held[s]["accept_length"][S] for s in steps], "o-", label=f"chain S{S}")
ax[0].set(xlabel="training step", ylabel="accept length (offline, held-out greedy)",
          title="held-out accept length")
ax[0].legend()
hs = sorted(hist)
for k in (0, 3, 6):
    ax[1].plot(hs, [hist[s][f"top1_{k}"] for s in hs], label=f"train top-1, step {k}")
ax[1].plot(steps, [held[s]["top1_0"] for s in steps], "ko-", label="held-out top-1, step 0")
ax[1].set(xlabel="training step", ylabel="top-1", title="train vs held-out (over-fitting)")
ax[1].legend(fontsize=8)
for r in ev["runs"]:
    ax[2].plot(range(1, len(r["position_rates"]) + 1), r["position_rates"], "o-",
               label=f"{r['shape']} T={r['temperature']}: {r['accept_length_mean']:.2f}, "
                     f"{r['speedup']:.2f}x")
ax[2].set(xlabel="draft position", ylabel="acceptance rate",
          title=f"eval-draft, {ev['prompts']} held-out prompts, b1, {ev['device']}")
ax[2].legend(fontsize=7)
fig.suptitle(f"EAGLE-3 head for SmolLM2-135M-Instruct, {logs[0]['date']}, "
             f"{logs[0]['device']}: {logs[0]['data']['tokens']} tokens, "
             f"{logs[1]['steps']} steps, {logs[1]['train_seconds']:.0f} s")
fig.tight_layout()
fig.savefig(R / "train_eagle3_h200.png", dpi=90)
print(R / "train_eagle3_h200.png")
