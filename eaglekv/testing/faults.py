"""Fault injection for the reliability suite (tests and benches only; nothing here is imported
by the engine, so it costs nothing when unused).

`inject(engine, path, kind, ...)` corrupts one index on one path that turns an index into an
address, for the next engine step, by wrapping one method of that engine's own objects (an
instance attribute, removed on exit) or, for req_to_token, by writing the table directly:

    path                 where the bad index goes                       limit
    store_cache          the target forward's K/V write slots (out_cache_loc)  pool size_limit
    move_kv              the commit's target row move, dst              pool size_limit
    req_to_token         a running request's committed table entry      pool size_limit
    draft_out_cache_loc  the draft's write slot of draft step 0         pool size_limit
    draft_kv_indices     step 0's kv_indices entry (a slot the draft reads)  pool size_limit
    draft_kv_indptr      step 0's kv_indptr entry of branch 1 (an offset into kv_indices)
                                                                        kv_indices width
    tree_retrieve        the accepted path's node at depth 1             num_draft_tokens
    graph_padded_rows    a padded row's write slot in a graph's static buffers  pool size_limit

The CUDA-graph paths. A replay skips the eager methods above, so where the engine holds
captured forwards (`graph_objects`: DecodeGraphs, VerifyGraphs, SpecStepGraphs; real graphs
on CUDA, or `capture=False` ones replayed eagerly on CPU) the hooks also corrupt their static
input buffers right before the replay (`_replay`), which the graph reads:

    store_cache          request 0's write slot: DecodeGraphs `dev[3, 0]` (a decode chain:
                         its host slot block, which the chain checks on the host),
                         VerifyGraphs `out_cache_loc[0]`, SpecStepGraphs verify slot (0, 0)
                         (a speculative chain: its host block of every step's verify slots,
                         checked on the host; a padded row's or a draft slot is written
                         before the chain's last replay)
    draft_out_cache_loc  SpecStepGraphs draft slot (0, 0, 0)
    graph_padded_rows    a padded row's write slot in any of the three
    tree_retrieve        inside SpecStepGraphs the accepted path is a value the graph computes:
                         `eaglekv.speculative.graphs.greedy_accept` is wrapped (capture=False
                         graphs call it at every replay); a captured graph holds whatever was
                         wrapped while it was captured, so build the engine under
                         `graph_seams(device)`, whose wrapper overwrites path[0, 1] from a
                         device control tensor that `inject` sets before the replay and clears
                         after it
The draft kv_indices / kv_indptr of a step graph are computed inside the graph from the slots
above: no static input holds them, so those two paths are not reachable there.

    kind      value
    negative  -1 (-2 for tree_retrieve, whose -1 means "not accepted")
    limit     the limit itself (one past the last valid index)
    huge      2**31 - 1
    foreign   a valid index that belongs to another request (a slot of its committed KV;
              draft_kv_indptr: the offset of another request's segment; tree_retrieve: a
              node that is not a child of the root)

`run_case` drives one case end to end on a CPU engine and returns what happened (`Outcome`).
"""

from __future__ import annotations

import dataclasses
import traceback
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import torch

from eaglekv.errors import KVIndexError

PATHS = ("store_cache", "move_kv", "req_to_token", "draft_out_cache_loc", "draft_kv_indices",
         "draft_kv_indptr", "tree_retrieve", "graph_padded_rows")
KINDS = ("negative", "limit", "huge", "foreign")
HUGE = 2**31 - 1
SPECULATIVE_PATHS = {"move_kv", "draft_out_cache_loc", "draft_kv_indices", "draft_kv_indptr",
                     "tree_retrieve"}


@dataclass
class Fault:
    path: str
    kind: str
    limit: int = 0
    value: int | None = None     # the corrupt index, once written
    fired: int = 0


def bad_value(kind: str, limit: int, foreign: int, low: int = 0) -> int:
    """`low`: the least valid index (-1 where -1 means "none", as in an accepted path)."""
    return {"negative": low - 1, "limit": limit, "huge": HUGE, "foreign": foreign}[kind]


