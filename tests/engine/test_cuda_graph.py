"""The captured decode graphs (cuda_graph.py): the same tokens as the eager step and the CPU,
padded rows that touch no request's KV, and the guards still on inside a replay."""

from __future__ import annotations

import pytest
import torch

from eaglekv import KVIndexError, SamplingParams
from eaglekv import cuda_graph
from eaglekv.cuda_graph import batch_buckets, no_gc
from helpers import spec, tiny_engine

SP = SamplingParams(max_new_tokens=16, ignore_eos=True)
PROMPTS = [[5, 17, 42], list(range(1, 30)), [9] * 7]


def test_buckets_cover_every_batch():
    assert batch_buckets(1) == (1,)
    assert batch_buckets(8) == (1, 2, 4, 8)
    assert batch_buckets(48) == (1, 2, 4, 8, 16, 32, 48)
    b = batch_buckets(300)
    assert b[:7] == (1, 2, 4, 8, 16, 32, 64) and b[-3:] == (192, 256, 300)
    assert all(any(x >= n for x in b) for n in range(1, 301))


class _Dies:
    def __init__(self, log):
        self.log, self.me = log, self          # a cycle: only the collector frees it

    def __del__(self):
        self.log.append("freed")


@pytest.mark.parametrize("enabled", [True, False], ids=["gc-on", "gc-off"])
def test_captures_run_with_the_collector_held_off(enabled):
    """A dead engine's graphs freed by a collection inside a capture invalidate it (H200,
    2026-12-05): cycles die before the captures, none during, and the collector's state
    comes back as it was."""
    import gc
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        log = []
        _Dies(log)
        with no_gc():
            assert log == ["freed"]             # collected on the way in
            assert not gc.isenabled()
            _Dies(log)
            for _ in range(20000):              # enough allocations to trigger a generation 0
                [[]]
            assert log == ["freed"]             # nothing collected inside
        assert gc.isenabled() == enabled
        gc.collect()
        assert log == ["freed", "freed"]
    finally:
        (gc.enable if was else gc.disable)()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("opts", [{}, {"page_size": 16}, {"num_scheduler_steps": 1},
                                  {"disable_cuda_graph": True}, {"attention_backend": "torch"}],
                         ids=["graphs", "graphs-page16", "graphs-1step", "eager-triton",
                              "eager-torch"])
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_equals_cpu(tiny_dir, opts, batch):
    prompts = PROMPTS[:batch]
    cpu = [o.token_ids for o in tiny_engine(tiny_dir).generate(prompts, SP)]
    engine = tiny_engine(tiny_dir, device="cuda", max_running_requests=4, **opts)
    assert [o.token_ids for o in engine.generate(prompts, SP)] == cpu
    graphs = engine.runner.graphs
    if "disable_cuda_graph" not in opts and "attention_backend" not in opts:
        assert graphs is not None and graphs.replays >= SP.max_new_tokens - 1
    else:
        assert graphs is None
    engine.check_memory()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("batch", [1, 3])
def test_chain_graph_greedy_equals_cpu(tiny_dir, monkeypatch, batch):
    """Decode chains of 5 captured as one graph each (cuda_graph.CHAIN_GRAPH_MAX_BATCH): the
    CPU's tokens, every chain after the prefill one replay."""
    monkeypatch.setattr(cuda_graph, "CHAIN_GRAPH_MAX_BATCH", 4)
    prompts = PROMPTS[:batch]
    cpu = [o.token_ids for o in tiny_engine(tiny_dir).generate(prompts, SP)]
    engine = tiny_engine(tiny_dir, device="cuda", max_running_requests=4, num_scheduler_steps=5)
    assert [o.token_ids for o in engine.generate(prompts, SP)] == cpu
    graphs = engine.runner.graphs
    assert graphs.chain_graph_replays == (SP.max_new_tokens - 1) // 5
    engine.check_memory()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("opts", [{}, {"page_size": 16}, {"chunked_prefill_size": 8}],
                         ids=["whole", "page16", "chunks-of-8"])
