"""The parts of a speculative step, named for the profiler: `with phase("draft"):` marks the
work a step's draft does (on CUDA, the kernels launched inside), so a profile of eager steps
reads each part's device time (`eaglekv bench`'s step profile, `phase_profile`). A captured
graph keeps no marks: its replays are profiled as one step."""

from __future__ import annotations

import torch

# draft: the draft's S steps and the tree; verify: the target over the tree; accept: the
# acceptance and the accepted K/V moved to depth order; extend: the draft over the accepted
# tokens (the window, or after the sync), and an adaptive step's catch-up
PHASES = ("draft", "verify", "accept", "extend")
PREFIX = "eaglekv::"


def phase(name: str) -> torch.profiler.record_function:
    return torch.profiler.record_function(PREFIX + name)
