"""The build functions the CLI tests name by path: ``autoplan plan tests/cli_models.py:mlp ...``.

Plan files record this path (``"workload": ".../tests/cli_models.py:mlp"``, the golden snapshot
``tests/golden/show_mlp.txt`` among them), so the file stays; the workloads are
``tests/zoo.py``'s. The CLI loads a target file with only its own folder on ``sys.path``: the
repository root goes there first, so ``tests.zoo`` imports in a CLI run from any directory.
"""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from tests.zoo import cli_mlp as mlp  # noqa: E402
from tests.zoo import cli_mlp_dataset as mlp_dataset  # noqa: E402
from tests.zoo import cli_mlp_nonfinite as mlp_nonfinite  # noqa: E402
from tests.zoo import cli_mlp_stream as mlp_stream  # noqa: E402
from tests.zoo import cli_mlp_wide as mlp_wide  # noqa: E402
from tests.zoo import data_dependent, gpt2_4_layers, huge  # noqa: E402

__all__ = ["data_dependent", "gpt2_4_layers", "huge", "mlp", "mlp_dataset", "mlp_nonfinite", "mlp_stream", "mlp_wide"]
