"""Shared fixtures: tiny random Llama-family checkpoints (made with transformers, saved as
safetensors) and the default SmolLM2 model with its HF transformers oracle. Plain helper
functions and constants live in helpers.py (and draft_helpers.py, sampling_helpers.py); test
modules import those, never each other or this file."""

from __future__ import annotations

import os

import eaglekv  # noqa: F401  (before torch loads numpy: OpenBLAS's threads sleep, cpu_blas)
import pytest
import torch

from helpers import make_tiny


@pytest.fixture(scope="session", autouse=True)
def weight_cache_dir(tmp_path_factory):
    """The weight and tokenizer cache (model/weight_cache.py) in a fresh directory per session,
    never the user's; `EAGLEKV_CACHE= make test` runs the whole session without one."""
    if os.environ.get("EAGLEKV_CACHE", "x").strip() in ("", "off"):
        yield None
        return
    path = tmp_path_factory.mktemp("eaglekv_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EAGLEKV_CACHE", str(path))
        yield path


@pytest.fixture(scope="session", autouse=True)
def faster_triton_interpreter():
    """The Triton interpreter (CPU runs) re-patches triton.language's builtins at every launch
    and lists each module's members with `inspect.getmembers` to do so, ~12% of a graph-buffer
    test's time. The member names are listed once here; each launch still patches exactly the
    members that are builtins at that moment, as Triton's own function does. Only where the
    interpreter is on and its private functions have the shape this relies on."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        yield
        return
    try:
        import inspect

        from triton.runtime import interpreter as ti
        ok = (list(inspect.signature(ti._patch_builtin).parameters) == ["pkg", "builder", "scope"]
              and callable(getattr(ti, "_patch_attr", None)) and callable(ti.tl.core.is_builtin))
    except Exception:  # noqa: BLE001 - another Triton: leave it as it is
        ok = False
    if not ok:
        yield
        return
    # the names of each package's builtins, listed before any launch (every member is its
    # original then): a launch patches those names whose member is a builtin at that moment,
    # as Triton's own function does (a package met later is listed then, all its names)
    names: dict[int, tuple[object, list[str]]] = {}
    tl = ti.tl
    for pkg in (tl, tl.core, tl.math, tl.tensor, tl.core.tensor,
                getattr(tl.core, "tensor_descriptor_base", None)):
        if pkg is not None:
            names[id(pkg)] = (pkg, sorted(n for n in dir(pkg)
                                          if tl.core.is_builtin(getattr(pkg, n, None))))

    def patch_builtin(pkg, builder, scope):
        if id(pkg) not in names:
            names[id(pkg)] = (pkg, sorted(dir(pkg)))        # keeps pkg alive: ids stay unique
        for name in names[id(pkg)][1]:
            member = getattr(pkg, name, None)
            if ti.tl.core.is_builtin(member):
                ti._patch_attr(pkg, name, member, builder, scope)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ti, "_patch_builtin", patch_builtin)
        yield


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    make_tiny(path)
    return path


@pytest.fixture(scope="module")
def deep_dir(tmp_path_factory):
    """8 layers, so EAGLE-3's captured layers (1, L//2 - 1, L - 4) = (1, 3, 4) are distinct."""
    path = tmp_path_factory.mktemp("tiny_deep")
    make_tiny(path, num_hidden_layers=8, seed=3)
    return path


@pytest.fixture(scope="session")
def tiny_hf(tiny_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smol_engine():
    from eaglekv import Engine, EngineConfig
    return Engine(EngineConfig(model="default", max_total_tokens=4096, max_running_requests=4))


@pytest.fixture(scope="session")
def smol_hf():
    from eaglekv.bench.e2e import load_hf
    return load_hf("default", torch.float32, "cpu")
