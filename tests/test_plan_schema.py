"""The plan file's JSON Schema (docs/plan.schema.json) accepts the plans autoplan writes (ILP
plans, global-batch pipeline plans on reduced depth) and rejects malformed ones."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema
import pytest

from tests import zoo

SCHEMA = json.loads((Path(__file__).parent.parent / "docs" / "plan.schema.json").read_text())


@pytest.fixture(scope="module")
def plans() -> dict[str, dict]:
    made = zoo.ilp_and_pipeline_plans()
    return {"ilp": made["ilp"].to_dict(timings=True), "pipeline": made["pipeline"].to_dict()}


def test_schema_is_valid_json_schema():
    jsonschema.Draft202012Validator.check_schema(SCHEMA)


@pytest.mark.parametrize("kind", ["ilp", "pipeline"])
def test_written_plans_validate(plans, kind):  # noqa: ANN001
    jsonschema.validate(plans[kind], SCHEMA)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d.pop("fingerprint"),
        lambda d: d.__setitem__("version", 1),
        lambda d: d["placements"]["inputs"].__setitem__(0, ["Q"]),
        lambda d: d["estimate"].pop("step_time_s"),
        lambda d: d["config"].__setitem__("schedule", "zigzag"),
        lambda d: d["pipeline"].__setitem__("precision", "fp8"),
        lambda d: d.__setitem__("unknown_key", 1),
    ],
    ids=["no-fingerprint", "version-1", "bad-placement", "no-step-time", "bad-schedule", "bad-precision", "extra-key"],
)
def test_malformed_plans_are_rejected(plans, mutate):  # noqa: ANN001
    d = copy.deepcopy(plans["pipeline"])
    mutate(d)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(d, SCHEMA)
