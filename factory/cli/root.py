"""The root ``factory`` Typer app, which every command module registers its command on.

The commands load lazily: :data:`COMMAND_MODULES` names the module that registers
each one, and the root group imports a module only when its command is looked up
(it runs, or ``--help`` lists it), so ``factory validate`` never imports the build,
train or data stacks. It lives apart from :mod:`factory.cli.app` so that the command
modules can import :data:`app` to register on.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, MutableMapping
from importlib.metadata import version

import typer
from typer.core import TyperCommand, TyperGroup

__all__ = ["COMMAND_MODULES", "app"]

COMMAND_MODULES = {
    "validate": "factory.cli.validate_cmd",
    "build": "factory.cli.build_cmd",
    "plan": "factory.cli.plan_cmd",
    "report": "factory.cli.report_cmd",
    "schema": "factory.cli.schema_cmd",
    "train": "factory.cli.train_cmd",
    "eval": "factory.cli.eval_cmd",
    "data": "factory.cli.data_cmd",
    "export": "factory.cli.export_cmd",
    "import": "factory.cli.export_cmd",
    "average": "factory.cli.average_cmd",
    "generate": "factory.cli.generate_cmd",
}
"""Each command's name and the module that registers it on :data:`app`; the order is --help's."""

Command = TyperCommand | TyperGroup


class _LazyCommands(MutableMapping[str, Command]):
    """A group's commands by name: every name in :data:`COMMAND_MODULES` is listed (for
    --help, "Did you mean" and "choose from") but imported only when first read."""

    def __init__(self, loaded: MutableMapping[str, Command]) -> None:
        self.loaded = loaded
        """The commands whose module is imported, as Typer converted them."""

    def __getitem__(self, name: str) -> Command:
        if name not in self.loaded:
            if name not in COMMAND_MODULES:
                raise KeyError(name)
            importlib.import_module(COMMAND_MODULES[name])
            # Typer converts what is registered on `app` with the root's settings (markup, help).
            registered = typer.main.get_command(app).commands
            assert isinstance(registered, _LazyCommands)
            if name not in registered.loaded:
                raise LookupError(f"{COMMAND_MODULES[name]} registers no command {name!r}")
            self.loaded[name] = registered.loaded[name]
        return self.loaded[name]

    def __iter__(self) -> Iterator[str]:
        return iter(dict.fromkeys([*COMMAND_MODULES, *self.loaded]))

    def __len__(self) -> int:
        return len(set(COMMAND_MODULES) | set(self.loaded))

    def __setitem__(self, name: str, command: Command) -> None:
        self.loaded[name] = command

    def __delitem__(self, name: str) -> None:
        del self.loaded[name]


class LazyCommandGroup(TyperGroup):
    """The root group, whose commands import their module on first use."""

    def __init__(self, **attrs: object) -> None:
        super().__init__(**attrs)  # type: ignore[arg-type]
        self.commands = _LazyCommands(self.commands)


app = typer.Typer(
    name="factory",
    help="Blueprints in: training graphs, plans, exports and data shards out.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Click's plain help: rich's panels show flags as `--proxy <bool>` and read brackets in
    # help texts ('factory[scale]') as markup.
    rich_markup_mode=None,
    cls=LazyCommandGroup,
)


def _print_version(asked: bool) -> None:
    if asked:
        typer.echo(f"factory {version('nemotron-factory')}")
        raise typer.Exit()


@app.callback()
def _root(
    show_version: bool = typer.Option(
        False,
        "--version",
        callback=_print_version,
        is_eager=True,
        help="Print the installed version and exit.",
    ),
) -> None:
    """Blueprints in: training graphs, plans, exports and data shards out."""
