"""The README's quick start and config table stay true."""

from __future__ import annotations

import pathlib
import re

from microspeed import cli

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_config_table_matches_installed_schemas(capsys):
    cli.main(["config-keys"])
    generated = capsys.readouterr().out.strip()
    readme = (ROOT / "README.md").read_text()
    table = re.search(r"<!-- config-keys:begin -->\n(.*?)\n<!-- config-keys:end -->", readme, re.S).group(1)
    assert table.strip() == generated, "README table is stale: paste the output of `microspeed config-keys`"


def test_ci_runs_the_readme_commands():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    commands = re.findall(r"```bash\n(python -m [^\n]+)\n```", readme)
    assert len(commands) == 2
    for command in commands:
        assert command in ci
