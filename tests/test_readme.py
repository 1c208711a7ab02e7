"""The README's quick start and config table stay true."""

from __future__ import annotations

import pathlib
import re

from microspeed import cli

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_config_table_matches_installed_schemas(capsys, monkeypatch):
    # The README lists the core's keys only: installed third-party plugins (entry points, such as
    # examples/plugins/early_stopping) add their sections to every schema but document them in
    # their own README, so the table is generated with entry-point discovery off.
    monkeypatch.setenv("MICROSPEED_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.delenv("MICROSPEED_PLUGINS", raising=False)
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
