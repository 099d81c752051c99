"""Frozen configs, validated once in `__post_init__` with messages that name value and rule."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields
from types import SimpleNamespace

import torch

from eaglekv.errors import ConfigError

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
          "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}

# A step's prefill tokens bound how long every running stream waits for its next token, and
# how long a short prompt waits beside a long one (two steps at most, engine/fairness.py). On
# the 2-core CPU a 2048-token step takes ~10 s and a 512-token one ~1.4 s, at nearly the same
# prefill throughput (bench/serve_fairness.py); on a GPU 2048 tokens take milliseconds.
CHUNKED_PREFILL_AUTO = {"cpu": 512, "cuda": 2048}

MAX_TOP_LOGPROBS = 20   # alternatives per token, as the OpenAI API allows

# Sampling bounds: every value inside them stays finite through the fp32 sampler.
SAMPLING_EPS = 1e-5          # vLLM's _SAMPLING_EPS: a temperature below it samples greedily
MAX_TEMPERATURE = 1e4        # logit gaps < 100 shrink below 0.01: uniform to 1% already
FP32_TINY = torch.finfo(torch.float32).tiny   # smallest normal fp32, 1.1755e-38
REPETITION_PENALTY_RANGE = (0.01, 100.0)      # logits x or / it stay far inside fp32


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 0.0          # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                    # 0 = off
    stop: tuple[str, ...] = ()        # stop strings; the text ends before the first one
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False
    logprobs: int | None = None       # None: off; k: each token's logprob and the top k
    presence_penalty: float = 0.0     # OpenAI: minus this for a token already in the output
    frequency_penalty: float = 0.0    # OpenAI: minus this times its count in the output
    repetition_penalty: float = 1.0   # vLLM / HF: logits of prompt or output tokens / (or *) it

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens={self.max_new_tokens!r} must be an int >= 1")
        t = self.temperature
        if not (_is_real(t) and 0 <= t <= MAX_TEMPERATURE):
            raise ConfigError(f"temperature={t!r} must be >= 0 (0 = greedy) and at most "
                              f"{MAX_TEMPERATURE:g}: the logits are divided by it in fp32, "
                              f"and beyond that the distribution is uniform already")
        if t < SAMPLING_EPS:
            # as vLLM does: a temperature below _SAMPLING_EPS = 1e-5 is greedy (1 / T would
            # overflow fp32 for the tiniest ones; the argmax is what they ask for anyway)
            object.__setattr__(self, "temperature", 0.0)
        if not (_is_real(self.top_p) and 0 < self.top_p <= 1):
            raise ConfigError(f"top_p={self.top_p!r} must be in (0, 1]")
        if self.top_p < FP32_TINY:
            # below the smallest normal fp32 it would round to 0 in the sampler; any top_p
            # that small keeps only the most likely token, and so does FP32_TINY
            object.__setattr__(self, "top_p", FP32_TINY)
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ConfigError(f"top_k={self.top_k!r} must be an int >= 0 (0 = off)")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ConfigError(f"stop={self.stop!r} must hold non-empty strings")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (_is_real(v) and -2.0 <= v <= 2.0):   # NaN fails the comparison too
                raise ConfigError(f"{name}={v!r} must be in [-2, 2]")
        lo, hi = REPETITION_PENALTY_RANGE
        rp = self.repetition_penalty
        if not (_is_real(rp) and lo <= rp <= hi):
            raise ConfigError(f"repetition_penalty={rp!r} must be > 0 (1 = off) and within "
                              f"[{lo:g}, {hi:g}]: logits are divided or multiplied by it in "
                              f"fp32, and outside that range they overflow or vanish")
        if self.logprobs is not None and (not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            raise ConfigError(f"logprobs={self.logprobs!r} must be an int in "
                              f"[0, {MAX_TOP_LOGPROBS}] (or None: off)")

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def _is_real(v) -> bool:
    """A real number (bool excluded) that is finite: NaN and +-inf fail."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


