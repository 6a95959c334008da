"""specserve runtime: the embedded speculative-decoding engine and the `specserve` command line."""

__version__ = "0.1.0"
