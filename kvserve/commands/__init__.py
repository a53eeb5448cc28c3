"""CLI subcommands. Each module here defines ``register(reg: CommandRegistry)``.

Modules are discovered, so adding a command never edits a central list.
"""
