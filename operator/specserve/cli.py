"""`specserve`: every command of both packages. The runtime's groups (serving, bench, training) need no operator,
the operator's (the cluster's commands and the local tools) need no torch; only this module sees both."""

import sys

from specserve_operator import commands as cluster
from specserve_operator.local import bench_operator, canary, demo, simulate
from specserve_runtime import cli as runtime_cli

GROUPS = (*runtime_cli.GROUPS, cluster, canary, demo, simulate, bench_operator)


def build_parser():
    return runtime_cli.build_parser(GROUPS)


def main(argv: list[str] | None = None) -> int:
    return runtime_cli.main(argv, GROUPS)


if __name__ == "__main__":
    sys.exit(main())