def _wrap(obj, name: str, make, undo: list) -> None:
    """obj.name = make(original) as an instance attribute, deleted again by undo."""
    orig = getattr(obj, name)
    setattr(obj, name, make(orig))
    undo.append(lambda: delattr(obj, name))


def graph_objects(engine) -> dict:
    """The engine runner's captured forwards by kind: "decode" (DecodeGraphs), "verify"
    (VerifyGraphs), "spec_step" (SpecStepGraphs); only those it holds."""
    r = engine.runner
    found = {"decode": getattr(r, "graphs", None), "verify": getattr(r, "verify_graphs", None),
             "spec_step": getattr(r, "step_graphs", None)}
    return {k: g for k, g in found.items() if g is not None}


def _write_slot(kind: str, g, b: int, which: str) -> tuple | None:
    """(flat buffer, index) of a write slot in graph g's static inputs for bucket b: `which`
    "real" (request 0's first), "draft" (SpecStepGraphs' draft slot (0, 0, 0)) or "padded"
    (the first padded row's; None when the bucket has none: row 0 of req_to_token marks one)."""
    if kind == "decode":
        buf, width, rows, slot0, per = g.dev.view(-1), g.dev.shape[1], g.dev[2, :b], 3, 1
        slot0 *= width
    elif kind == "verify":
        buf, rows, slot0, per = g.out_cache_loc, g.rows[:b], 0, g.N
    else:
        if which == "draft":
            return g.inputs, g.offsets[4]
        o = g.offsets
        buf, rows, slot0, per = g.inputs, g.inputs[o[1]:o[1] + b], o[5], g.worker.N
    if which == "real":
        return buf, slot0
    pad = (rows == 0).nonzero()
    return None if not pad.numel() else (buf, slot0 + int(pad[0]) * per)


def _corrupt_graphs(engine, f: Fault, which: str, value, undo: list) -> None:
    """Before the next replay of any of the engine's graphs, write `value()` into the slot
    `which` of its static inputs (one-shot, shared with the eager hook through f.fired). A
    decode chain (DecodeGraphs.replay_chain) takes it in its host slot block instead: the
    chain's device buffer holds only its last step's slots at the sync, so the chain checks
    its whole block on the host, and that check is the guard a corrupt chain slot meets. A
    speculative chain (SpecStepGraphs.run_chain) likewise takes a real verify slot in its host
    block (vchain); a padded row's or a draft slot goes into the static inputs before the
    chain's last replay (earlier replays' verify regions are overwritten by the next step's)."""
    for kind, g in graph_objects(engine).items():
        if which == "draft" and kind != "spec_step":
            continue
        chain = []            # decode: inside a chain; spec_step: replays left in the chain

        def make(orig, kind=kind, g=g, chain=chain):
            def _replay(b):
                if kind == "spec_step" and chain:
                    chain[0] -= 1
                    late = which != "real" and chain[0] == 0
                    at = _write_slot(kind, g, b, which) if late and not f.fired else None
                else:
                    at = None if f.fired or chain else _write_slot(kind, g, b, which)
                if at is not None:
                    at[0][at[1]] = value()
                return orig(b)
            return _replay
        _wrap(g, "_replay", make, undo)
        if kind == "decode" and which == "real":
            def make_chain(orig, chain=chain):
                def replay_chain(ids, positions, rows, slots):
                    if not f.fired:
                        slots = slots.copy()
                        slots[0, 0] = value()
                    chain.append(1)
                    try:
                        return orig(ids, positions, rows, slots)
                    finally:
                        chain.pop()
                return replay_chain
            _wrap(g, "replay_chain", make_chain, undo)
        if kind == "spec_step":
            def make_spec_chain(orig, chain=chain):
                def run_chain(reqs, dslots, vchain):
                    if which == "real" and not f.fired:
                        vchain = vchain.clone()
                        vchain[0, 0, 0] = value()
                    chain[:] = [vchain.shape[0]]
                    try:
                        return orig(reqs, dslots, vchain)
                    finally:
                        chain.clear()
                return run_chain
            _wrap(g, "run_chain", make_spec_chain, undo)


_SEAM: dict = {}     # device -> int64 [on, value]: graph_seams' control of the accepted path


