"""The runtime's own command line (`python -m specserve_runtime.cli`): its command groups without the operator's,
for the runtimes the local tools start; the `specserve` command (specserve.cli) has both."""

import sys

from .cmdline import Parser, UsageError
from .commands import bench, serving, training

GROUPS = (serving, bench, training)


def build_parser(groups=GROUPS) -> Parser:
    parser = Parser(prog="specserve", description="Speculative decoding as a measured, multi-tenant service.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for group in groups:
        group.add_commands(commands)
    return parser


def main(argv: list[str] | None = None, groups=GROUPS) -> int:
    from .errors import DrafterError, ModelError

    try:
        args = build_parser(groups).parse_args(argv)
        return args.run(args) or 0
    except (UsageError, ModelError, DrafterError, ValueError) as exc:
        print(f"{getattr(exc, 'prog', 'specserve')}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        if exc.filename is None:  # not a path the user gave (a socket, a bug): the traceback says more
            raise
        print(f"specserve: error: {exc.filename}: {exc.strerror or exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
