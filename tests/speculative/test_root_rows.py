"""RootRow / stack_roots: a request's draft root kept as a row of its batch's DraftOut, and
the batch's roots gathered in one copy when the requests come back in the same order."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from eaglekv.speculative.drafter import DraftOut, RootRow, stack_roots


def reqs_of(states):
    return [SimpleNamespace(draft_state=s) for s in states]


@pytest.mark.parametrize("hidden", [True, False])
def test_stack_roots_equals_a_stack_of_the_rows(hidden):
    g = torch.Generator().manual_seed(0)
    a = DraftOut(torch.randn(5, 11, generator=g), torch.randn(5, 3, generator=g) if hidden else None)
    b = DraftOut(torch.randn(2, 11, generator=g), torch.randn(2, 3, generator=g) if hidden else None)
    cases = {
        "same batch, same order": [RootRow(a, i) for i in range(5)],
        "a prefix (the last ones finished)": [RootRow(a, i) for i in range(3)],
        "reordered": [RootRow(a, i) for i in (1, 0, 2)],
        "a gap": [RootRow(a, i) for i in (0, 2, 3)],
        "two batches": [RootRow(a, 0), RootRow(b, 1), RootRow(a, 2)],
        "tuples": [(a.logits[i], None if a.hidden is None else a.hidden[i]) for i in (4, 0)],
    }
    for name, states in cases.items():
        reqs = reqs_of(states)
        for i in (0, 1):
            rows = [s[i] for s in states]
            got = stack_roots(reqs, i)
            if rows[0] is None:
                assert got is None, name
                continue
            want = torch.stack(rows)
            assert torch.equal(got, want), name
            out = torch.full((8, want.shape[1]), 7.0)
            stack_roots(reqs, i, out[:len(reqs)])
            assert torch.equal(out[:len(reqs)], want) and (out[len(reqs):] == 7).all(), name


def test_the_one_copy_path_is_a_copy_not_a_view():
    """The roots outlive the buffer they came from (a graph's window output is overwritten by
    the next replay): stack_roots returns memory of its own."""
    out = DraftOut(torch.zeros(3, 4), torch.zeros(3, 2))
    got = stack_roots(reqs_of([RootRow(out, i) for i in range(3)]), 0)
    out.logits.fill_(1.0)
    assert (got == 0).all()