@contextmanager
def graph_seams(device):
    """Build engines inside this context to make the tree_retrieve fault reach a captured
    SpecStepGraphs: `eaglekv.speculative.graphs.greedy_accept` is wrapped while the graphs are
    captured, so each graph overwrites the accepted path's node at depth 1 of request 0 with
    the control tensor's value whenever its `on` entry is 1 (0 between faults: the path is
    the graph's own)."""
    import eaglekv.speculative.graphs as sg
    ctl = torch.zeros(2, dtype=torch.int64, device=device)
    _SEAM[torch.device(device).type] = ctl
    orig = sg.greedy_accept

    def greedy_accept(tree, *args):
        res = orig(tree, *args)
        if res.path.is_cuda and torch.cuda.is_current_stream_capturing():
            path = res.path.clone()
            path[0, 1] = torch.where(ctl[0] == 1, ctl[1], path[0, 1])
            res = dataclasses.replace(res, path=path)
        return res
    sg.greedy_accept = greedy_accept
    try:
        yield ctl
    finally:
        sg.greedy_accept = orig
        _SEAM.pop(torch.device(device).type, None)


@contextmanager
def inject(engine, path: str, kind: str, target=None, foreign_slot: int = 0):
    """Corrupt one index of `path` in the next step (one-shot). `target`: the request whose
    table entry is corrupted (req_to_token); `foreign_slot`: a committed slot of another
    request (kind "foreign"). Yields the Fault (value and fired filled in when it fires)."""
    if path not in PATHS or kind not in KINDS:
        raise ValueError(f"unknown fault {path!r} x {kind!r}")
    pool = engine.kv_pool
    f = Fault(path, kind, limit=pool.size_limit)
    undo: list = []

    def fire(value: int) -> int:
        f.value, f.fired = int(value), f.fired + 1
        return f.value

    try:
        if path == "store_cache":
            def make(orig):
                def init_forward_metadata(batch):
                    if not f.fired:      # the forward's write slots, for every layer
                        loc = batch.out_cache_loc.clone()
                        loc.view(-1)[0] = fire(bad_value(kind, f.limit, foreign_slot))
                        batch = dataclasses.replace(batch, out_cache_loc=loc)
                    return orig(batch)
                return init_forward_metadata
            _wrap(engine.backend, "init_forward_metadata", make, undo)
            _corrupt_graphs(engine, f, "real",
                            lambda: fire(bad_value(kind, f.limit, foreign_slot)), undo)
        elif path == "move_kv":
            def make(orig):
                def move_kv(dst, src):
                    if not f.fired:
                        dst = dst.clone()
                        dst.view(-1)[0] = fire(bad_value(kind, f.limit, foreign_slot))
                    return orig(dst, src)
                return move_kv
            _wrap(pool, "move_kv", make, undo)
        elif path == "req_to_token":
            r2t = engine.req_to_token.req_to_token
            r2t[target.row, 1] = fire(bad_value(kind, f.limit, foreign_slot))
        elif path in ("draft_out_cache_loc", "draft_kv_indices", "draft_kv_indptr"):
            slots = engine.runner.slots
            if path == "draft_kv_indptr":
                f.limit = slots.kv_indices.shape[1]

            def make(orig):
                def prepare_draft(reqs, rows, seq_lens):
                    d = orig(reqs, rows, seq_lens)
                    if f.fired:
                        return d
                    if path == "draft_out_cache_loc":
                        d.slots.view(-1)[0] = fire(bad_value(kind, f.limit, foreign_slot))
                    elif path == "draft_kv_indices":
                        slots.kv_indices[0, 0] = fire(bad_value(kind, f.limit, foreign_slot))
                    else:   # branch 1's offset; foreign: the segment of the last request
                        other = int(slots.kv_indptr[0, (len(reqs) - 1) * slots.K])
                        slots.kv_indptr[0, 1] = fire(bad_value(kind, f.limit, other))
                    return d
                return prepare_draft
            _wrap(slots, "prepare_draft", make, undo)
            if path == "draft_out_cache_loc":
                _corrupt_graphs(engine, f, "draft",
                                lambda: fire(bad_value(kind, f.limit, foreign_slot)), undo)
        elif path == "tree_retrieve":
            import eaglekv.speculative.eagle_worker as ew
            import eaglekv.speculative.graphs as sg
            f.limit = engine.runner.N
            for mod, name in ((ew, "greedy_accept"), (ew, "sample_accept"),
                              (sg, "greedy_accept")):
                orig = getattr(mod, name)

                def accept(tree, *args, _orig=orig):
                    res = _orig(tree, *args)
                    if not f.fired:   # foreign: a node whose parent is not the root
                        deep = (tree.parent[0] > 0).nonzero()
                        other = int(deep[0]) if deep.numel() else 0
                        res.path[0, 1] = fire(bad_value(kind, f.limit, other, low=-1))
                    return res
                setattr(mod, name, accept)
                undo.append(lambda _m=mod, _n=name, _o=orig: setattr(_m, _n, _o))
            step = graph_objects(engine).get("spec_step")
            ctl = _SEAM.get(engine.device.type) if step is not None else None
            if step is not None and step.capture:
                if ctl is None:
                    raise RuntimeError("tree_retrieve on captured step graphs: build the "
                                       "engine under faults.graph_seams(device)")

                def make(orig):
                    def _replay(b):
                        if f.fired:
                            return orig(b)
                        ctl.copy_(torch.tensor([1, fire(bad_value(kind, f.limit, 0,
                                                                  low=-1))]))
                        try:
                            return orig(b)
                        finally:
                            ctl[0] = 0          # stream-ordered after the replay
                    return _replay
                _wrap(step, "_replay", make, undo)
        elif path == "graph_padded_rows":
            _corrupt_graphs(engine, f, "padded",
                            lambda: fire(bad_value(kind, f.limit, foreign_slot)), undo)
        yield f
    finally:
        for u in reversed(undo):
            u()


