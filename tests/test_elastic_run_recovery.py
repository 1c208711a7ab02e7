"""A node of an elastic job dies and the job continues on the survivor from the last checkpoint.

Two torchrun agents on this machine (``microspeed run --elastic 1:2``, one rank each: two "nodes" on one c10d
rendezvous) train a tiny model under ZeRO-2, saving every 2 steps, with ``checkpoint.auto_resume_dir``
(:mod:`microspeed.testing.elastic_job`, which ``benchmarks/bench_recovery.py`` times). The test kills the second
agent and its rank (SIGKILL: a node lost). The first agent's rank fails in its next collective, the agent restarts
it at world size 1, and ``initialize()`` resumes from the last complete save with the same global batch (4
micro-batches of 2 on one rank instead of 2 on each of two). Its losses after the restart equal those of a
one-process run resumed from that checkpoint by hand.
"""

from __future__ import annotations

import pytest

from microspeed.testing.elastic_job import ElasticJob, JobSpec, reference_losses

SPEC = JobSpec(steps=8)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_lost_node_the_job_continues_on_the_survivor_from_the_last_checkpoint(tmp_path):
    with ElasticJob(tmp_path, SPEC) as job:
        job.start()
        # wait for a step after the first periodic save (step 2) on two ranks
        job.wait_until(lambda: any(r["step"] >= 3 and r["world"] == 2 for r in job.records(0, 1)))
        killed_at, survivor = job.kill_node(rank=1)
        log = job.wait(survivor)
    before = job.records(0, 0)
    after = list(job.resumed())
    assert after, log[-4000:]
    resumed = after[0]
    lost_at = max(r["step"] for r in before) + 1
    assert all(r["world"] == 1 and r["batch"] == 8 for r in after)  # the global batch kept on one rank
    assert resumed["start"] in (2, 4, 6) and resumed["start"] <= lost_at and resumed["resumed_from"].endswith(
        f"global_step{resumed['start']}")
    assert [r["step"] for r in after] == list(range(resumed["start"], SPEC.steps))
    ref = reference_losses(SPEC, str(job.ckpt), f"global_step{resumed['start']}", resumed["start"])
    got = [loss for r in after for loss in r["losses"]]
    assert got == pytest.approx([loss for losses in ref for loss in losses], rel=1e-6, abs=1e-7)
    print(f"node lost after step {lost_at - 1}; resumed at step {resumed['start']} "
          f"({lost_at - resumed['start']} step(s) redone), first new step "
          f"{resumed['t'] - killed_at:.1f} s after the kill")