SPEC_ALGORITHMS = ("none", "eagle", "eagle3", "multi_layer_eagle")
ADAPTIVE_ALGORITHMS = ("eagle", "eagle3")
# adaptive candidates: on CPU a verify costs about a decode step per token, so short chains;
# on CUDA a verify of 8 costs little more than a decode step, so deeper chains and a tree
ADAPTIVE_SHAPES = {"cpu": ((1, 1, 2), (3, 1, 4), (5, 1, 6)),
                   "cuda": ((3, 1, 4), (5, 1, 6), (4, 2, 8))}
# and a deeper chain behind a gate (AdaptivePolicy.gated_depth): a candidate only while the
# requests' acceptance at the deepest default's last position is high. The 7-step chain wins
# on easy text (the bench prompt, an H100: fixed S7 1.95x plain at batch 1 against S5 1.75x;
# the CPU 2.55x against 2.33x) and loses on the held-out prompts (-11% at batch 1 on the H100
# when added ungated, 2026-12-06)
# (EAGLEKV_ADAPTIVE_GATED=0: none)
ADAPTIVE_GATED_SHAPES = ({"cpu": ((7, 1, 8),), "cuda": ((7, 1, 8),)}
                         if os.environ.get("EAGLEKV_ADAPTIVE_GATED", "1") != "0"
                         else {"cpu": (), "cuda": ()})


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding. These fields are the one place the spec defaults live.

    `num_steps` S draft steps, each branching `topk` K ways; `num_draft_tokens` N nodes go to
    one verify forward per request (the root included). `draft_model` is a checkpoint directory,
    "default" (the EAGLE head shipped for the default model) or "random" (a randomly
    initialised head of the right shape, for tests and smoke runs).
    """

    algorithm: str = "none"
    draft_model: str | None = None
    num_steps: int | None = None        # None: 3 (fixed), or chosen per step (adaptive)
    topk: int | None = None             # None: 1
    num_draft_tokens: int | None = None  # None: num_steps + 1 for a chain
    # adaptive: choose plain decoding or one of `shapes` each step (speculative/adaptive.py).
    # None: on for draft_model="default" when no num_steps / topk / num_draft_tokens is given
    adaptive: bool | None = None
    shapes: tuple[tuple[int, int, int], ...] | None = None   # (S, K, N) each; None: the device's

    def __post_init__(self):
        if self.algorithm not in SPEC_ALGORITHMS:
            raise ConfigError(f"speculative algorithm={self.algorithm!r} unknown; "
                              f"choose one of {list(SPEC_ALGORITHMS)}")
        given = [n for n in ("num_steps", "topk", "num_draft_tokens")
                 if getattr(self, n) is not None]
        adaptive = self.adaptive
        if adaptive is None:
            adaptive = (self.enabled and self.draft_model == "default" and not given
                        and self.algorithm in ADAPTIVE_ALGORITHMS)
        object.__setattr__(self, "adaptive", bool(adaptive))
        if self.adaptive:
            self._check_adaptive(given)
            return
        if self.shapes is not None:
            raise ConfigError(f"shapes={self.shapes!r} are the candidates of adaptive "
                              f"speculation; set adaptive=True or give one fixed shape")
        K = 1 if self.topk is None else self.topk
        S = 3 if self.num_steps is None else self.num_steps
        for name, v in (("num_steps", S), ("topk", K)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"{name}={v!r} must be an int >= 1")
        N = self.num_draft_tokens
        if N is None:
            N = S + 1 if K == 1 else 4
        object.__setattr__(self, "num_steps", S)
        object.__setattr__(self, "topk", K)
        object.__setattr__(self, "num_draft_tokens", N)
        if not isinstance(N, int) or isinstance(N, bool) or N < 2:
            raise ConfigError(f"num_draft_tokens={N!r} must be an int >= 2 (the root plus at "
                              f"least one draft token)")
        if K == 1 and N != S + 1:
            raise ConfigError(f"topk=1 drafts one chain of num_steps={S} tokens, so "
                              f"num_draft_tokens must be num_steps + 1 = {S + 1}, not {N}")
        most = K + (S - 1) * K * K
        if N - 1 > most:
            raise ConfigError(f"num_draft_tokens={N}: at most topk + (num_steps - 1) * topk**2 "
                              f"= {K} + {S - 1} * {K * K} = {most} candidates exist, so "
                              f"num_draft_tokens - 1 must be <= {most}")
        if self.algorithm == "multi_layer_eagle" and K != 1:
            raise ConfigError(f"multi_layer_eagle drafts one chain (step k uses draft layer k): "
                              f"topk={K} must be 1")
        if self.enabled and not self.draft_model:
            raise ConfigError(f"speculative algorithm={self.algorithm!r} needs a draft_model "
                              f"(a checkpoint directory, or 'random')")

    def _check_adaptive(self, given: list[str]) -> None:
        if self.algorithm not in ADAPTIVE_ALGORITHMS:
            raise ConfigError(f"adaptive speculation drives {list(ADAPTIVE_ALGORITHMS)}, not "
                              f"algorithm={self.algorithm!r}; give a fixed num_steps instead")
        if given:
            raise ConfigError(f"adaptive=True chooses num_steps, topk and num_draft_tokens "
                              f"itself, but {given} were given: restrict its candidates with "
                              f"shapes=((S, K, N), ...), or set adaptive=False for one fixed "
                              f"shape")
        if not self.draft_model:
            raise ConfigError(f"speculative algorithm={self.algorithm!r} needs a draft_model "
                              f"(a checkpoint directory, or 'random')")
        if self.shapes is not None:
            if not self.shapes:
                raise ConfigError("shapes=() leaves adaptive speculation nothing to choose")
            for sh in self.shapes:
                if not (isinstance(sh, (tuple, list)) and len(sh) == 3):
                    raise ConfigError(f"shapes: {sh!r} is not a (num_steps, topk, "
                                      f"num_draft_tokens) triple")
                self.fixed(*sh)          # each shape must be a valid fixed config
            object.__setattr__(self, "shapes", tuple(tuple(int(v) for v in sh)
                                                     for sh in self.shapes))

    def fixed(self, S: int, K: int, N: int) -> "SpecConfig":
        """This config with one fixed shape (what adaptive runs for that choice)."""
        return SpecConfig(self.algorithm, self.draft_model, S, K, N, adaptive=False)

    def candidate_shapes(self, device_type: str) -> tuple[tuple[int, int, int], ...]:
        """The shapes steps are chosen among: `shapes`, else the device's defaults; a fixed
        config has just its own."""
        if not self.adaptive:
            return ((self.num_steps, self.topk, self.num_draft_tokens),)
        if self.shapes is not None:
            return self.shapes
        dev = "cuda" if device_type == "cuda" else "cpu"
        return ADAPTIVE_SHAPES[dev] + ADAPTIVE_GATED_SHAPES[dev]

    def gated_depth(self, device_type: str) -> int | None:
        """Shapes deeper than this are gated (AdaptivePolicy.gated_depth): the deepest default
        candidate's depth when the candidates are the device's defaults, else None."""
        if not self.adaptive or self.shapes is not None:
            return None
        return max(S for S, _, _ in ADAPTIVE_SHAPES["cuda" if device_type == "cuda" else "cpu"])

    def hull(self, device_type: str) -> "SimpleNamespace":
        """num_steps / topk / num_draft_tokens large enough for every candidate shape: what
        the request table, guard 2 and the position table are sized for."""
        sh = self.candidate_shapes(device_type)
        return SimpleNamespace(num_steps=max(s[0] for s in sh), topk=max(s[1] for s in sh),
                               num_draft_tokens=max(s[2] for s in sh))

    @property
    def enabled(self) -> bool:
        return self.algorithm != "none"

    @classmethod
    def from_dict(cls, options: dict) -> "SpecConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(f"unknown speculative options {unknown}; known: {sorted(known)}")
        return cls(**options)


# a decode chain pays the host's per-engine-step work (schedule, slots, sync, commit: ~1.8
# ms on the H200's host) once per k tokens. Measured there at batch 1 (random SmolLM2-shaped
# weights, bench/explore_h200.py, 2026-12-04): k = 8 / 16 / 32 / 64 -> 812 / 853 / 895 / 907
# tok/s. A request that stops early wastes at most k - 1 steps of its own row, and a stream
# receives its tokens k at a time (--num-scheduler-steps 1 streams token by token)
DEFAULT_SCHEDULER_STEPS = 32
DEFAULT_PREFILL_GRAPH_TOKENS = 256


@dataclass(frozen=True)
class EngineConfig:
    model: str = "default"            # "default" | HF directory | .gguf file
    dtype: str = "float32"
    device: str = "cpu"
    page_size: int = 1
    max_running_requests: int = 8
    max_context_len: int | None = None   # default: the model's max_position_embeddings
    max_total_tokens: int | None = None  # KV pool slots; default: from mem_fraction
    mem_fraction: float = 0.2            # of free memory for the KV pool when not given
    seed: int = 0                        # seeds requests that give no seed of their own
    # prefill tokens a step (None: a prompt at once); "auto": CHUNKED_PREFILL_AUTO of the device
    chunked_prefill_size: int | None | str = "auto"
    speculative: SpecConfig = SpecConfig()
    # "auto": Triton kernels on CUDA, the PyTorch reference on CPU; or "torch" | "triton"
    attention_backend: str = "auto"
    disable_cuda_graph: bool = False     # CUDA: run every step eagerly (debugging)
    cuda_graph_max_bs: int | None = None  # largest captured decode batch (default: max_running)
    # one request's prefill (or chunk of one) of fewer than this many tokens replayed as a
    # CUDA graph per token bucket (cuda_graph.PrefillGraphs), plain and speculative engines;
    # 0: eager; None: DEFAULT_PREFILL_GRAPH_TOKENS under CUDA graphs, else 0 (on an H100,
    # 2026-12-06: 1.13x plain and S5 end to end at batch 1, the prefill 13-24 ms -> 1.8 ms;
    # a step of several prefills is packed, up to 16 requests a replay, by
    # cuda_graph.PREFILL_GRAPH_PACK (the default since 2026-12-08: a wave's prefill 13 ->
    # 2.2 ms at batch 4 on an H100; EAGLEKV_PREFILL_PACK=0: eager, as before)
    cuda_graph_prefill_tokens: int | None = None
    # greedy decode steps replayed back to back per engine step, one sync for all (vLLM's
    # --num-scheduler-steps; a speculative engine chains ceil(this / (S + 1)) whole-step
    # replays, eagle_worker.spec_chain_steps); None: DEFAULT_SCHEDULER_STEPS with CUDA
    # graphs, else 1
    num_scheduler_steps: int | None = None
    # admission while requests decode (TGI's --waiting-served-ratio / --max-waiting-tokens):
    # newcomers wait until they are at least this fraction of the running requests, or until
    # the oldest has waited max_waiting_steps engine steps, and are then prefilled together;
    # 0: each is admitted at once (a prefill step of its own when a speculative batch's
    # requests finish one at a time)
    waiting_served_ratio: float = 0.0
    max_waiting_steps: int = 20

    def __post_init__(self):
        if isinstance(self.speculative, dict):
            object.__setattr__(self, "speculative", SpecConfig.from_dict(self.speculative))
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype={self.dtype!r} unknown; choose one of {sorted(set(DTYPES))}")
        try:
            dev = torch.device(self.device)
        except RuntimeError as e:
            raise ConfigError(f"device={self.device!r} is not a torch device: {e}") from None
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"device={self.device!r} but CUDA is not available")
        if not isinstance(self.page_size, int) or self.page_size < 1:
            raise ConfigError(f"page_size={self.page_size!r} must be an int >= 1")
        if self.max_running_requests < 1:
            raise ConfigError(f"max_running_requests={self.max_running_requests} must be >= 1")
        if self.max_context_len is not None and self.max_context_len < 2:
            raise ConfigError(f"max_context_len={self.max_context_len} must be >= 2")
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise ConfigError(f"max_total_tokens={self.max_total_tokens} must be >= "
                              f"page_size={self.page_size}")
        if self.chunked_prefill_size == "auto":
            object.__setattr__(self, "chunked_prefill_size",
                               CHUNKED_PREFILL_AUTO.get(dev.type, CHUNKED_PREFILL_AUTO["cuda"]))
        if self.chunked_prefill_size is not None and (
                not isinstance(self.chunked_prefill_size, int) or self.chunked_prefill_size < 1):
            raise ConfigError(f"chunked_prefill_size={self.chunked_prefill_size!r} must be an "
                              f"int >= 1 (or None: no chunking)")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ConfigError(f"attention_backend={self.attention_backend!r}; choose 'auto', "
                              f"'torch' or 'triton'")
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1:
            raise ConfigError(f"cuda_graph_max_bs={self.cuda_graph_max_bs} must be >= 1")
        if self.cuda_graph_prefill_tokens is not None and (
                not isinstance(self.cuda_graph_prefill_tokens, int)
                or isinstance(self.cuda_graph_prefill_tokens, bool)
                or not 0 <= self.cuda_graph_prefill_tokens <= 4096):
            raise ConfigError(f"cuda_graph_prefill_tokens={self.cuda_graph_prefill_tokens!r} "
                              f"must be an int in [0, 4096] (0: prefills run eagerly) or "
                              f"None (the default: {DEFAULT_PREFILL_GRAPH_TOKENS} under CUDA "
                              f"graphs)")
        if self.num_scheduler_steps is not None and (
                not isinstance(self.num_scheduler_steps, int) or self.num_scheduler_steps < 1):
            raise ConfigError(f"num_scheduler_steps={self.num_scheduler_steps!r} must be an "
                              f"int >= 1")
        if not (isinstance(self.waiting_served_ratio, (int, float))
                and 0 <= self.waiting_served_ratio < float("inf")):
            raise ConfigError(f"waiting_served_ratio={self.waiting_served_ratio!r} must be a "
                              f"finite number >= 0 (0: admit at once)")
        if not isinstance(self.max_waiting_steps, int) or self.max_waiting_steps < 1:
            raise ConfigError(f"max_waiting_steps={self.max_waiting_steps!r} must be an "
                              f"int >= 1")
        if not 0 < self.mem_fraction <= 0.95:
            raise ConfigError(f"mem_fraction={self.mem_fraction} must be in (0, 0.95]")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def triton_attention(self) -> bool:
        return self.attention_backend == "triton" or (
            self.attention_backend == "auto" and torch.device(self.device).type == "cuda")

    @property
    def cuda_graphs(self) -> bool:
        """Decode steps replay captured graphs: CUDA, the Triton backend, not disabled."""
        return (torch.device(self.device).type == "cuda" and self.triton_attention
                and not self.disable_cuda_graph)

    @property
    def decode_steps(self) -> int:
        """Greedy decode steps per engine step (num_scheduler_steps resolved): a chain only
        pays where the host's per-step work is the cost, i.e. under CUDA graphs."""
        if self.num_scheduler_steps is not None:
            return self.num_scheduler_steps
        return DEFAULT_SCHEDULER_STEPS if self.cuda_graphs else 1

    @property
    def prefill_graph_tokens(self) -> int:
        """cuda_graph_prefill_tokens resolved: a prefill replay only where decode steps
        replay graphs too."""
        if self.cuda_graph_prefill_tokens is not None:
            return self.cuda_graph_prefill_tokens
        return DEFAULT_PREFILL_GRAPH_TOKENS if self.cuda_graphs else 0

    @classmethod
    def from_dict(cls, options: dict) -> "EngineConfig":
        """Build from a mapping; an unknown option is an error, never dropped."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(f"unknown engine options {unknown}; known: {sorted(known)}")
        return cls(**options)
