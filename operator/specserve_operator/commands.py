"""`specserve render`, `specserve operator`, `specserve crds`, `specserve rbac`, `specserve admission-policy`: the
commands of the operator itself. The local tools (canary, demo, simulate, bench-operator) are in `local/`."""

import sys
from pathlib import Path

import yaml
from specserve_runtime.config import read_yaml

from . import api
from .render import Settings, render_all
from .replicas import Traffic
from .validate import InputProblems, check_against_profile, parse_profile, parse_serving


class RenderError(InputProblems):
    """Invalid input to `specserve render`."""


def _load_documents(path: Path) -> list[dict]:
    try:
        documents = [d for d in read_yaml(path, all_documents=True) if d is not None]
    except ValueError as exc:
        raise RenderError([str(exc)]) from exc
    bad = [i for i, d in enumerate(documents) if not isinstance(d, dict) or "kind" not in d]
    if bad:
        raise RenderError([f"{path}: document {i} is not a Kubernetes object (no kind)" for i in bad])
    return documents


def _cluster_lookup():
    """A lookup of profiles and namespaces in the cluster, or None when no cluster is configured."""
    try:
        from .apply import Cluster

        return Cluster()
    except Exception:  # no kubeconfig and not in a pod: render from the file alone
        return None


def render_file(path: Path, settings: Settings = Settings(), cluster="auto") -> list[dict]:
    documents = _load_documents(path)
    profiles, invalid_profiles, namespaces, servings, problems = {}, set(), {}, [], []
    for doc in documents:
        kind, name = doc.get("kind"), (doc.get("metadata") or {}).get("name")
        if kind == "ServingProfile":
            profile, errors = parse_profile(doc)
            problems += [f"{path}: ServingProfile {name}: {e}" for e in errors]
            if profile:
                profiles[profile.name] = profile
            else:
                invalid_profiles.add(name)
        elif kind == "Namespace":
            namespaces[name] = (doc.get("metadata") or {}).get("labels") or {}
        elif kind == "SpeculativeServing":
            servings.append(doc)
        else:
            problems.append(f"{path}: {kind} {name}: not a kind specserve renders (SpeculativeServing, ServingProfile, Namespace)")
    if cluster == "auto":
        cluster = _cluster_lookup() if servings else None
    objects = []
    for doc in servings:
        serving, errors = parse_serving(doc)
        label = f"{path}: SpeculativeServing {(doc.get('metadata') or {}).get('namespace', 'default')}/{(doc.get('metadata') or {}).get('name')}"
        if serving is None:
            problems += [f"{label}: {e}" for e in errors]
            continue
        if serving.spec.profile in invalid_profiles:  # the file's own, not one of the same name in the cluster
            problems.append(f"{label}: spec.profile: ServingProfile {serving.spec.profile!r} is invalid (above)")
            continue
        profile, labels = profiles.get(serving.spec.profile), namespaces.get(serving.namespace)
        try:
            if profile is None and cluster is not None:
                found = cluster.get(api.API_VERSION, "ServingProfile", None, serving.spec.profile)
                profile = parse_profile(found)[0] if found else None
            if labels is None and cluster is not None:
                found = cluster.get("v1", "Namespace", None, serving.namespace)
                labels = None if found is None else (found["metadata"].get("labels") or {})
        except Exception as exc:  # unreachable or forbidden: say so instead of a traceback
            problems.append(f"{label}: cannot look up its ServingProfile / Namespace in the cluster ({exc.__class__.__name__}); add them to the file")
            continue
        if labels is None and cluster is None:
            problems.append(f"{label}: metadata.namespace: Namespace {serving.namespace!r} is not in the file and no cluster is configured; add it with its labels")
            continue
        errors = check_against_profile(serving, profile, labels)
        if errors:
            problems += [f"{label}: {e}" for e in errors]
            continue
        # A rollout renders as at its first step, as the operator starts it.
        traffic = Traffic("Canary", serving.spec.rollout.steps[0].weight) if serving.spec.rollout else Traffic()
        objects += render_all(serving, profile, settings, traffic)
    if problems:
        raise RenderError(problems)
    return objects


def cmd_render(args) -> int:
    try:
        objects = render_file(Path(args.file))
    except RenderError as exc:
        return exc.report()
    sys.stdout.write(yaml.safe_dump_all(objects, sort_keys=False))
    return 0


def cmd_crds(args) -> int:
    from .crd import reference_markdown, render_yaml, serving_profile_crd, speculative_serving_crd, write_crds

    if args.reference:
        Path(args.reference).write_text(reference_markdown())
        print(args.reference, file=sys.stderr)
    if args.out:
        for path in write_crds(Path(args.out)):
            print(path, file=sys.stderr)
    elif not args.reference:
        sys.stdout.write("---\n".join(render_yaml(c) for c in (serving_profile_crd(), speculative_serving_crd())))
    return 0


def cmd_rbac(args) -> int:
    from .apply import cluster_roles

    sys.stdout.write(yaml.safe_dump_all(cluster_roles(), sort_keys=False))
    return 0


def cmd_admission_policy(args) -> int:
    from .admission import policy

    sys.stdout.write(yaml.safe_dump_all(policy(), sort_keys=False))
    return 0


def cmd_operator(args) -> int:
    import kopf
    from prometheus_client import start_http_server

    from .validate import InputProblems

    if not args.all_namespaces and not args.namespace:
        print("specserve operator: pass --namespace NS (repeatable) or --all-namespaces", file=sys.stderr)
        return 2
    try:
        from . import main  # registers the handlers; reads the tick settings

        main.settings_from_env()  # every setting checked before kopf starts, not in its startup handler
    except InputProblems as exc:
        return exc.report()
    start_http_server(args.metrics_port)
    kopf.run(
        standalone=True,
        clusterwide=args.all_namespaces,
        namespaces=args.namespace or [],
        liveness_endpoint=f"http://0.0.0.0:{args.health_port}/healthz",
    )
    return 0


def add_commands(commands) -> None:
    render = commands.add_parser("render", help="print every object the operator would create for a file")
    render.add_argument("-f", "--file", required=True, help="YAML with SpeculativeServings (and ServingProfiles, Namespaces)")
    render.set_defaults(run=cmd_render)

    operator = commands.add_parser("operator", help="run the operator (kopf)")
    scope = operator.add_mutually_exclusive_group()
    scope.add_argument("--namespace", action="append", help="watch this namespace (repeatable)")
    scope.add_argument("--all-namespaces", action="store_true")
    operator.add_argument("--health-port", type=int, default=8080, help="liveness endpoint /healthz")
    operator.add_argument("--metrics-port", type=int, default=9090, help="the operator's own Prometheus metrics")
    operator.set_defaults(run=cmd_operator)

    crds = commands.add_parser("crds", help="print (or write with --out DIR) the CRDs generated from the API models")
    crds.add_argument("--out")
    crds.add_argument("--reference", metavar="FILE", help="write the field reference (Markdown) rendered from the CRDs")
    crds.set_defaults(run=cmd_crds)

    rbac = commands.add_parser("rbac", help="print the operator's least-privilege ClusterRole")
    rbac.set_defaults(run=cmd_rbac)

    admission = commands.add_parser("admission-policy", help="print the ValidatingAdmissionPolicy that enforces "
                                    "the ServingProfiles' limits at admission, and its binding")
    admission.set_defaults(run=cmd_admission_policy)