@pytest.mark.parametrize("pack", [False, True], ids=["one-a-replay", "packed"])
def test_prefill_graphs_greedy_equals_cpu(tiny_dir, opts, pack, monkeypatch):
    """`cuda_graph_prefill_tokens`: each prompt prefilled alone replays a captured prefill
    (whole or in chunks over its cached prefix): the CPU's greedy tokens in fp32, and the
    books whole; a batch of prompts at once prefills eagerly (packing off) or, packed
    (`cuda_graph.PREFILL_GRAPH_PACK`, the default), replays too, in one replay or a few
    (`PrefillGraphs.groups`), and so do the steps that decode some requests beside another's
    prompt."""
    from eaglekv import cuda_graph
    monkeypatch.setattr(cuda_graph, "PREFILL_GRAPH_PACK", pack)
    sp = SamplingParams(max_new_tokens=8, ignore_eos=True)
    cpu = [o.token_ids for o in tiny_engine(tiny_dir).generate(PROMPTS, sp)]
    engine = tiny_engine(tiny_dir, device="cuda", max_running_requests=4,
                         cuda_graph_prefill_tokens=64, **opts)
    g = engine.runner.prefill_graphs
    assert g is not None and g.buckets == (16, 32, 64)
    assert [engine.generate([p], sp)[0].token_ids for p in PROMPTS] == cpu
    assert g.replays >= len(PROMPTS)
    replays = g.replays
    assert [o.token_ids for o in engine.generate(PROMPTS, sp)] == cpu
    assert (g.replays > replays) == pack
    engine.check_memory()
    assert engine.allocator.is_full()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("alg", ["eagle", "eagle3", "adaptive"])
@pytest.mark.parametrize("chunk", [None, 8], ids=["whole", "chunks-of-8"])
def test_speculative_prefill_graphs_are_lossless(tiny_dir, deep_dir, alg, chunk, monkeypatch):
    """`cuda_graph_prefill_tokens` on a speculative engine: each prompt prefilled alone
    replays the target's prefill with its hidden states (EAGLE-3: its captured layers), the
    draft extends over them: speculative greedy equals the CPU's plain greedy in fp32, and
    so it does with the prompts admitted together, their prefills packed into replays
    (`cuda_graph.PREFILL_GRAPH_PACK` on here); an adaptive engine's workers share one set of
    prefill graphs."""
    from eaglekv import cuda_graph
    monkeypatch.setattr(cuda_graph, "PREFILL_GRAPH_PACK", True)
    d = deep_dir if alg == "eagle3" else tiny_dir
    sp = SamplingParams(max_new_tokens=16, ignore_eos=True)
    cpu = [o.token_ids for o in tiny_engine(d).generate(PROMPTS, sp)]
    sc = (dict(algorithm="eagle", draft_model="random", adaptive=True,
               shapes=((3, 1, 4), (2, 2, 4))) if alg == "adaptive" else spec(alg, 3, 1, 4))
    engine = tiny_engine(d, device="cuda", max_running_requests=4, speculative=sc,
                         cuda_graph_prefill_tokens=64, chunked_prefill_size=chunk)
    w = engine.runner
    g = (w.first if alg == "adaptive" else w).target.prefill_graphs
    assert g is not None and g.hidden
    if alg == "adaptive":
        assert all(x.target.prefill_graphs is g for x in w.workers.values())
    assert [engine.generate([p], sp)[0].token_ids for p in PROMPTS] == cpu
    assert g.replays >= len(PROMPTS)
    replays = g.replays
    assert [o.token_ids for o in engine.generate(PROMPTS, sp)] == cpu
    assert g.replays > replays
    engine.check_memory()
    assert engine.allocator.is_full()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("speculative", [None, spec("eagle", 3, 1, 4)],
                         ids=["plain", "eagle-S3"])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("every", [True, None, "nopdl"],
                         ids=["every-matmul", "default", "default-without-pdl"])
def test_gemv_graphs_greedy_equals_cpu(tiny_dir, monkeypatch, speculative, batch, every):
    """Graphs captured with the Triton matrix-vector kernel (fused.FUSE_GEMV: the weights
    column-major, add + RMSNorm and SiLU*mul inside the decode-sized matmuls; by default
    qkv and gate_up, and the bare ones too where PDL is on; with EAGLEKV_GEMV=1 every
    matmul) make the CPU's greedy tokens in fp32, plain and speculative."""
    from eaglekv.kernels import fused, pdl
    prompts = PROMPTS[:batch]
    opts = {} if speculative is None else {"speculative": speculative}
    cpu = [o.token_ids for o in tiny_engine(tiny_dir, **opts).generate(prompts, SP)]
    if every == "nopdl":
        monkeypatch.setattr(pdl, "PDL", False)
        every = None
    monkeypatch.setattr(fused, "FUSE_GEMV", every)
    engine = tiny_engine(tiny_dir, device="cuda", max_running_requests=4, **opts)
    layer = engine.model.layers[0]
    assert layer.qkv.stride(0) == layer.gate_up.stride(0) == 1      # nn.Linear's layout
    bare = bool(every) or (every is None and pdl.enabled(engine.device))
    assert (layer.o.stride(0) == 1) == bare
    assert [o.token_ids for o in engine.generate(prompts, SP)] == cpu
    engine.check_memory()


def _kv_snapshot(engine):
    return [b.clone() for b in engine.kv_pool.k_buffer + engine.kv_pool.v_buffer]


