"""DeepSpeedExamples scripts, read from the fetched snapshot and run unchanged on microspeed's stand-in.

Only the data source is replaced (see ``examples_run.py``); every case runs on 2 ranks (gloo, CPU) and each
rank's training losses must equal real DeepSpeed 0.19.8's recorded ones (``fixtures/example_<case>.json``,
``record.py examples``): within ``clientrun.RTOL`` in fp32, a relative 2e-2 in bf16/fp16 (half-precision rounding
of the same math may differ in the last bits and grow over the few steps). Skipped when the snapshot is absent
(CI has no copy of DeepSpeedExamples).
"""

from __future__ import annotations

import clientrun as c
import examples_run as ex
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), c.needs("transformers"),
              pytest.mark.skipif(not ex.snapshot_available(),
                                 reason=f"no DeepSpeedExamples snapshot at {c.EXAMPLES_GIT} (fetch it to run these)")]

#: cases known to fail today, with the gap they hit (also in the README's client table); strict: a fix shows up.
KNOWN_GAPS: dict[str, str] = {
    "pipeline_alexnet": "G2: the data order now matches (targets equal; steps 1-2 equal within 3e-7), but the third "
                        "step's losses differ by 4e-3 (2.293 vs 2.283); torch's fused and unfused Adam give the same "
                        "third step under microspeed, so it is not kernel rounding: cause still open",
}


def _cases():
    for name in ex.CASES:
        marks = [pytest.mark.xfail(strict=True, reason=KNOWN_GAPS[name])] if name in KNOWN_GAPS else []
        yield pytest.param(name, marks=marks, id=name)


@pytest.mark.parametrize("name", list(_cases()))
def test_example_matches_deepspeed(name, tmp_path, standin):
    ref = c.load_fixture(f"example_{name}")
    half = any(d in ex.CASES[name]["args"] for d in ("bf16", "fp16"))
    rtol = 2e-2 if half else c.RTOL
    if "refused" in ref:
        # Real DeepSpeed refused this mode here (fp16 on a CPU without fp16 kernels). microspeed may refuse too,
        # naming the dtype, or train: then its losses must follow the fp32 run of the same case within rtol.
        try:
            got = ex.run_case(ex.CASES[name], "microspeed", tmp_path)
        except c.ClientRunError as exc:
            assert any("fp16" in ln for ln in c.error_lines(str(exc))), str(exc)[-3000:]
            return
        ref = c.load_fixture(f"example_{name.replace('fp16', 'fp32').replace('bf16', 'fp32')}")
    else:
        got = ex.run_case(ex.CASES[name], "microspeed", tmp_path)
    assert sorted(got) == sorted(ref), f"ranks/phases {sorted(got)} != {sorted(ref)}"
    for key in ref:
        c.assert_microspeed_imported(got[key])
        c.close(got[key]["loss"], ref[key]["loss"], f"{name} {key} loss", rtol=rtol)
