"""The kopf handlers: the only module with kopf decorators. Each one delegates to reconcile.py."""

import asyncio
import collections
import os
import threading

import kopf
from kubernetes.client.rest import ApiException
from prometheus_client import Counter

from . import api
from .apply import Cluster
from .reconcile import cleanup, reconcile
from .render import Settings

SERVINGS = (api.GROUP, api.VERSION, "speculativeservings")
PROFILES = (api.GROUP, api.VERSION, "servingprofiles")
RESYNC_SECONDS = float(os.environ.get("SPECSERVE_RESYNC_SECONDS", "30"))

# kopf runs a resource's timer concurrently with its event handlers: one reconcile at a time per object.
_LOCKS: dict[tuple, threading.Lock] = collections.defaultdict(threading.Lock)

RECONCILES = Counter("specserve_operator_reconciles", "Reconciliations of SpeculativeServings", ["result"])


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_):
    settings.persistence.finalizer = "specserve.io/cleanup"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="specserve.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="specserve.io", key="last-handled-configuration"
    )
    settings.posting.level = 20  # INFO and above become Kubernetes Events
    settings.watching.server_timeout = 300
    memo.cluster = memo.get("cluster") or Cluster()
    memo.settings = Settings(
        monitoring_namespace=os.environ.get("SPECSERVE_MONITORING_NAMESPACE", "monitoring"),
        operator_namespace=os.environ.get("SPECSERVE_OPERATOR_NAMESPACE", "specserve-system"),
    )


async def _reconcile_and_report(body, memo: kopf.Memo, logger) -> dict:
    """Handlers are async so that kopf can cancel them on shutdown; the blocking client runs in a thread."""
    return await asyncio.to_thread(_reconcile_blocking, body, memo, logger)


def _lock_key(meta) -> tuple:
    return meta.get("namespace"), meta.get("name"), meta.get("uid")


def _reconcile_blocking(body, memo: kopf.Memo, logger) -> dict:
    meta = body.get("metadata") or {}
    with _LOCKS[_lock_key(meta)]:
        # A resync that waited for the lock while the delete handler cleaned up must not recreate
        # children. kopf's body is a live view, so the deletion is visible here by then.
        if (body.get("metadata") or {}).get("deletionTimestamp"):
            return {}
        outcome = reconcile(memo.cluster, dict(body), memo.settings)
    if outcome.problems:
        RECONCILES.labels("invalid").inc()
        kopf.warn(body, reason="InvalidSpec", message="; ".join(outcome.problems))
        logger.warning("invalid: %s", "; ".join(outcome.problems))
    else:
        RECONCILES.labels("applied").inc()
        changed = {k: v for k, v in outcome.applied.items() if v != "unchanged"}
        if changed or outcome.deleted:
            kopf.info(body, reason="Reconciled", message=f"applied {sorted(changed)}; deleted {outcome.deleted}")
    return outcome.status


@kopf.on.resume(*SERVINGS)
@kopf.on.create(*SERVINGS)
@kopf.on.update(*SERVINGS, field="spec")
async def serving_changed(body, patch: kopf.Patch, memo: kopf.Memo, logger, **_):
    patch.status.update(await _reconcile_and_report(body, memo, logger))


@kopf.timer(*SERVINGS, interval=RESYNC_SECONDS, initial_delay=RESYNC_SECONDS, idle=RESYNC_SECONDS)
async def serving_resync(body, patch: kopf.Patch, memo: kopf.Memo, logger, **_):
    """Picks up what no event announces: Deployments becoming ready, drift of children."""
    patch.status.update(await _reconcile_and_report(body, memo, logger))


@kopf.on.delete(*SERVINGS)
async def serving_deleted(body, name, namespace, memo: kopf.Memo, logger, **_):
    deleted = await asyncio.to_thread(_cleanup_blocking, body, name, namespace, memo)
    logger.info("deleted %s", deleted)


def _cleanup_blocking(body, name, namespace, memo: kopf.Memo) -> list[str]:
    """Under the object's lock, so that a resync in flight cannot re-apply children behind the cleanup."""
    meta = body.get("metadata") or {}
    with _LOCKS[_lock_key(meta)]:
        deleted = cleanup(memo.cluster, name, namespace)
    _LOCKS.pop(_lock_key(meta), None)
    return deleted


@kopf.on.create(*PROFILES)
@kopf.on.update(*PROFILES, field="spec")
async def profile_changed(name, memo: kopf.Memo, logger, **_):
    """A profile change (price, limits, selector) re-renders every serving that references it."""
    cluster: Cluster = memo.cluster
    for serving in await asyncio.to_thread(cluster.list, api.API_VERSION, "SpeculativeServing", None):
        if (serving.get("spec") or {}).get("profile") != name:
            continue
        meta = serving["metadata"]
        status = await _reconcile_and_report(serving, memo, logger)
        try:
            await asyncio.to_thread(
                cluster.patch_status, api.API_VERSION, "SpeculativeServing", meta.get("namespace"), meta["name"], status
            )
        except ApiException as exc:
            if exc.status != 404:  # deleted meanwhile: nothing to report on
                raise
