"""The one-pass greedy pick (`greedy.greedy_pick`: argmax and validity of each logit row)
equals its torch reference, token for token on every valid row and flag for flag on every
row, over row counts, vocabularies across the block edge, float dtypes, ties (the first index
wins, across blocks too) and the rows that make a pick invalid (a NaN, a +inf, all -inf) or
leave it valid (-inf among finite logits); each with one program a row and with a row split
over programs whose partials a second launch reduces (a tie or the only finite logit in any
chunk). Runs on the GPU when there is one, else under TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch
from triton_here import DEV, GPU_MARK, ON_GPU  # noqa: I001  (before the kernel modules)

from eaglekv.kernels.greedy import greedy_pick, greedy_pick_torch  # noqa: E402
from eaglekv.kernels.greedy_triton import (BLOCK, CHUNK, SPLIT_MAX_ROWS,  # noqa: E402
                                           greedy_pick_triton, split_count)
from eaglekv.sampling import valid_argmax  # noqa: E402

pytestmark = GPU_MARK


def _rows(R, V, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(R, V, generator=g).to(dtype)
    specials = ["nan", "inf", "all_neg_inf", "some_neg_inf", "tie_across_blocks", "tie_in_block",
                "max_last", "neg_inf_then_finite"]
    for r in range(min(R, len(specials))):
        kind = specials[(r + seed) % len(specials)]
        if kind == "nan":
            x[r, V // 2] = float("nan")
        elif kind == "inf":
            x[r, V - 1] = float("inf")
        elif kind == "all_neg_inf":
            x[r] = float("-inf")
        elif kind == "some_neg_inf":
            x[r, ::2] = float("-inf")
        elif kind == "tie_across_blocks":
            x[r, 0] = x[r, V - 1] = 100.0
        elif kind == "tie_in_block" and V > 1:
            x[r, V // 3] = x[r, V // 3 + 1] = 50.0
        elif kind == "max_last":
            x[r, V - 1] = 75.0
        elif kind == "neg_inf_then_finite":
            x[r, :max(1, V - 3)] = float("-inf")
    return x


def _check(x, splits=None):
    want = greedy_pick_torch(x)
    got = greedy_pick_triton(x.to(DEV), splits).cpu()
    assert got.dtype == torch.int64 and got.shape == (x.shape[0], 2)
    assert torch.equal(got[:, 1], want[:, 1]), (got, want)
    ok = want[:, 1].bool()
    assert torch.equal(got[ok, 0], want[ok, 0])
    assert torch.equal(want[:, 1].bool(), valid_argmax(x))     # the rule sampling uses
    return want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("V", [1, 7, BLOCK, BLOCK + 5, 3 * BLOCK + 1])
@pytest.mark.parametrize("R", [1, 9])
@pytest.mark.parametrize("splits", [1, 3])
def test_pick_equals_reference(dtype, V, R, splits):
    for seed in range(2):
        want = _check(_rows(R, V, dtype, seed), splits)
        if V > 1 and R > 1:
            assert not want[:, 1].all() and want[:, 1].any()     # both kinds of row present


@pytest.mark.parametrize("splits", [1, 2, 5])
def test_the_first_index_wins_a_tie_across_blocks(splits):
    x = torch.full((2, 2 * BLOCK + 3), -1.0)
    x[0, 5] = x[0, BLOCK + 7] = x[0, 2 * BLOCK + 2] = 3.0
    x[1, 2 * BLOCK + 2] = x[1, BLOCK + 7] = 3.0
    got = greedy_pick_triton(x.to(DEV), splits).cpu()
    assert got.tolist() == [[5, 1], [BLOCK + 7, 1]]


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_split_row_whose_only_finite_logit_is_in_one_chunk(where):
    """The other chunks' partials are (-inf, index 0 of nothing): the reduce takes the one
    chunk that saw a finite logit, whichever it is, and a row with none is invalid."""
    V = 3 * CHUNK + 5
    at = {"first": 3, "middle": CHUNK + 17, "last": V - 1}[where]
    x = torch.full((2, V), float("-inf"))
    x[0, at] = -7.0
    got = greedy_pick_triton(x.to(DEV), 4).cpu()
    assert got.tolist()[0] == [at, 1] and got[1, 1] == 0
    assert split_count(1, 49152) == 24 and split_count(SPLIT_MAX_ROWS + 1, 49152) == 1


def test_the_vocabulary_of_the_default_model_and_a_strided_view():
    """SmolLM2's 49152 logits a row, and rows that are a view with a row stride (a slice of
    a wider buffer, as a graph's static output is)."""
    x = _rows(3, 49152, torch.bfloat16, 3)
    _check(x)                                      # split: 24 programs a row
    _check(x, 1)
    wide = torch.randn(4, 49152 + 64).to(torch.bfloat16)
    view = wide[:, :49152]
    assert torch.equal(greedy_pick(view.to(DEV)).cpu() if ON_GPU else
                       greedy_pick_triton(view).cpu(), greedy_pick_torch(view))


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="expected \\(R, V\\)"):
        greedy_pick(torch.zeros(2, 3, 4))
    with pytest.raises(TypeError, match="int64"):
        greedy_pick(torch.zeros(2, 3, dtype=torch.int64))
