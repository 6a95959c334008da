"""The specserve.io/v1alpha1 API as typed models: the single source of truth.

The CRDs in crds/ are generated from these models (crd.py). Rules that involve several
fields are written twice on purpose: as a pydantic validator (the operator and
`specserve render` check them) and as a CEL rule in the schema (the API server checks
them at admission); tests run both against the same invalid resources.
"""

from .spec import *  # noqa: F403  (the spec models: api.SpeculativeServingSpec, api.Speculator, ...)
from .status import *  # noqa: F403  (the status models: api.CanaryStatus, api.AutoscalingStatus, ...)
