"""Errors that name the problem for the user; torch-free so the command line can catch them cheaply."""


class ModelError(ValueError):
    """A model folder that cannot be loaded."""


class DrafterError(ValueError):
    """A drafter that cannot serve this target, or an unknown method."""
