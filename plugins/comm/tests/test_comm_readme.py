"""The plugin README's table of optimizer params is what the optimizers accept."""

from __future__ import annotations

import pathlib
import re

from microspeed_comm.plugin import PARAM_DOCS, params_table

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_params_table_matches_the_signatures():
    table = re.search(r"<!-- params:begin -->\n(.*?)\n<!-- params:end -->", README.read_text(), re.S)
    assert table is not None and table.group(1).strip() == params_table(), \
        "plugins/comm/README.md params table is stale: regenerate it with microspeed_comm.plugin.params_table()"


def test_every_param_is_documented():
    rows = [line.split("|")[1].strip().strip("`") for line in params_table().splitlines()[2:]]
    assert sorted(rows) == sorted(PARAM_DOCS)