# ---- one case, end to end --------------------------------------------------------------------
@dataclass
class Outcome:
    path: str
    kind: str
    value: int | None = None
    limit: int = 0
    fired: bool = False
    raised: str = ""             # exception class, "" if none
    op: str = ""                 # the path the error names
    names_value: bool = False    # the error carries the corrupt value
    nothing_written: bool = False   # canaries and every request's committed K/V unchanged
    serving: bool = False        # the next request equals its reference, books balanced
    detail: str = ""
    ownership_mode: bool = False
    config: str = ""             # the engine configuration, named by the caller
    errors: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (self.fired and self.raised in ("KVIndexError", "KVOwnershipError",
                                               "ConfigError")
                and self.names_value and self.nothing_written and self.serving)

    @property
    def cell(self) -> str:
        if self.ok:
            return "refused, nothing written, engine serving"
        parts = [f"raised {self.raised}" if self.raised else "NOT refused"]
        parts.append("nothing written" if self.nothing_written else "WRITTEN")
        parts.append("engine serving" if self.serving else "engine NOT serving")
        return ", ".join(parts)

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(ok=self.ok, cell=self.cell)
        return d


def _pools(engine) -> list:
    from eaglekv.memory.ownership import kv_pools
    return kv_pools([engine.kv_pool, engine.runner])


def _committed(engine) -> torch.Tensor:
    r2t = engine.req_to_token.req_to_token
    rows = [r2t[r.row, :r.kv_len].to("cpu", torch.int64) for r in engine.running if r.kv_len]
    return torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64)


