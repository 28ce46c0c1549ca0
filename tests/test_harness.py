"""The equivalence harness's comparison fails where it should, naming the worst parameter (one
process, fabricated per-rank results: no ranks are started)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.harness import assert_trains_like_reference, mismatches


def _result(**change: object) -> dict[str, object]:
    ref = {"w": torch.tensor([1.0, 2.0, 3.0]), "b": torch.tensor([0.5])}
    params = {n: p.clone() for n, p in ref.items()}
    return {"losses": [2.0, 1.5], "ref_losses": [2.0, 1.5], "params": params, "ref_params": ref} | change


def test_equal_runs_pass_both_norm_relative_and_elementwise():
    assert_trains_like_reference([_result(), _result()])
    assert_trains_like_reference([_result()], rel_tol=1e-5, atol=1e-6)


def test_a_parameter_off_by_more_than_the_tolerance_is_named_as_the_worst():
    off = _result()
    off["params"]["w"] = off["params"]["w"] * (1 + 1e-3)
    off["params"]["b"] = off["params"]["b"] * (1 + 1e-4)
    (line,) = mismatches([_result(), off])
    assert line.startswith("rank 1: 2 parameter(s) differ after 2 steps, worst 'w' (relative error")
    with pytest.raises(AssertionError, match=r"worst 'w' \(largest \|p - p_ref\| beyond 1e-06"):
        assert_trains_like_reference([off], atol=1e-6)


def test_a_loss_off_at_one_step_or_not_finite_fails_that_step():
    assert mismatches([_result(losses=[2.0, 1.5 * (1 + 1e-4)])]) == [
        f"rank 0 step 1: loss {1.5 * (1 + 1e-4)!r} != single device 1.5"
    ]
    assert len(mismatches([_result(losses=[math.nan, 1.5])])) == 1
    # loss_atol widens the loss bound only
    assert mismatches([_result(losses=[2.0 + 1e-5, 1.5])], loss_atol=1e-4) == []


def test_missing_or_reshaped_parameters_are_reported():
    missing = _result()
    del missing["params"]["b"]
    assert mismatches([missing]) == ["rank 0: sharded and reference parameter sets differ"]
    reshaped = _result()
    reshaped["params"]["w"] = reshaped["params"]["w"][:2]
    assert "parameter shapes differ" in mismatches([reshaped])[0]


def _abort_until(rank: int, world_size: int, marker: str, aborts: int) -> int:  # noqa: ARG001
    """Abort the process (SIGABRT, as glibc's heap check does) the first ``aborts`` times it runs."""
    import os
    from pathlib import Path

    path = Path(marker)
    runs = int(path.read_text()) if path.exists() else 0
    path.write_text(str(runs + 1))
    if runs < aborts:
        os.abort()
    return runs


@pytest.mark.slow
def test_a_job_whose_rank_aborts_runs_again_and_fails_when_every_run_aborts(tmp_path):
    """run_ranks runs a job again when a rank dies by a signal (the known gloo heap abort), with
    a warning, up to ABORT_ATTEMPTS runs; an abort in every run is a RankFailure, as is any
    exception (never retried)."""
    from tests.harness import ABORT_ATTEMPTS, RankFailure, run_ranks

    with pytest.warns(RuntimeWarning, match="killed by a signal"):
        aborts = ABORT_ATTEMPTS - 1
        assert run_ranks(_abort_until, 1, str(tmp_path / "some"), aborts, timeout_s=60) == [aborts]
    with pytest.raises(RankFailure, match="exited with code -6"):
        run_ranks(_abort_until, 1, str(tmp_path / "every"), ABORT_ATTEMPTS, timeout_s=60)
    with pytest.raises(RankFailure, match="ZeroDivisionError"):
        run_ranks(_divide_by_zero, 1, timeout_s=60)


def _divide_by_zero(rank: int, world_size: int) -> float:  # noqa: ARG001
    return 1 / 0


def _call(rank: int, world_size: int, f) -> object:  # noqa: ANN001, ARG001
    return f(rank)


def test_a_job_the_ranks_cannot_receive_fails_at_once_naming_the_fix():
    """A closure or lambda cannot be pickled to the ranks: ``multiprocessing.Queue`` pickles in a
    feeder thread that only prints the error, so the ranks used to wait out the whole timeout
    (300 s) and report "no result"; the job now fails before it is sent."""
    from tests.harness import run_ranks

    with pytest.raises(TypeError, match="cannot be sent to the ranks.*module-level functions"):
        run_ranks(_call, 1, lambda rank: rank, timeout_s=60)
