"""Exceptions that carry the numbers: every error says which value is wrong and what it must be."""

from __future__ import annotations


class EaglekvError(Exception):
    """Base class of every error eaglekv raises on purpose."""


class ConfigError(EaglekvError, ValueError):
    """A configuration value breaks a rule; the message names the value and the rule."""


class ModelLoadError(EaglekvError, ValueError):
    """A model file is missing, of an unsupported kind, or does not match its config."""


class RequestError(EaglekvError, ValueError):
    """One request cannot be served as asked (too long, bad sampling parameters)."""


class RequestFailed(EaglekvError, RuntimeError):
    """One request failed during a step (e.g. its sampling distribution is not finite); the
    engine finished it alone, freed its KV and row, and the other requests went on."""


class OutOfKVMemoryError(EaglekvError, RuntimeError):
    """The allocator has fewer free slots than asked for."""

    def __init__(self, need: int, free: int, total: int):
        self.need, self.free, self.total = need, free, total
        super().__init__(f"KV pool out of memory: need {need} slots, {free} free of {total}")


class AllocatorError(EaglekvError, RuntimeError):
    """A slot was freed twice, freed without being handed out, or the books do not add up."""


class KVIndexError(EaglekvError, IndexError):
    """An index that would become a memory address lies outside its buffer.

    Raised before anything is written: the buffer is bit-identical to before the call.
    """

    def __init__(self, op: str, first_bad: int, limit: int, num_bad: int, num_total: int,
                 layer: int | None = None, low: int = 0, step_bad: int | None = None):
        self.op, self.first_bad, self.limit = op, first_bad, limit
        self.num_bad, self.num_total, self.layer, self.low = num_bad, num_total, layer, low
        self.step_bad = step_bad   # bad indices over every guarded call of the step, if more
        where = f"{op} (layer {layer}, " if layer is not None else f"{op} ("
        step = f"; {step_bad} bad in this step" if step_bad not in (None, num_bad) else ""
        super().__init__(
            f"slot {first_bad} out of range [{low}, {limit}) in {where}"
            f"{num_bad} of {num_total} indices bad{step})")

    def with_layer(self, layer: int) -> "KVIndexError":
        return KVIndexError(self.op, self.first_bad, self.limit, self.num_bad, self.num_total,
                            layer=layer, low=self.low, step_bad=self.step_bad)
