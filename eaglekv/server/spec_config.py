"""vLLM's `--speculative-config` JSON read into SpecConfig's field names (issue 11).

    {"method": "eagle", "model": "default", "num_speculative_tokens": 3}
      -> {"algorithm": "eagle", "draft_model": "default", "num_steps": 3}

Only what the JSON gives is returned; the CLI fills the rest from SpecConfig's defaults (and
num_draft_tokens from num_steps for a chain), exactly as it does for the explicit flags.
"""

from __future__ import annotations

import json

from eaglekv.errors import ConfigError

EXAMPLE = '{"method": "eagle", "model": "default", "num_speculative_tokens": 3}'
METHODS = ("eagle", "eagle3", "multi_layer_eagle")   # the EAGLE family; vLLM's others are not run
KEYS = {"method": "algorithm",                       # JSON key -> SpecConfig field
        "model": "draft_model",
        "num_speculative_tokens": "num_steps",       # draft tokens a chain proposes = draft steps
        "topk": "topk",                              # eaglekv / SGLang extras: a tree
        "num_draft_tokens": "num_draft_tokens"}
INT_KEYS = ("num_speculative_tokens", "topk", "num_draft_tokens")
NO_OP = {"draft_tensor_parallel_size": 1}            # vLLM's own EAGLE example sends it; one device


def parse_speculative_config(text: str) -> dict:
    """SpecConfig fields given by `text`; ConfigError names the bad key or value."""
    try:
        options = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--speculative-config {text!r} is not valid JSON ({e}); write e.g. "
                          f"'{EXAMPLE}'") from None
    if not isinstance(options, dict):
        raise ConfigError(f"--speculative-config {text!r} must be a JSON object, e.g. '{EXAMPLE}'")
    for key, only in NO_OP.items():
        if key in options:
            if options[key] != only:
                raise ConfigError(f"--speculative-config {key}={options[key]!r}: eaglekv runs "
                                  f"on one device, so only {only} is accepted")
            options = {k: v for k, v in options.items() if k != key}
    unknown = sorted(set(options) - set(KEYS))
    if unknown:
        raise ConfigError(f"--speculative-config: unknown keys {unknown}; known: {sorted(KEYS)}")
    method = options.get("method")
    if not isinstance(method, str) or method.lower() not in METHODS:
        raise ConfigError(f"--speculative-config method={method!r}: eaglekv runs the methods "
                          f"{list(METHODS)}")
    for key in INT_KEYS:
        v = options.get(key, 1)
        if type(v) is not int or v < 1:     # type(): JSON true would pass isinstance(v, int)
            raise ConfigError(f"--speculative-config {key}={v!r} must be an int >= 1")
    model = options.get("model", "x")
    if not isinstance(model, str) or not model:
        raise ConfigError(f"--speculative-config model={model!r} must be a draft checkpoint "
                          f"directory, 'default' or 'random'")
    fields = {KEYS[k]: v for k, v in options.items()}
    fields["algorithm"] = method.lower()
    return fields
