"""Errors that name the problem for the user; torch-free so the command line can catch them cheaply."""

import re

# pydantic's names for the shapes a field of several types was tried as ("int", "list[TextPart]",
# "function-after[...]"): not keys the user wrote, so not in the path the user reads. Dict keys ("nvidia.com/gpu") are.
_SHAPE = re.compile(r"^(int|str|float|bool|list|dict)$|\[|^function-")


def field_location(loc: tuple) -> list[str | int]:
    """A pydantic error's location as the user wrote it: its keys and list indices, without pydantic's shape names."""
    return [part for part in loc if isinstance(part, int) or not _SHAPE.search(part)]


class ModelError(ValueError):
    """A model folder that cannot be loaded."""


class DrafterError(ValueError):
    """A drafter that cannot serve this target, or an unknown method."""
