"""The graph passes of autoplan, listed once, in the order the planner runs them: :data:`PASS_ORDER`.

    nn.Module --depth--> fewer repeated blocks --trace--> TracedProgram
        (--rebatch--> the same step at another batch size, without another export)
      --layers--> Layering --strategies--> StrategyTable --costing--> CostProblem
      --expand--> CostProblem standing for every block
      == the planner's ILP picks one strategy per node (autoplan.planner.solver) ==
      --redistribute--> the conversions it implies --comm_order--> CommSchedule --overlap--> StepSchedule --liveness--> MemoryEstimate --explain--> runner-up per node
      == the runtime generates each rank's program (autoplan.runtime.codegen; pipeline stages:
         autoplan.passes.stages) ==

Each entry is a :class:`GraphPass`: a name, the function, and its contract in one line. The planner
(:mod:`autoplan.planner`) runs every pass by calling its entry here (``pass_order.TRACE(...)``),
never the function directly, so this list is what runs; ``tests/test_pass_order.py`` checks that
the planner calls no pass function past this list and that a plan runs the passes in this order.
Not every plan runs every pass: depth, rebatch and expand only where repeated blocks are
reduced or batch sizes derived (:mod:`autoplan.planner.segment_model`), and a plan without a
global batch starts at trace.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from autoplan.passes.comm_order import schedule_collectives
from autoplan.passes.costing import build_cost_problem
from autoplan.passes.depth import reduce_depth
from autoplan.passes.expand import scale_problem
from autoplan.passes.explain import explain_choices
from autoplan.passes.layers import find_layers
from autoplan.passes.liveness import peak_memory
from autoplan.passes.overlap import schedule_step
from autoplan.passes.rebatch import rebatch
from autoplan.passes.redistribute import edge_redistributions
from autoplan.passes.strategies import build_strategy_table
from autoplan.passes.trace import trace_training_step


@dataclass(frozen=True, slots=True)
class GraphPass:
    """One pass of :data:`PASS_ORDER`; calling it runs :attr:`run` with the same arguments."""

    name: str
    run: Callable[..., Any]
    contract: str
    """What the pass takes -> what it gives, in one line."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.run(*args, **kwargs)

    def __str__(self) -> str:
        return f"{self.name}: {self.contract}"


DEPTH = GraphPass(
    "depth", reduce_depth, "nn.Module -> ReducedDepth: the model with only its first KEPT_BLOCKS repeated blocks"
)
TRACE = GraphPass(
    "trace", trace_training_step, "nn.Module + example batch -> TracedProgram: the step's forward+backward FX graph"
)
REBATCH = GraphPass(
    "rebatch", rebatch, "TracedPrograms at two batch sizes -> TracedProgram at a third (same graph), or None"
)
LAYERS = GraphPass("layers", find_layers, "TracedProgram -> Layering: prologue, repeated blocks, epilogue")
STRATEGIES = GraphPass(
    "strategies", build_strategy_table, "TracedProgram + DeviceMesh -> StrategyTable: the placements each node can run"
)
COSTING = GraphPass(
    "costing",
    build_cost_problem,
    "TracedProgram + StrategyTable + Cluster -> CostProblem: time and bytes of every strategy and conversion",
)
EXPAND = GraphPass(
    "expand",
    scale_problem,
    "CostProblem of the traced blocks + multiplicities -> CostProblem standing for every block",
)
REDISTRIBUTE = GraphPass(
    "redistribute",
    edge_redistributions,
    "TracedProgram + chosen strategies -> Redistributions: every conversion the program performs",
)
COMM_ORDER = GraphPass(
    "comm_order",
    schedule_collectives,
    "graph + redistributions + Layering -> CommSchedule: where the program issues and waits for each collective",
)
OVERLAP = GraphPass(
    "overlap",
    schedule_step,
    "graph + node times + redistributions + CommSchedule -> StepSchedule: step time, exposed communication",
)
LIVENESS = GraphPass(
    "liveness", peak_memory, "graph + Liveness + assignment + redistributions -> MemoryEstimate: peak bytes per device"
)
EXPLAIN = GraphPass(
    "explain", explain_choices, "CostProblem + chosen strategies -> NodeExplanation per node: runner-up, why it lost"
)

PASS_ORDER: tuple[GraphPass, ...] = (
    DEPTH,
    TRACE,
    REBATCH,
    LAYERS,
    STRATEGIES,
    COSTING,
    EXPAND,
    # the ILP (autoplan.planner.solver) chooses here
    REDISTRIBUTE,
    COMM_ORDER,
    OVERLAP,
    LIVENESS,
    EXPLAIN,
)
"""The graph passes in the order the planner runs them (see the module docstring)."""
