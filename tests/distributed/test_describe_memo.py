"""A rank's description kept between saves (describe.describe_layout's memo_key): reused only for
an equal tree with the same dtypes and shapes, always with the new save's tensors."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from savepoint.distributed import Shard, describe, save
from savepoint.distributed.layout import Grid

KEY = ("test", "describe-memo")


def state(rows: int = 8, dtype: Any = np.float32, step: int = 0) -> dict[str, Any]:
    grid = Grid((2,), (1,), (0,))
    local = np.arange(rows // 2 * 3, dtype=dtype).reshape(rows // 2, 3)
    return {
        "w": Shard(local, (rows, 3), (rows // 2, 0), grid=grid),
        "bias": np.ones(3, dtype),
        "config": {"step": step},
    }


@pytest.fixture(autouse=True)
def _forget() -> Any:
    describe.forget(KEY)
    yield
    describe.forget(KEY)


def test_an_equal_state_reuses_the_description_with_its_own_tensors() -> None:
    first = save.flatten(state())
    plan1, sources1, grid1 = describe.describe_layout(first, "a", KEY)
    again = save.flatten(state())
    walked = describe.describe_layout(again, "b")  # (no key: walked)
    plan2, sources2, grid2 = describe.describe_layout(again, "b", KEY)
    assert plan2 == walked[0] and plan2.path == "b" and plan1.path == "a"
    assert grid2 == grid1 == walked[2] and grid1 is not None
    assert sources2.keys() == sources1.keys()
    for source in sources2.values():  # the new flatten's tensors, never the kept ones
        assert any(source is s for s in again.tensors.values())
        assert all(source is not s for s in first.tensors.values())


@pytest.mark.parametrize(
    "changed",
    [
        {"rows": 10},  # shapes (and the Shard's layout)
        {"dtype": np.float64},  # dtypes only: the tree is the same
        {"step": 1},  # a plain value in the tree
    ],
)
def test_any_difference_is_described_again(changed: dict[str, Any]) -> None:
    describe.describe_layout(save.flatten(state()), "a", KEY)
    other = save.flatten(state(**changed))
    got = describe.describe_layout(other, "b", KEY)
    want = describe.describe_layout(other, "b")
    assert got[0] == want[0] and got[2] == want[2]
    assert {k: (s.dtype, s.shape) for k, s in got[1].items()} == {
        k: (s.dtype, s.shape) for k, s in want[1].items()
    }
