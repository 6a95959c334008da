"""CustomResourceDefinitions generated from the API models (api/).

Pydantic writes JSON Schema (draft 2020-12); Kubernetes wants a structural OpenAPI v3 schema:
no $ref, no anyOf for optional fields, int-or-string as an extension, boolean
exclusiveMinimum. `structural` converts one into the other. `reference_markdown` renders the
CRDs' schemas as the field reference docs/configuration.md.
"""

import json
from pathlib import Path

import yaml

from . import api

CRD_DIR = Path(__file__).resolve().parents[2] / "crds"
_DROP = {"title", "$defs"}


def structural(schema: dict, defs: dict) -> dict:
    if "$ref" in schema:
        return structural({**defs[schema["$ref"].rsplit("/", 1)[-1]], **{k: v for k, v in schema.items() if k != "$ref"}}, defs)
    options = schema.get("anyOf")
    if options:
        non_null = [o for o in options if o.get("type") != "null"]
        rest = {k: v for k, v in schema.items() if k != "anyOf"}
        if {o.get("type") for o in non_null} == {"integer", "string"}:
            return {**_clean(rest), "x-kubernetes-int-or-string": True}
        if len(non_null) != 1:
            raise ValueError(f"cannot express a union of {non_null} structurally")
        return structural({**non_null[0], **rest}, defs)
    out = {}
    for key, value in schema.items():
        if key in _DROP or (key == "default" and value is None):
            continue
        if key == "properties":
            out[key] = {name: structural(prop, defs) for name, prop in value.items()}
        elif key == "items" or (key == "additionalProperties" and isinstance(value, dict)):
            out[key] = structural(value, defs)
        elif key == "additionalProperties" and value is False:
            continue  # structural schemas prune unknown fields by default
        elif key in ("exclusiveMinimum", "exclusiveMaximum"):
            out["minimum" if key == "exclusiveMinimum" else "maximum"] = value
            out[key] = True
        elif key == "default" and isinstance(value, dict):
            out[key] = {}  # the API server then applies the nested fields' own defaults
        elif key == "const":
            out["enum"] = [value]
        else:
            out[key] = value
    return out


def _clean(schema: dict) -> dict:
    return {k: v for k, v in schema.items() if k not in _DROP and not (k == "default" and v is None)}


def model_schema(model: type[api.Model]) -> dict:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    return structural(raw, raw.get("$defs", {}))


def _crd(kind: str, plural: str, scope: str, short_names: list[str], spec, status, columns, scale: bool) -> dict:
    version = {
        "name": api.VERSION,
        "served": True,
        "storage": True,
        "schema": {
            "openAPIV3Schema": {
                "type": "object",
                "required": ["spec"],
                "properties": {
                    "apiVersion": {"type": "string"},
                    "kind": {"type": "string"},
                    "metadata": {"type": "object"},
                    "spec": model_schema(spec),
                    "status": model_schema(status),
                },
            }
        },
        "subresources": {"status": {}},
        "additionalPrinterColumns": columns,
    }
    if scale:
        version["subresources"]["scale"] = {
            "specReplicasPath": ".spec.replicas.desired",
            "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.selector",
        }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{api.GROUP}"},
        "spec": {
            "group": api.GROUP,
            "scope": scope,
            "names": {"kind": kind, "plural": plural, "singular": kind.lower(), "shortNames": short_names, "listKind": f"{kind}List"},
            "versions": [version],
        },
    }


def column(name: str, path: str, kind: str = "string", priority: int = 0) -> dict:
    entry = {"name": name, "type": kind, "jsonPath": path}
    if priority:
        entry["priority"] = priority
    return entry


def speculative_serving_crd() -> dict:
    columns = [
        column("Method", ".spec.speculator.method"),
        column("Phase", ".status.phase"),
        column("Canary", ".status.canary.weight", "integer"),
        column("Ready", ".status.stable.readyReplicas", "integer"),
        column("Acceptance", ".status.metrics.acceptanceLength", "number"),
        column("Tokens/$", ".status.metrics.tokensPerDollar", "number"),
        column("Age", ".metadata.creationTimestamp", "date"),
    ]
    return _crd(
        "SpeculativeServing", "speculativeservings", "Namespaced", ["specserving", "ssv"],
        api.SpeculativeServingSpec, api.SpeculativeServingStatus, columns, scale=True,
    )


def serving_profile_crd() -> dict:
    columns = [
        column("Tenant", ".spec.tenant"),
        column("Accelerator", ".spec.accelerator.resourceName"),
        column("Price/h", ".spec.accelerator.pricePerHourUSD", "number"),
        column("Max replicas", ".spec.limits.maxReplicas", "integer"),
        column("Age", ".metadata.creationTimestamp", "date"),
    ]
    return _crd(
        "ServingProfile", "servingprofiles", "Cluster", ["sprofile"],
        api.ServingProfileSpec, api.ServingProfileStatus, columns, scale=False,
    )


def all_crds() -> dict[str, dict]:
    return {
        "specserve.io_speculativeservings.yaml": speculative_serving_crd(),
        "specserve.io_servingprofiles.yaml": serving_profile_crd(),
    }


class _NoAliases(yaml.SafeDumper):
    def ignore_aliases(self, data):
        return True


def render_yaml(crd: dict) -> str:
    header = "# Generated from operator/specserve_operator/api/ by `specserve crds`; do not edit.\n"
    return header + yaml.dump(crd, Dumper=_NoAliases, sort_keys=False)


