"""The `specserve` command: the runtime's commands and the operator's in one command line."""
