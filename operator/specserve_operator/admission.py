"""A ServingProfile's limits, enforced at admission: a ValidatingAdmissionPolicy whose params are the profiles.

The operator checks a serving against its profile at every reconcile (validate.check_against_profile): a serving
over its limits goes Invalid and nothing that serves is touched. The policy refuses the same specs before they are
stored, so `kubectl apply` fails naming the field and the profile, and a tenant never finds out from a status.
It needs Kubernetes 1.30 (admissionregistration.k8s.io/v1), as the chart does; the chart installs it unless
admissionPolicy.enabled is false.

How it reads the profile. The binding selects every ServingProfile, and the API server evaluates the policy once
per profile it selects: each expression holds trivially unless the profile is the one the serving names
(variables.profiled). A serving naming no existing profile is admitted, and the operator reports it (SpecValid).

What it leaves alone. Only a CREATE, or an UPDATE that changes the spec, is checked: a profile made stricter must
not stop the operator (or kopf) from updating the metadata of a serving it already runs, nor its deletion from
removing the finalizer; such a serving goes Invalid at its next reconcile. Status writes go to the status
subresource, which the policy does not match.

The rules are those of check_against_profile, field by field; tests/operator/test_admission.py evaluates both on
the same specs and checks that they refuse the same fields.
"""

import json
import re

from specserve_runtime.config import REMOTE_CODE_FLAG

from . import api

NAME = "specserve-profile-limits"

# The three speculators a serving names: (field path, CEL guard that it is set or None, CEL expression of it).
SPECULATORS = [
    ("spec.speculator", None, "object.spec.speculator"),
    ("spec.rollout.candidate.speculator", "has(object.spec.rollout)", "object.spec.rollout.candidate.speculator"),
    ("spec.speculationHealth.fallback.speculator",
     "has(object.spec.speculationHealth) && has(object.spec.speculationHealth.fallback)",
     "object.spec.speculationHealth.fallback.speculator"),
]
# The two runtimes: the stable revision's and a canary's override.
RUNTIMES = [
    ("spec.runtime", "has(object.spec.runtime)", "object.spec.runtime"),
    ("spec.rollout.candidate.runtime", "has(object.spec.rollout) && has(object.spec.rollout.candidate.runtime)",
     "object.spec.rollout.candidate.runtime"),
]
LABELS = "namespaceObject.metadata.labels"


