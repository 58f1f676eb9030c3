"""EngineRows: slicing and joining keep every array aligned, the optional log_mass_t included."""

import numpy as np

from topkd.cache.format.engine_rows import EngineRows


def rows(n: int, k: int = 3, temps: int = 1, tempered: bool = True) -> EngineRows:
    r = np.arange(n, dtype=np.float32)
    return EngineRows(
        ids=np.arange(n * k, dtype=np.int32).reshape(n, k),
        logprobs=np.tile(-r[:, None], (1, k)),
        log_mass=-r,
        log_tail=r,
        logz=np.tile(r[:, None], (1, temps)),
        log_mass_t=np.tile(r[:, None], (1, temps)) if tempered else None,
    )


def test_slices_joined_again_are_the_rows():
    whole = rows(7)
    back = EngineRows.concat([whole.slice(0, 2), whole.slice(2, 3), whole.slice(3, 7)])
    for name in ("ids", "logprobs", "log_mass", "log_tail", "logz", "log_mass_t"):
        np.testing.assert_array_equal(getattr(back, name), getattr(whole, name))
    assert len(back) == 7 and len(whole.slice(5, 7)) == 2 and whole.slice(5, 7).ids[0, 0] == 15


def test_a_part_without_tempered_masses_leaves_none_in_the_join():
    joined = EngineRows.concat([rows(2), rows(3, tempered=False)])
    assert joined.log_mass_t is None and len(joined) == 5 and joined.slice(1, 4).log_mass_t is None
