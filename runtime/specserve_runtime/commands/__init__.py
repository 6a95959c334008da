"""The runtime's commands, one module per group (serving, bench, training); each adds its subparsers with
add_commands. Heavy imports (torch, transformers) happen inside the commands that need them."""
