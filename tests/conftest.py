"""Shared fixtures: tiny random Llama-family checkpoints (made with transformers, saved as
safetensors) and the default SmolLM2 model with its HF transformers oracle. Plain helper
functions and constants live in helpers.py (and draft_helpers.py, sampling_helpers.py); test
modules import those, never each other or this file."""

from __future__ import annotations

import dataclasses
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
    interpreter is on and its private functions have the shape this relies on.

    More cuts of the interpreter's per-op cost (the suite's largest part on CI):
    - its integer-overflow sanitizer off outside tests/kernels (`InterpreterOptions.
      sanitize_overflow`; a compiled kernel checks overflow only in debug builds): each int32
      +, - and * of a kernel became ~10 more interpreted ops (a cast to int64, the op, two
      compares and a device assert), ~25% of a graph-buffer test. The engine-level tests run
      tiny models over small pools; the kernel tests, which feed the kernels lengths and
      slots up to 2**31 - 1, keep it (`overflow_checks_in_kernel_tests`), as do the GPU tests
      of offsets past 2**31. `EAGLEKV_TRITON_SANITIZE_OVERFLOW=1` keeps it on everywhere;
    - `_get_np_dtype` (a 17-entry dict built at every call, ~5%) memoised by the type's
      class and name, which fix its result;
    - a @triton.jit helper called from inside a kernel (`InterpretedFunction.__call__`)
      patched the language again at every call, and never restored it: the launch around it
      has patched it already (a graph-buffer test made 31,500 such calls against 675
      launches; that test 58.6 -> 47.3 s without them). Skipped where every language module the
      helper's module sees was patched by the launch around it, or by an earlier helper call
      (Triton's own helper patching is never restored: triton.language's standard helpers,
      whose module sees `tl.core`, leave it patched after their first call)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        yield
        return
    try:
        import inspect

        from triton.runtime import interpreter as ti
        ok = (list(inspect.signature(ti._patch_builtin).parameters) == ["pkg", "builder", "scope"]
              and callable(getattr(ti, "_patch_attr", None)) and callable(ti.tl.core.is_builtin)
              and "_patch_lang(self.fn)" in inspect.getsource(ti.InterpretedFunction.__call__)
              and callable(getattr(ti.InterpretedFunction, "rewrite", None))
              and callable(getattr(ti, "InterpreterError", None))
              and "fn" in inspect.signature(ti.GridExecutor.__init__).parameters)
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
    np_dtypes: dict[tuple[type, str], object] = {}
    get_np_dtype = ti._get_np_dtype

    def cached_np_dtype(tt_dtype):
        key = (type(tt_dtype), getattr(tt_dtype, "name", None))
        if key[1] is None:
            return get_np_dtype(tt_dtype)
        if key not in np_dtypes:
            np_dtypes[key] = get_np_dtype(tt_dtype)
        return np_dtypes[key]
    seen_langs: dict[tuple[int, int], frozenset] = {}

    def langs_of(fn) -> frozenset:
        """The language modules a jitted function's module sees (what `_patch_lang` patches),
        listed again when that module's globals change in number."""
        g = fn.__globals__
        key = (id(g), len(g))
        if key not in seen_langs:
            seen_langs[key] = frozenset(id(v) for v in list(g.values())
                                        if v is tl or v is tl.core)
        return seen_langs[key]
    patched: list[frozenset] = []          # the launches in progress: what each patched
    grid_call, device_call = ti.GridExecutor.__call__, ti.InterpretedFunction.__call__

    def launch(self, *args, **kwargs):
        patched.append(langs_of(self.fn))
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            patched.pop()

    leaked: set[int] = set()     # modules a helper's own patching left patched for good

    def helper_call(self, *args, **kwargs):
        langs = langs_of(self.fn)
        if not patched or not langs <= patched[-1] | leaked:
            out = device_call(self, *args, **kwargs)
            if patched:          # Triton never restores a helper's patching: what the launch
                leaked.update(langs - patched[-1])     # around it did not patch stays so
            return out
        fn = self.rewrite()               # as Triton's own __call__, less the patching
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - Triton's own wrapping
            raise ti.InterpreterError(repr(e)) from e
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ti, "_patch_builtin", patch_builtin)
        mp.setattr(ti.GridExecutor, "__call__", launch)
        mp.setattr(ti.InterpretedFunction, "__call__", helper_call)
        mp.setattr(ti, "_get_np_dtype", cached_np_dtype)
        opts = getattr(ti.interpreter_builder, "options", None)
        if (dataclasses.is_dataclass(opts) and hasattr(opts, "sanitize_overflow")
                and os.environ.get("EAGLEKV_TRITON_SANITIZE_OVERFLOW") != "1"):
            mp.setattr(ti.interpreter_builder, "options",
                       dataclasses.replace(opts, sanitize_overflow=False))
        yield


# kernel test files with no case near int32's limits (no 2**31, iinfo or corrupt huge lengths)
SMALL_VALUE_KERNEL_TESTS = {"test_fused_triton.py", "test_gemv_rope.py", "test_fused_mlp.py",
                            "test_greedy_triton.py"}


@pytest.fixture(autouse=True)
def overflow_checks_in_kernel_tests(request, faster_triton_interpreter):
    """The interpreter's integer-overflow sanitizer back on for the kernel tests of the index
    paths (tests/kernels but the matmul / norm / sampler kernels' files, whose cases stay
    small): they drive attention, the stores, the kv-indices and the guards with lengths,
    slots and positions up to 2**31 - 1, where an int32 offset computed by mistake would
    overflow (see faster_triton_interpreter)."""
    path = request.node.path
    if (os.environ.get("TRITON_INTERPRET") != "1" or path.parent.name != "kernels"
            or path.name in SMALL_VALUE_KERNEL_TESTS):
        yield
        return
    from triton.runtime import interpreter as ti
    opts = getattr(ti.interpreter_builder, "options", None)
    if not (dataclasses.is_dataclass(opts) and getattr(opts, "sanitize_overflow", True) is False):
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ti.interpreter_builder, "options",
                   dataclasses.replace(opts, sanitize_overflow=True))
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
