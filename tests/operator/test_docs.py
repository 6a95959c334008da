"""The operations docs stay true: the configuration reference is generated from the CRDs, every
Event reason and condition type the operator's code emits is explained in docs/operations.md."""

import ast
from pathlib import Path

from specserve_operator.crd import REFERENCE_COMMAND, all_crds, reference_markdown

REFERENCE = Path("docs/configuration.md")
OPERATIONS = Path("docs/operations.md")
OPERATOR_SOURCE = Path("operator/specserve_operator")


def test_configuration_reference_is_generated_from_the_crds():
    assert REFERENCE.read_text() == reference_markdown(), f"docs/configuration.md is stale: run `{REFERENCE_COMMAND}`"


def field_paths(schema: dict, path: str):
    """Every field under `schema`, named as the reference names it (`[]` for a list's items)."""
    for name, field in (schema.get("properties") or {}).items():
        yield f"{path}.{name}"
        yield from field_paths(field, f"{path}.{name}")
        if "items" in field:
            yield from field_paths(field["items"], f"{path}.{name}[]")


def test_every_field_of_the_schemas_is_in_the_reference():
    # Walks the schema independently of reference_markdown, so a field the renderer skipped fails
    # here as well as one added to api/ without regenerating the file.
    reference = REFERENCE.read_text()
    for crd in all_crds().values():
        schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        paths = [path for top in ("spec", "status") for path in field_paths(schema["properties"][top], top)]
        missing = [path for path in paths if f"`{path}`" not in reference]
        assert not missing, f"not in docs/configuration.md: {missing}; run `{REFERENCE_COMMAND}`"
    assert "`spec.rollout.steps[].weight`" in reference and "`spec.accelerator.tolerations[].effect`" in reference


def _strings(node: ast.AST | None) -> set[str]:
    """String constants of an expression: "X", or both branches of `"X" if c else "Y"`."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, ast.IfExp):
        return _strings(node.body) | _strings(node.orelse)
    return set()


def _dict_keys(node: ast.AST) -> set[str]:
    return set().union(*(_strings(key) for key in node.keys)) if isinstance(node, ast.Dict) else set()


def emitted_by_the_operator() -> tuple[set[str], set[str]]:
    """(Event reasons, condition types) as the operator's source writes them:
    Event("Normal" | "Warning", REASON, ...) (rollout.py, reconcile.py), kopf.info / warn / event /
    exception(..., reason=REASON) (main.py), set_condition(conditions, TYPE, ...), and the keys of
    `conditions` dicts ({TYPE: (status, reason, message)}: the rollout and autoscaling decisions)."""
    reasons, types = set(), set()
    for module in sorted(OPERATOR_SOURCE.glob("*.py")):
        for node in ast.walk(ast.parse(module.read_text())):
            if isinstance(node, ast.Call):
                called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                if called == "Event" and len(node.args) >= 2:
                    reasons |= _strings(node.args[1])
                elif called in ("info", "warn", "event", "exception"):
                    reasons |= set().union(*(_strings(k.value) for k in node.keywords if k.arg == "reason"))
                elif called == "set_condition" and len(node.args) >= 2:
                    types |= _strings(node.args[1])
                types |= set().union(*(_dict_keys(k.value) for k in node.keywords if k.arg == "conditions"))
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name) and target.id == "conditions":
                        types |= _dict_keys(node.value)
                    elif isinstance(target, ast.Subscript) and getattr(target.value, "attr", None) == "conditions":
                        types |= _strings(target.slice)
    return reasons, types


def test_every_event_reason_and_condition_type_is_documented():
    reasons, types = emitted_by_the_operator()
    # The collector itself must work: a pattern it stopped recognising would pass vacuously.
    assert {"InvalidSpec", "Reconciled", "RolloutAborted", "Scaled", "MeasurementFailed"} <= reasons
    assert {"SpecValid", "Ready", "BudgetLimited", "ScalingActive", "MetricsAvailable", "AnalysisInconclusive"} <= types
    operations = OPERATIONS.read_text()
    undocumented = sorted(name for name in reasons | types if f"`{name}`" not in operations)
    assert not undocumented, f"emitted by the operator but not explained in docs/operations.md: {undocumented}"
