"""The CLI imports a command's module only when that command runs (or ``--help`` lists it).

``factory validate`` in CI pays for what it imports; before the commands loaded
lazily it imported build, train, data and export (and with them rich, the
report pages and the runtime) to validate a blueprint. These tests look at
``sys.modules`` in a fresh process, not at a clock.
"""

from __future__ import annotations

import json
import subprocess
import sys

from factory.cli.root import COMMAND_MODULES

_LOADED_AFTER = """
import json, sys
from factory.cli.app import main
status = main({argv!r})
print(json.dumps([status, sorted(sys.modules)]))
"""


def _modules_after(*argv: str) -> tuple[int, set[str]]:
    """The exit status of ``factory ARGV`` run in a fresh process, and the modules it imported."""
    script = _LOADED_AFTER.format(argv=list(argv))
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    )
    status, modules = json.loads(done.stdout.splitlines()[-1])
    return status, set(modules)


def test_validate_imports_no_other_command() -> None:
    status, modules = _modules_after("validate", "nano", "--quiet")
    assert status == 0
    assert COMMAND_MODULES["validate"] in modules
    others = set(COMMAND_MODULES.values()) - {COMMAND_MODULES["validate"]}
    assert not others & modules, sorted(others & modules)
    # What only the other commands need: their jobs, progress display and pages, and
    # OmegaConf, which a blueprint without interpolation or --set overrides never uses.
    unneeded = {"factory.jobs", "factory.runtime", "factory.report", "factory.exports"}
    assert not {m for m in modules if m.rsplit(".", 1)[0] in unneeded or m in unneeded}
    assert not {m for m in modules if m.split(".")[0] in {"rich", "omegaconf", "click"}}


def test_a_command_imports_its_own_module_only() -> None:
    status, modules = _modules_after("schema", "--check", "--out", "schemas")
    assert status in (0, 1)
    loaded = {m for m in COMMAND_MODULES.values() if m in modules}
    assert loaded == {COMMAND_MODULES["schema"]}


def test_the_table_names_every_registered_command() -> None:
    """A command module registered on the app but missing from COMMAND_MODULES would never
    load; one named there that registers nothing would fail on use."""
    script = (
        "import importlib, json, typer\n"
        "from factory.cli.root import COMMAND_MODULES, app\n"
        "for module in dict.fromkeys(COMMAND_MODULES.values()):\n"
        "    importlib.import_module(module)\n"
        "group = typer.main.get_command(app)\n"
        "print(json.dumps(list(group.commands.loaded)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    )
    assert sorted(json.loads(done.stdout)) == sorted(COMMAND_MODULES)


def test_help_lists_every_command_in_order(cli) -> None:
    status, out, _ = cli("--help")
    assert status == 0
    listed = out[out.index("Commands:") :].splitlines()[1:]
    assert [line.split()[0] for line in listed if line.strip()] == list(COMMAND_MODULES)