def _decoding(engine, prompts):
    params = SamplingParams(max_new_tokens=64, ignore_eos=True)
    reqs = [engine.add_request(p, params) for p in prompts]
    while any(len(r.output_ids) < 2 for r in reqs):      # prefill done, decoding
        engine.step()
    return reqs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("page_size", [1, 16])
def test_padded_rows_touch_no_request_kv(tiny_dir, page_size):
    """3 requests replay the 4-row graph: the padding row writes only the padding page."""
    engine = tiny_engine(tiny_dir, device="cuda", max_running_requests=8, page_size=page_size,
                         num_scheduler_steps=1)
    reqs = _decoding(engine, PROMPTS)
    before, replays = _kv_snapshot(engine), engine.runner.graphs.replays
    engine.step()
    assert engine.runner.graphs.replays == replays + 1
    new = {r.last_slot for r in reqs}
    changed = set()
    for a, b in zip(before, _kv_snapshot(engine)):
        changed |= set((a != b).flatten(1).any(1).nonzero().view(-1).tolist())
    assert changed - set(range(page_size)) == new       # the padding page may be written
    assert new <= changed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("where", ["table", "slot", "table-chain", "table-chain-graph"])
def test_guard_inside_replayed_graph(tiny_dir, where, monkeypatch):
    """A corrupted req_to_token entry (read by attention) or new slot (written by the K/V
    store) inside a replay, or inside a chain of 8 replays, or a chain of 8 captured as one
    graph (cuda_graph.CHAIN_GRAPH_MAX_BATCH): KVIndexError at the step's sync, nothing
    written out of range, the engine serves the next request exactly."""
    chain = where.startswith("table-chain")
    one_graph = where == "table-chain-graph"
    monkeypatch.setattr(cuda_graph, "CHAIN_GRAPH_MAX_BATCH", 4 if one_graph else 0)
    engine = tiny_engine(tiny_dir, device="cuda", max_running_requests=4, max_total_tokens=256,
                         num_scheduler_steps=8 if chain else 1)
    ref = engine.generate([PROMPTS[0]], SP)[0].token_ids
    reqs = _decoding(engine, PROMPTS[:2])
    limit = engine.kv_pool.size_limit
    before = _kv_snapshot(engine)
    if where.startswith("table"):
        engine.req_to_token.req_to_token[reqs[1].row, 1] = limit + 7
        match = rf"slot {limit + 7} out of range \[0, {limit}\)"
    else:   # the decode batch takes its slots in one alloc_decode call
        real = engine.allocator.alloc_decode

        def bad(seq_lens, last_slots):
            s = real(seq_lens, last_slots)
            engine.allocator.free(s[1:])
            engine.allocator.alloc_decode = real
            return torch.cat([s[:1], torch.full_like(s[1:], limit)])
        engine.allocator.alloc_decode = bad
        match = rf"slot {limit} out of range \[0, {limit}\)"
    replays = engine.runner.graphs.replays
    chained = engine.runner.graphs.chain_graph_replays      # the reference's chains ran too
    with pytest.raises(KVIndexError, match=match):
        engine.step()
    # it was the graph that refused (a chain's replays all ran: the guard reads at the sync)
    assert engine.runner.graphs.replays == replays + (8 if chain and not one_graph else 1)
    assert engine.runner.graphs.chain_graph_replays == chained + int(one_graph)
    # the refused store wrote nothing: at most the other request's new row (and the padding
    # page) changed; a write at `limit` would be past the buffer (memcheck runs these tests)
    changed = set()
    for a, b in zip(before, _kv_snapshot(engine)):
        changed |= set((a != b).flatten(1).any(1).nonzero().view(-1).tolist())
    own = (1 if where == "slot" else 2) * (8 if chain else 1)  # the requests' own new rows
    assert len(changed - set(range(engine.config.page_size))) <= own
    assert all(r.finished for r in reqs)
    assert engine.allocator.is_full()
    assert engine.generate([PROMPTS[0]], SP)[0].token_ids == ref
    engine.check_memory()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "eagle-S5"])
def test_unchecked_engine_makes_the_same_tokens(tiny_dir, device, speculative):
    """The bench's `*_unchecked` modes (what the index checks cost): an engine built and run
    under `guard.unchecked()` (on CUDA its graphs captured so) makes the checked engine's
    tokens, and leaves the switch on afterwards."""
    from eaglekv.kernels import guard
    from helpers import spec
    kw = {"speculative": spec("eagle", 5, 1, 6)} if speculative else {}
    want = [o.token_ids for o in tiny_engine(tiny_dir, device=device, max_running_requests=4,
                                             **kw).generate(PROMPTS, SP)]
    with guard.unchecked():
        engine = tiny_engine(tiny_dir, device=device, max_running_requests=4, **kw)
        got = [o.token_ids for o in engine.generate(PROMPTS, SP)]
    assert got == want
    assert guard.checks_enabled()
    engine.check_memory()
