"""Issue #46, tracebacks and messages: bad dataset samples (another shape or dtype, a dataset or
stream that raises) are one typed error naming the sample, on every rank (``autoplan run``: one
line, exit 2); a parallel (or deferred) model called with another batch shape than it was planned
for is a ``PlanMismatchError`` naming both shapes; batch norm in training mode is refused naming
its running statistics and what works."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import autoplan
from autoplan.cost_models.errors import PlanError, PlanMismatchError, UnsupportedModelError
from autoplan.runtime.data import ShardedLoader
from tests import zoo
from tests.harness import cpu_cluster, free_port, run_ranks
from tests.test_bad_inputs import fake_job
from tests.test_cli import error_line, run_cli
from tests.test_data_loader import SEQ, IndexedTokens, _dp2_layout, _LoaderOf


class OddSample(IndexedTokens):
    """``IndexedTokens`` whose sample ``bad`` has ``input`` instead of its input (another shape or dtype)."""

    def __init__(self, num_samples: int, bad: int, input: torch.Tensor) -> None:
        super().__init__(num_samples)
        self.bad, self.input = bad, input

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = super().__getitem__(i)
        return (self.input if i == self.bad else x), y


class Unreadable(IndexedTokens):
    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if i == 3:
            raise KeyError("shard-0007 missing")
        return super().__getitem__(i)


class BrokenStream(torch.utils.data.IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        data = IndexedTokens(8)
        for i in range(8):
            if i == 5:
                raise OSError("connection reset\nmore detail")
            yield data[i]


# --- 1. bad samples: one typed error naming the sample ---------------------------------------------


def test_a_sample_of_another_shape_or_dtype_is_named_by_its_index() -> None:
    layout = _dp2_layout()  # rank 0 of dp=2 keeps rows 0, 1 of every 4
    odd_shape = OddSample(8, bad=1, input=torch.arange(SEQ + 1))
    with pytest.raises(PlanMismatchError, match=r"^sample 1 of the dataset: input 0 has shape \[5\]; the plan was made "
                       r"for samples of shape \[4\]: make every sample that shape"):  # fmt: skip
        next(iter(ShardedLoader(odd_shape, layout)))
    odd_dtype = OddSample(8, bad=1, input=torch.arange(SEQ, dtype=torch.int32))
    with pytest.raises(PlanMismatchError, match=r"^sample 1 of the dataset: input 0 is torch.int32; sample 0's is "
                       r"torch.int64"):  # fmt: skip
        next(iter(ShardedLoader(odd_dtype, layout)))
    with pytest.raises(PlanMismatchError, match=r"^sample 5 of the dataset: input 0 has shape"):  # --compare's read
        ShardedLoader(OddSample(8, bad=5, input=torch.arange(SEQ + 1)), layout).global_batch(1)


def test_an_exception_from_the_dataset_its_stream_or_collate_fn_is_quoted_with_the_sample() -> None:
    layout = _dp2_layout(coordinate=(1,))  # rows 2, 3 of every 4
    with pytest.raises(PlanError, match=r"^reading sample 3 of the dataset raised KeyError: 'shard-0007 missing': fix"):
        next(iter(ShardedLoader(Unreadable(8), layout)))
    with pytest.raises(PlanError, match=r"^the BrokenStream raised OSError: connection reset reading sample 5 of the "
                       r"stream \(pass 1\): fix the stream's __iter__"):  # fmt: skip
        list(ShardedLoader(BrokenStream(), layout))

    def collate(samples: list[Any]) -> Any:
        raise ValueError("no")

    with pytest.raises(PlanError, match=r"^collating samples 2..3 of the dataset raised ValueError: no: "):
        next(iter(ShardedLoader(IndexedTokens(8), layout, collate_fn=collate)))


def _bad_sample_on_rank_1(rank: int, world_size: int) -> str:
    """``autoplan run``'s steps of a dataset whose sample 3 (rank 1's rows) has another shape."""
    from autoplan.tools.training_data import TrainingData

    wl = zoo.cli_mlp()
    dataset = OddSample(8, bad=3, input=torch.arange(SEQ + 1))
    wl = autoplan.Workload(model=wl.model, example_inputs=wl.example_inputs, dataset=dataset)
    loader = _LoaderOf(_dp2_layout(coordinate=(rank,)))
    data = TrainingData(wl, loader, shuffle=False, data_seed=0, compare=False)  # type: ignore[arg-type]
    try:
        list(data.steps())
    except PlanError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_a_bad_sample_one_rank_reads_stops_every_rank_with_its_message() -> None:
    results = run_ranks(_bad_sample_on_rank_1, 2)
    assert results[0] == results[1], results
    assert "sample 3 of the dataset: input 0 has shape [5]" in results[0], results


def cli_odd_sample() -> autoplan.Workload:
    """``zoo.cli_mlp_dataset`` whose sample 5 (rank 1's rows of the first step) has 15 features."""
    wl = zoo.cli_mlp_dataset()
    assert isinstance(wl.dataset, torch.utils.data.TensorDataset)
    x, y = wl.dataset.tensors

    class Odd(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
        def __len__(self) -> int:
            return len(x)

        def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
            return (x[i, :15] if i == 5 else x[i]), y[i]

    return replace(wl, dataset=Odd())


def test_run_on_a_dataset_sample_of_another_shape_prints_one_line_and_exits_2(tmp_path: Path) -> None:
    result = run_cli(
        tmp_path,
        "run", f"{Path(__file__)}:cli_odd_sample", "--cluster", "2xCPU", "--pin", "input_0=S(0)",
        "--pin", "target_0=S(0)", "--steps", "2", "--master-port", str(free_port()),
        timeout_s=300,
    )  # fmt: skip
    line = error_line(result)
    assert "sample 5 of the dataset: input 0 has shape [15]; the plan was made for samples of shape [16]" in line
    assert len([x for x in result.stderr.splitlines() if x.strip()]) <= 3, (
        result.stderr
    )  # the calibration note, the line


# --- 2. another batch shape than planned ------------------------------------------------------------


def test_a_deferred_model_called_with_another_batch_shape_names_both_and_the_fix() -> None:
    ids, labels = zoo.token_batch(seed=1)
    with fake_job(2):
        pm = autoplan.parallelize(zoo.gpt2_tiny(), cpu_cluster("2xCPU"), loss_fn=zoo.lm_loss)
        pm(ids, targets=(labels,))
        pm(ids, targets=(labels,))  # the planned shape runs
        with pytest.raises(PlanMismatchError, match=rf"^input 0 has shape \[4, {ids.shape[1]}\]; the plan was made for "
                           rf"\[{ids.shape[0]}, {ids.shape[1]}\] \(fewer samples: an epoch's last partial batch\? DataLoader\(drop_last=True\) leaves it out\) \(the batch of the first call.*pad .* or plan for this"):  # fmt: skip
            pm(ids[:4], targets=(labels[:4],))
        with pytest.raises(PlanMismatchError, match=r"^target 0 has shape"):
            pm.forward_backward(ids, targets=(labels[:, :-1],))


def test_a_parallel_model_checks_the_batch_shape_and_dtype_at_entry() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    x, y = torch.randn(8, 16), torch.randn(8, 8)
    with fake_job(2):
        pm = autoplan.parallelize(model, cpu_cluster("2xCPU"), example_inputs=(x,), loss_fn=F.mse_loss,
                                  example_targets=(y,))  # fmt: skip
        pm.forward_backward(x, targets=(y,))
        with pytest.raises(PlanMismatchError, match=r"^input 0 has shape \[4, 16\]; the plan was made for \[8, 16\] "
                           r"\(fewer samples: an epoch's last partial batch\? DataLoader\(drop_last=True\) leaves it out\) \(the example batch it was traced with\)"):  # fmt: skip
            pm(x[:4], targets=(y[:4],))
        with pytest.raises(PlanMismatchError, match=r"^input 0 is torch.float64; the plan was made for torch.float32"):
            pm.forward_backward(x.double(), targets=(y,))


def test_an_epochs_last_partial_batch_and_a_longer_sequence_name_shapes_and_the_fix() -> None:
    """A DataLoader over 10 samples in batches of 8 ends with a batch of 2 (issue #43 item 2): the
    error names both shapes and drop_last; a stream whose sequences change length names the
    planned length and the fix (pad or re-plan), without the partial-batch hint."""
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    data = torch.utils.data.TensorDataset(torch.randn(10, 16), torch.randn(10, 8))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    x, y = next(iter(loader))
    with fake_job(2):
        pm = autoplan.parallelize(model, cpu_cluster("2xCPU"), example_inputs=(x,), loss_fn=F.mse_loss,
                                  example_targets=(y,))  # fmt: skip
        batches = iter(loader)
        pm(*next(batches)[:1], targets=(y,))
        last_x, last_y = next(batches)
        with pytest.raises(PlanMismatchError, match=r"^input 0 has shape \[2, 16\]; the plan was made for \[8, 16\] "
                           r"\(fewer samples: an epoch's last partial batch\? DataLoader\(drop_last=True\) leaves it out\)"):  # fmt: skip
            pm(last_x, targets=(last_y,))
    ids, labels = zoo.token_batch(seed=1)
    with fake_job(2):
        pm = autoplan.parallelize(zoo.gpt2_tiny(), cpu_cluster("2xCPU"), example_inputs=(ids,), loss_fn=zoo.lm_loss,
                                  example_targets=(labels,))  # fmt: skip
        for length in (ids.shape[1], ids.shape[1] - 4):  # a stream of sequences of changing length
            batch, targets = ids[:, :length], labels[:, :length]
            if length == ids.shape[1]:
                pm(batch, targets=(targets,))
                continue
            with pytest.raises(PlanMismatchError) as info:
                pm(batch, targets=(targets,))
            message = str(info.value)
            assert message.startswith(f"input 0 has shape [8, {length}]; the plan was made for [8, {ids.shape[1]}] (the")
            assert "pad (or convert) the batch to it" in message and "drop_last" not in message


def test_a_pipeline_model_checks_the_global_batch_shape_and_dtype_at_entry() -> None:
    """Once a batch of 4 ran silently on a pipeline planned for 8 (2 micro-batches of 2 on dp=2:
    the schedule cut it into 2 micro-batches of 2 global rows and the stage programs read 1 row
    each); any other shape or integer dtype is now refused before the schedule runs."""
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    x, y = torch.randn(8, 16), torch.randn(8, 8)
    with fake_job(2):
        pm = autoplan.parallelize(model, cpu_cluster("2xCPU"), example_inputs=(x,), loss_fn=F.mse_loss,
                                  example_targets=(y,), global_batch_size=8, profile=None,
                                  config=autoplan.ParallelConfig(dp=2, microbatch_size=2, num_microbatches=2))  # fmt: skip
        assert isinstance(pm, autoplan.PipelineModel)
        with pytest.raises(PlanMismatchError, match=r"^input 0 has shape \[4, 16\]; the plan was made for \[8, 16\] "
                           r"\(fewer samples: an epoch's last partial batch\? DataLoader\(drop_last=True\) leaves it out\) \(the global batch of 2 micro-batches it was planned with\).*or plan for this"):  # fmt: skip
            pm(x[:4], targets=(y[:4],))
        with pytest.raises(PlanMismatchError, match=r"^target 0 has shape \[8, 7\]; the plan was made for \[8, 8\]"):
            pm.forward_backward(x, targets=(y[:, :7],))
        with pytest.raises(PlanMismatchError, match=r"^target 0 is torch.int64; the plan was made for torch.float32"):
            pm.forward_backward(x, targets=(y.long(),))
        with pytest.raises(PlanError, match=r"^expected 1 inputs and 1 targets as planned, got 1 and 0"):
            pm.forward_backward(x)


# --- 3. batch norm in training mode ------------------------------------------------------------------


def test_batch_norm_in_training_mode_traces_and_only_a_cumulative_average_is_refused() -> None:
    """Once refused: batch norm's in-place update of its running statistics broke the backward
    graph; it now traces (tests/test_batchnorm.py trains it). Only ``momentum=None`` (a cumulative
    average) is refused, naming the module and the fix (docs/errors.md row 103)."""
    from autoplan.passes.trace import trace_training_step

    def model(**kw: Any) -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32, **kw), torch.nn.Linear(32, 8))

    x, y = torch.randn(8, 16), torch.randn(8, 8)
    trace_training_step(model(), (x,), loss_fn=F.mse_loss, example_targets=(y,))
    trace_training_step(model().eval(), (x,), loss_fn=F.mse_loss, example_targets=(y,))
    trace_training_step(model(track_running_stats=False), (x,), loss_fn=F.mse_loss, example_targets=(y,))
    with pytest.raises(UnsupportedModelError, match=r"^batch norm in training mode with momentum=None \(BatchNorm1d 1\) "
                       r"keeps a cumulative average.*give it a momentum"):  # fmt: skip
        trace_training_step(model(momentum=None), (x,), loss_fn=F.mse_loss, example_targets=(y,))
    trace_training_step(model(momentum=None).eval(), (x,), loss_fn=F.mse_loss, example_targets=(y,))