def run_case(engine, path: str, kind: str, prompts: list[list[int]], refs: list[list[int]],
             next_prompt: list[int], next_ref: list[int], params) -> Outcome:
    """Start `prompts` (greedy, `params`), step until each has decoded two tokens, corrupt
    one index of `path` (kind), run one step; then check what the error says, that no byte
    outside the pools' valid rows and no committed K/V of any request changed, and that the
    engine serves `next_prompt` exactly (`next_ref`) with its books balanced and every slot
    free at the end. The ownership checked mode is on for kind "foreign" only."""
    out = Outcome(path, kind, ownership_mode=kind == "foreign")
    engine.check_ownership(kind == "foreign")
    reqs = [engine.add_request(p, params) for p in prompts]
    spec = engine.worker is not None
    while any(len(r.output_ids) < 2 or (spec and r.draft_state is None) for r in reqs):
        engine.step()
        engine.check_memory()
    victim, target = reqs[-1], reqs[0]
    slots = _committed(engine)
    pools = _pools(engine)
    before = [(p.kv[:, :, slots].clone()) for p in pools]
    foreign = int(engine.req_to_token.req_to_token[victim.row, 0])
    try:
        with inject(engine, path, kind, target=target, foreign_slot=foreign) as f:
            engine.step()
    except Exception as e:  # noqa: BLE001 - every outcome is recorded, the table judges
        out.raised = type(e).__name__
        out.detail = str(e)[:300]
        if isinstance(e, KVIndexError):
            out.op = e.op
            out.names_value = e.first_bad == f.value and str(f.value) in str(e)
        else:
            out.errors.append(traceback.format_exc(limit=3)[-600:])
    out.value, out.limit, out.fired = f.value, f.limit, bool(f.fired)
    out.nothing_written = (all(p.canaries_intact() for p in pools)
                           and all(torch.equal(b, p.kv[:, :, slots])
                                   for b, p in zip(before, pools)))
    try:
        while engine.has_unfinished():   # whatever was not failed finishes
            engine.step()
        for r, ref in zip(reqs, refs):
            if r.finish_reason != "error" and r.output_ids != ref:
                raise AssertionError(f"a request that went on diverged: {r.output_ids} "
                                     f"!= {ref}")
        engine.check_memory()
        got = engine.generate([next_prompt], params)[0].token_ids
        if got != next_ref:
            raise AssertionError(f"next request: {got} != {next_ref}")
        engine.check_memory()
        if not engine.allocator.is_full():
            raise AssertionError("slots still in use after every request ended")
        out.serving = True
    except Exception as e:  # noqa: BLE001
        out.errors.append(f"serving: {type(e).__name__}: {str(e)[:300]}")
    finally:
        engine.check_ownership(False)
    return out


def write_table(outcomes: list[Outcome], md_path, json_path, command: str, device: str) -> None:
    """The path x corruption table, as markdown and JSON (with the date and the command)."""
    import datetime
    import json
    from pathlib import Path
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    by: dict = {}
    for o in outcomes:
        by.setdefault((o.path, o.kind), []).append(o)
    lines = [f"Fault table ({device}, {date}); command: `{command}`", "",
             "A cell reads \"refused, nothing written, engine serving\" when, on every engine "
             "configuration the path was tried on, the step ended in KVIndexError naming the "
             "path and the corrupt value, the canary rows around every pool and every "
             "request's committed K/V were unchanged, and the next request came out exact "
             "with the books balanced; it shows the value(s), the check that refused it and "
             "the configurations. The foreign column runs with the ownership checked mode "
             "on, the others with the always-on guards only.", "",
             "| path | " + " | ".join(KINDS) + " |", "|---|" + "---|" * len(KINDS)]
    for p in PATHS:
        cells = []
        for k in KINDS:
            os_ = by.get((p, k), [])
            if not os_:
                cells.append("not run")
                continue
            bad = [o for o in os_ if not o.ok]
            ops = sorted({o.op.split(" (")[0].split(":")[0] for o in os_ if o.op})
            vals = sorted({o.value for o in os_ if o.value is not None})
            head = (os_[0].cell if not bad else
                    "; ".join(f"{o.config}: {o.cell}" for o in bad))
            cells.append(f"{head}: {', '.join(map(str, vals))} "
                         f"({', '.join(f'`{x}`' for x in ops)}; "
                         f"{', '.join(o.config for o in os_)})")
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    ok = sum(o.ok for o in outcomes)
    cells_ok = sum(all(o.ok for o in v) for v in by.values())
    lines += ["", f"{cells_ok} of {len(by)} cells refused, nothing written, engine serving "
              f"({ok} of {len(outcomes)} cases)."]
    Path(md_path).write_text("\n".join(lines) + "\n")
    Path(json_path).write_text(json.dumps(
        {"date": date, "device": device, "command": command, "cells_ok": cells_ok,
         "cells": len(by), "cases_ok": ok,
         "cases": [o.as_dict() for o in outcomes]}, indent=1) + "\n")
