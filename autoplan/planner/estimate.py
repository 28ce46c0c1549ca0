"""The estimate of one configuration's training step, as ``autoplan.estimate`` and the joint search report it."""

from __future__ import annotations

from dataclasses import dataclass

from autoplan.cost_models.config import ParallelConfig
from autoplan.cost_models.step import PipelineEstimate


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainingEstimate:
    """Estimated training step of one configuration on a cluster (per device where it says)."""

    config: ParallelConfig
    step_time_s: float
    compute_s: float
    """Busy compute of the slowest pipeline rank (forward, backward, recomputation)."""
    exposed_comm_s: float
    """Communication not hidden behind compute: tensor-parallel collectives, exposed gradient
    synchronisation, pipeline point-to-point."""
    bubble_s: float
    """Idle time of the pipeline schedule (0 without pipeline parallelism)."""
    optimizer_s: float
    memory_per_device_bytes: tuple[float, ...]
    """Peak bytes per device of each pipeline rank (devices of one rank are alike)."""
    memory_parts_bytes: tuple[dict[str, float], ...]
    """Per pipeline stage: weights, grads, optimizer, activations, transient."""
    capacity_bytes: float
    tokens_per_s: float
    mfu: float
    """Model FLOPs utilisation: model FLOPs per step / (step time x devices x peak FLOP/s)."""
    stage_starts: tuple[int, ...]
    """First segment of each stage (segment 0 = prologue, 1..L = blocks, L+1 = epilogue)."""
    stage_recompute: tuple[str, ...]
    feasible: bool
    precision: str
    num_blocks: int

    @property
    def peak_memory_bytes(self) -> float:
        return max(self.memory_per_device_bytes)

    def summary(self) -> str:
        gib = 2**30
        lines = [
            f"config: {self.config}",
            f"step time {self.step_time_s * 1e3:.1f} ms = compute {self.compute_s * 1e3:.1f} ms "
            f"+ exposed comm {self.exposed_comm_s * 1e3:.1f} ms + bubble {self.bubble_s * 1e3:.1f} ms "
            f"+ optimizer {self.optimizer_s * 1e3:.1f} ms (parts overlap)",
            f"throughput {self.tokens_per_s:,.0f} tokens/s, MFU {self.mfu:.1%}",
            f"peak memory per device {self.peak_memory_bytes / gib:.2f} GiB of {self.capacity_bytes / gib:.1f} GiB"
            + ("" if self.feasible else "  (DOES NOT FIT)"),
        ]
        if self.config.pp > 1:
            lines.append(f"stages start at segments {list(self.stage_starts)}, recompute {list(self.stage_recompute)}")
        return "\n".join(lines)


def to_training_estimate(est: PipelineEstimate, *, precision: str, num_blocks: int) -> TrainingEstimate:
    return TrainingEstimate(
        config=est.config,
        step_time_s=est.step_time_s,
        compute_s=est.compute_s,
        exposed_comm_s=est.exposed_comm_s,
        bubble_s=est.bubble_s,
        optimizer_s=est.optimizer_s,
        memory_per_device_bytes=est.memory_per_rank_bytes,
        memory_parts_bytes=tuple(dict(st.memory_parts) for st in est.stages),
        capacity_bytes=est.capacity_bytes,
        tokens_per_s=est.tokens_per_s,
        mfu=est.mfu,
        stage_starts=est.stage_starts,
        stage_recompute=tuple(st.recompute for st in est.stages),
        feasible=est.feasible,
        precision=precision,
        num_blocks=num_blocks,
    )
