"""The plugin README's config-key table is what the plugin accepts."""

from __future__ import annotations

import pathlib
import re

from microspeed import cli

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_table_matches_schema(capsys, monkeypatch):
    monkeypatch.setenv("MICROSPEED_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setenv("MICROSPEED_PLUGINS", "pipeline,activation_checkpointing")
    cli.main(["config-keys"])
    lines = capsys.readouterr().out.strip().splitlines()
    generated = "\n".join(lines[:2] + [line for line in lines[2:]
                                       if "| pipeline |" in line or "| activation_checkpointing |" in line])
    table = re.search(r"<!-- config-keys:begin -->\n(.*?)\n<!-- config-keys:end -->", README.read_text(), re.S)
    assert table.group(1).strip() == generated, "plugins/pipeline/README.md table is stale: regenerate it"