def _quote(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _or_default(path: str, field: str, default) -> str:
    """`path.field`, or the model's default where the stored object has none (JSON literals are CEL literals)."""
    return f"(has({path}.{field}) ? {path}.{field} : {json.dumps(default)})"


def flag_pattern(flag: str) -> str:
    """An RE2 pattern for every spelling vLLM's parser reads as `flag` (config.flags_set): any prefix of it past
    the dashes, '_' for '-', and a value after '=' or a JSON key after '.'."""
    name = flag[2:]
    pattern = ""
    for char in reversed(name[1:]):
        char = "[-_]" if char == "-" else re.escape(char)
        pattern = f"({char}{pattern})?"
    return f"^--{re.escape(name[0])}{pattern}([=.].*)?$"


def _label_present(key: str) -> str:
    return f"(has({LABELS}) && {key} in {LABELS})"


def _selected() -> str:
    """The namespace against the profile's namespaceSelector, as validate.selects reads a LabelSelector."""
    selector = "params.spec.namespaceSelector"
    match_labels = (f"(!has({selector}.matchLabels) || {selector}.matchLabels.all(k, {_label_present('k')} && "
                    f"{LABELS}[k] == {selector}.matchLabels[k]))")
    in_values = f"({_label_present('r.key')} && has(r.values) && {LABELS}[r.key] in r.values)"
    match_expressions = (
        f"(!has({selector}.matchExpressions) || {selector}.matchExpressions.all(r, "
        f"r.operator == 'In' ? {in_values} : r.operator == 'NotIn' ? !{in_values} : "
        f"r.operator == 'Exists' ? {_label_present('r.key')} : !{_label_present('r.key')}))")
    return f"{match_labels} && {match_expressions}"


# The serving's profile in a message: ServingProfile 'NAME'.
PROFILE = "'ServingProfile \\'' + params.metadata.name + '\\''"


def _where(present: str | None, expression: str) -> str:
    """`expression` where the field it reads is set (`present`: a CEL guard, None when it always is)."""
    return expression if present is None else f"!({present}) || {expression}"


def _rule(expression: str, message: str) -> dict:
    """A validation that holds for every profile but the serving's own; `message` a CEL string expression."""
    return {"expression": f"!variables.profiled || ({expression})", "messageExpression": message, "reason": "Invalid"}


def validations() -> list[dict]:
    rules = [_rule("variables.selected", f"'spec.profile: ' + {PROFILE} + ' does not select namespace \\'' + "
                                         "namespaceObject.metadata.name + '\\''")]
    for path, present, speculator in SPECULATORS:
        rules.append(_rule(_where(present, f"{speculator}.method in variables.allowedMethods"),
                           f"'{path}.method: method ' + {speculator}.method + ' is not allowed by ' + {PROFILE} + "
                           "' (limits.allowedMethods)'"))
    limit = "params.spec.limits.maxNumSpeculativeTokens"
    for path, present, speculator in SPECULATORS:  # where the profile sets a limit, and the speculator drafts
        drafting = f"has({limit}) && " + ("" if present is None else f"{present} && ") + f"{speculator}.method != 'none'"
        tokens, schedule = f"{speculator}.numSpeculativeTokens", f"{speculator}.numSpeculativeTokensPerBatchSize"
        rules.append(_rule(f"!({drafting}) || has({tokens})",
                           f"'{path}.numSpeculativeTokens: required, ' + {PROFILE} + ' limits drafts a step to ' + "
                           f"string({limit}) + ' (limits.maxNumSpeculativeTokens)'"))
        rules.append(_rule(f"!({drafting}) || !has({tokens}) || {tokens} <= {limit}",
                           f"'{path}.numSpeculativeTokens: ' + string({tokens}) + ' exceeds ' + {PROFILE} + "
                           f"' limits.maxNumSpeculativeTokens (' + string({limit}) + ')'"))
        rules.append(_rule(f"!({drafting}) || !has({schedule}) || {schedule}.all(e, e.numSpeculativeTokens <= {limit})",
                           f"'{path}.numSpeculativeTokensPerBatchSize: a range drafts more than ' + {PROFILE} + "
                           f"' limits.maxNumSpeculativeTokens (' + string({limit}) + ')'"))
    for path, present, runtime in RUNTIMES:
        image = f"{runtime}.image"
        allowed = (f"{image} in {json.dumps(list(api.RUNTIME_IMAGES.values()))} || variables.allowedImages.exists(e, "
                   f"e.endsWith('/') ? {image}.startsWith(e) : {image} == e)")
        rules.append(_rule(_where(present, f"!has({image}) || {allowed}"),
                           f"'{path}.image: image \\'' + {image} + '\\' is not allowed by ' + {PROFILE} + "
                           "' (limits.allowedImages)'"))
    for path, present, runtime in RUNTIMES:
        args = f"{runtime}.args"
        no_remote_code = f"{args}.all(a, !a.matches({_quote(flag_pattern(REMOTE_CODE_FLAG))}))"
        rules.append(_rule("variables.allowTrustRemoteCode || " + _where(present, f"!has({args}) || {no_remote_code}"),
                           f"'{path}.args: {REMOTE_CODE_FLAG} runs the Python that the model\\'s repository ships, "
                           f"which ' + {PROFILE} + ' does not allow (limits.allowTrustRemoteCode)'"))
    rules.append(_rule("variables.replicasMax <= variables.maxReplicas",
                       f"'spec.replicas.max: ' + string(variables.replicasMax) + ' exceeds ' + {PROFILE} + "
                       "' limits.maxReplicas (' + string(variables.maxReplicas) + ')'"))
    budget = "double(params.spec.limits.maxHourlyCostUSD)"
    rules.append(_rule(f"!has(params.spec.limits.maxHourlyCostUSD) || variables.minimumHourlyUSD <= {budget}",
                       "'spec.replicas.min: ' + string(variables.replicasMin) + ' replicas cost $' + "
                       f"string(variables.minimumHourlyUSD) + '/h, above ' + {PROFILE} + "
                       f"' limits.maxHourlyCostUSD ($' + string({budget}) + '/h)'"))
    return rules


def variables() -> list[dict]:
    limits = api.ProfileLimits.model_fields
    replicas = api.Replicas.model_fields
    accelerator = api.Accelerator.model_fields
    return [{"name": name, "expression": expression} for name, expression in [
        ("profiled", "params.metadata.name == object.spec.profile"),
        ("selected", _selected()),
        ("allowedMethods", _or_default("params.spec.limits", "allowedMethods", list(api.ALL_METHODS))),
        ("allowedImages", _or_default("params.spec.limits", "allowedImages", limits["allowed_images"].default)),
        ("allowTrustRemoteCode", _or_default("params.spec.limits", "allowTrustRemoteCode",
                                             limits["allow_trust_remote_code"].default)),
        ("maxReplicas", _or_default("params.spec.limits", "maxReplicas", limits["max_replicas"].default)),
        ("replicasMin", f"has(object.spec.replicas) ? {_or_default('object.spec.replicas', 'min', replicas['min'].default)}"
                        f" : {replicas['min'].default}"),
        ("replicasMax", f"has(object.spec.replicas) ? {_or_default('object.spec.replicas', 'max', replicas['max'].default)}"
                        f" : {replicas['max'].default}"),
        ("minimumHourlyUSD", f"double(variables.replicasMin) * "
                             f"double({_or_default('params.spec.accelerator', 'count', accelerator['count'].default)})"
                             " * double(params.spec.accelerator.pricePerHourUSD)"),
    ]]


def policy() -> list[dict]:
    """The ValidatingAdmissionPolicy and its binding, as the chart installs them."""
    return [
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicy",
            "metadata": {"name": NAME},
            "spec": {
                "failurePolicy": "Fail",
                "paramKind": {"apiVersion": api.API_VERSION, "kind": "ServingProfile"},
                "matchConstraints": {"resourceRules": [{
                    "apiGroups": [api.GROUP], "apiVersions": [api.VERSION], "operations": ["CREATE", "UPDATE"],
                    "resources": ["speculativeservings"]}]},
                "matchConditions": [{"name": "spec-written",
                                     "expression": "request.operation == 'CREATE' || object.spec != oldObject.spec"}],
                "variables": variables(),
                "validations": validations(),
            },
        },
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicyBinding",
            "metadata": {"name": NAME},
            "spec": {
                "policyName": NAME,
                "validationActions": ["Deny"],
                # Every profile: the policy's expressions pick the serving's own.
                "paramRef": {"selector": {}, "parameterNotFoundAction": "Allow"},
            },
        },
    ]
