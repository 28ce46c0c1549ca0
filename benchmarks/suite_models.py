"""Build functions for the plan benchmark suite (``benchmarks/suite.yaml``, ``autoplan bench``).

    autoplan bench benchmarks/suite.yaml --baseline benchmarks/suite_baseline.json

``suite.yaml`` and the plan files name this path (``suite_models.py:mlp_small``), so the file
stays; the workloads are ``tests/zoo.py``'s (the one model zoo). Each returns an
``autoplan.Workload`` and is built on the ``meta`` device (nothing is allocated), so the shapes
cost planning time only, not memory. The GPT-2 model is written out in the zoo (nanoGPT layout:
``transformer.h.<i>`` blocks, tied ``lm_head``) so the suite needs no Hugging Face download or
import. The CLI loads this file with only ``benchmarks/`` on ``sys.path``: the repository root
goes there first, as in every benchmark.
"""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from tests.zoo import gpt2_small_4_layers  # noqa: E402
from tests.zoo import suite_mlp_small as mlp_small  # noqa: E402
from tests.zoo import suite_mlp_wide as mlp_wide  # noqa: E402

__all__ = ["gpt2_small_4_layers", "mlp_small", "mlp_wide"]
