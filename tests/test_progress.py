"""The planning status line: shown on a terminal, silent elsewhere, restored after the block."""

from __future__ import annotations

import io

from autoplan.planner import progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_status_line_is_shown_on_a_terminal_and_cleared_at_the_end():
    out = _Terminal()
    with progress.reporting(stream=out):
        progress.step("tracing the model")
        progress.step("solving the placement ILP")
    text = out.getvalue()
    assert "autoplan: tracing the model ... " in text
    assert "autoplan: solving the placement ILP ... " in text
    assert text.count("\r") >= 3  # each status replaces the previous one, and the end erases it
    assert text.endswith("\r\033[K")


def test_nothing_is_written_to_a_pipe_or_with_reporting_off():
    pipe = io.StringIO()  # isatty() is False
    with progress.reporting(stream=pipe):
        progress.step("tracing")
    term = _Terminal()
    with progress.reporting(enabled=False, stream=term):
        progress.step("tracing")
    assert pipe.getvalue() == "" and term.getvalue() == ""


def test_steps_outside_a_reporting_block_are_silent_and_the_switch_is_restored():
    out = _Terminal()
    with progress.reporting(stream=out):
        with progress.reporting(enabled=False, stream=out):
            progress.step("inner, silent")
        progress.step("outer again")
    progress.step("after the block")  # no reporter: a no-op
    text = out.getvalue()
    assert "inner, silent" not in text and "outer again" in text and "after the block" not in text


def test_planning_reports_its_steps_on_a_terminal(monkeypatch):
    import torch

    import autoplan
    from tests.zoo import mlp, mlp_batch

    monkeypatch.setenv("AUTOPLAN_NO_PLAN_CACHE", "1")  # a cached plan skips the steps
    x, y = mlp_batch()
    out = _Terminal()
    with progress.reporting(stream=out):
        autoplan.plan(mlp(), "2xCPU", example_inputs=(x,), loss_fn=torch.nn.functional.mse_loss, example_targets=(y,))
    text = out.getvalue()
    for label in ("tracing the model", "placement strategies", "pricing", "solving the placement ILP"):
        assert label in text, text
