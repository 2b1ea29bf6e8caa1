"""Bounded-time sharded saves and loads (issue 28): a rank that stalls in any phase is named,
with the phase and the object, in the one error every rank raises, within the deadline.

Each case is one session of 3 gloo ranks on 127.0.0.1 (``_deadline_worker.py``) with
``timeout=2``: one rank stalls (a sleep of 3.2 s injected in that phase on that rank alone; in
the commit, rank 0; with ``writer="process"``, its writer process stops for good). Checked on
every rank: the error's message is the same everywhere and names the rank, the phase and the
checkpoint (and, for a write, the data file it was writing); ``phase`` and ``stalled`` say the
same; the ranks that waited raised within the deadline and a grace; the stalled rank raised as
soon as it came back (its writer process: without coming back), not after another deadline;
the previous checkpoint is intact and nothing is left staged.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from . import _launch

pytestmark = pytest.mark.distributed

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():  # pragma: no cover
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

WORKER = Path(__file__).with_name("_deadline_worker.py")
WORLD = 3
DEADLINE = 2.0  # as in the worker
STALL = DEADLINE + 1.2  # as in the worker
GRACE = 1.0  # the naming grace at this deadline (min(3 s, deadline / 2))
SLACK = 1.5  # a busy machine's scheduling, two shared cores

# scenario: (the phase named, the rank that stalls, what it was doing, if it says)
CASES = {
    "save_plan": ("save: plan", 2, None),
    "save_write": ("save: write", 2, "writing data-r00002-00000.safetensors"),
    "save_commit": ("save: commit", 0, None),
    "save_writer_process": ("save: write", 2, "its writer process (pid "),
    "load_plan": ("load: plan", 2, None),
    "load_read": ("load: read", 2, None),
    "load_read_once": ("load: read-once round", 2, None),
}


@pytest.mark.parametrize("scenario", list(CASES))
def test_a_stalled_rank_is_named_on_every_rank_within_the_deadline(
    scenario: str, tmp_path: Path
) -> None:
    phase, late, doing = CASES[scenario]
    s = _launch.run(scenario, WORLD, tmp_path, worker=WORKER, timeout=60)
    assert all(v == "ok" for v in s.checks().values()) and len(s.results) == WORLD, s.failures()
    stalled_in = s.results[late]["data"]["stalled in"]
    assert stalled_in.startswith(phase), stalled_in
    phase = stalled_in  # the read-once round the stalled rank slept in
    errors = {r: s.results[r]["data"]["error"] for r in range(WORLD)}
    messages = {e["message"] for e in errors.values()}
    assert len(messages) == 1, messages  # the one error every rank raises
    (message,) = messages
    path = s.results[0]["data"]["object"]
    said = f"rank {late} did not finish its part of '{phase}' of {path}"
    assert said in message, message
    assert "within 2 s" in message, message
    if doing is not None:
        assert f"{path} ({doing}" in message, message
    for r, e in errors.items():
        assert e["phase"] == phase and e["stalled"] == {str(late): phase}, (r, e)
        assert late in e["ranks"], (r, e)
        assert e["errors"][str(late)].startswith(f"did not finish its part of '{phase}'"), e
    elapsed = {r: s.results[r]["data"]["elapsed"] for r in range(WORLD)}
    # The timed call of the writer-process case also waits for its writer process, started just
    # before, to be up (a Python importing savepoint: up to a second more on two shared cores in
    # the whole suite; a CI run measured 5.2 s on a rank that was not late).
    startup = 1.5 if scenario == "save_writer_process" else 0.0
    for r, t in elapsed.items():
        if r != late:  # waited for the deadline, then named the late rank at once
            assert DEADLINE - 0.5 < t < DEADLINE + GRACE + SLACK + startup, (r, elapsed)
    if scenario == "save_writer_process":  # it gave up on its writer process (asked each second)
        assert elapsed[late] < DEADLINE + GRACE + 1 + SLACK, elapsed
    else:  # back after its stall, it raised at once
        assert STALL - 0.5 < elapsed[late] < STALL + SLACK, elapsed
    print(f"{scenario}: {s.elapsed:.1f} s, elapsed per rank {elapsed}")