def write_crds(directory: Path = CRD_DIR) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, crd in all_crds().items():
        path = directory / name
        path.write_text(render_yaml(crd))
        paths.append(path)
    return paths


# ----- docs/configuration.md: the field reference, rendered from the CRDs above ------------------

REFERENCE_COMMAND = "specserve crds --reference docs/configuration.md"
_REFERENCE_COLUMNS = "| field | type | default | constraints | description |\n| --- | --- | --- | --- | --- |"


def reference_markdown() -> str:
    """docs/configuration.md: every field of both kinds, from the generated CRDs' openAPIV3Schema.

    Rendered from the CRDs rather than from api/ so that it states exactly what the API server
    enforces (defaults, bounds, patterns, CEL rules); a test keeps the committed file equal to it.
    """
    parts = [
        "# Configuration reference",
        (f"Generated from the CRD schemas (`operator/specserve_operator/api/`) by `{REFERENCE_COMMAND}`;"
         " do not edit by hand. What the fields do: [how-it-works.md](how-it-works.md) and"
         " [operations.md](operations.md)."),
        ("A type `[]T` is a list, `map[string]T` an object with free keys. A default of `{}` on an object means"
         " the API server fills in its fields' own defaults. Constraints are enforced at admission; so are the"
         " validation rules (CEL) listed under a table."),
    ]
    for crd in all_crds().values():
        parts.append(_kind_reference(crd))
    return "\n\n".join(parts) + "\n"


def _kind_reference(crd: dict) -> str:
    names, version = crd["spec"]["names"], crd["spec"]["versions"][0]
    columns = ", ".join(f"{c['name']} (`{c['jsonPath']}`)" for c in version["additionalPrinterColumns"])
    intro = (f"`{crd['spec']['group']}/{version['name']}`, scope {crd['spec']['scope']}, short names "
             + ", ".join(f"`{n}`" for n in names["shortNames"]) + f". `kubectl get` columns: {columns}.")
    scale = version["subresources"].get("scale")
    if scale:
        intro += (f" The /scale subresource (`kubectl scale`, an HPA, KEDA) sets `{scale['specReplicasPath']}` and reads"
                  f" `{scale['statusReplicasPath']}` and the label selector `{scale['labelSelectorPath']}`.")
    schema = version["schema"]["openAPIV3Schema"]
    tables = [_object_tables(top, schema["properties"][top]) for top in ("spec", "status")]
    return "\n\n".join([f"## {names['kind']}", intro, *tables])


def _object_tables(path: str, schema: dict) -> str:
    """The table of the object at `path` (one row per field), then those of its object fields, depth first."""
    required = set(schema.get("required") or [])
    rows, nested = [], []
    for name, field in schema["properties"].items():
        field_path = f"{path}.{name}"
        rows.append("| " + " | ".join([f"`{field_path}`", _type(field), _default(field),
                                        _constraints(field, name in required), _cell(field.get("description", ""))]) + " |")
        if "properties" in field:
            nested.append(_object_tables(field_path, field))
        elif "properties" in field.get("items", {}):
            nested.append(_object_tables(field_path + "[]", field["items"]))
    table = f"### {path}\n\n{_REFERENCE_COLUMNS}\n" + "\n".join(rows)
    rules = schema.get("x-kubernetes-validations") or []
    if rules:
        table += "\n\nValidation rules (CEL):\n" + "\n".join(
            f"- `{r['rule']}`: {r['message']}" + (f" (reported at `{path}{r['fieldPath']}`)" if "fieldPath" in r else "")
            for r in rules
        )
    return "\n\n".join([table, *nested])


def _type(schema: dict) -> str:
    if schema.get("x-kubernetes-int-or-string"):
        return "int-or-string"
    if schema.get("type") == "array":
        return "[]" + _type(schema["items"])
    if isinstance(schema.get("additionalProperties"), dict):
        return "map[string]" + _type(schema["additionalProperties"])
    return schema["type"]


def _default(schema: dict) -> str:
    return _cell(f"`{json.dumps(schema['default'])}`") if "default" in schema else ""


def _constraints(schema: dict, required: bool) -> str:
    return _cell(", ".join(_constraint_parts(schema, required)))


def _constraint_parts(schema: dict, required: bool) -> list[str]:
    parts = ["required"] if required else []
    if "enum" in schema:
        parts.append("one of " + ", ".join(f"`{value}`" for value in schema["enum"]))
    if "minimum" in schema:
        parts.append(f"{'>' if schema.get('exclusiveMinimum') else '>='} {schema['minimum']}")
    if "maximum" in schema:
        parts.append(f"{'<' if schema.get('exclusiveMaximum') else '<='} {schema['maximum']}")
    for key, text in (("minLength", "length >="), ("maxLength", "length <="), ("minItems", "items >="), ("maxItems", "items <=")):
        if key in schema:
            parts.append(f"{text} {schema[key]}")
    if "pattern" in schema:
        parts.append(f"pattern `{schema['pattern']}`")
    items = _constraint_parts(schema["items"], False) if schema.get("type") == "array" else []
    if items:
        parts.append("each item: " + ", ".join(items))
    return parts


def _cell(text: str) -> str:
    """Table cell text: a pipe would end the cell, even inside backticks (GitHub's tables)."""
    return text.replace("|", "\\|").replace("\n", " ")
