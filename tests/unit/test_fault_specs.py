"""`--kill` fault specs (trainer/faults.py): parsed, formatted back canonically, and
refused with a one-line reason; the CLI's handling of them is in test_cli_args.py."""

from __future__ import annotations

import pytest

from recover.proto import pb
from recover.trainer.faults import FaultSpecError, format_fault_spec, parse_fault_spec


def assert_round_trip(text: str, expected: pb.FaultSpec, canonical: str) -> None:
    spec = parse_fault_spec(text)
    assert spec == expected
    assert format_fault_spec(spec) == canonical
    assert parse_fault_spec(format_fault_spec(spec)) == spec


@pytest.mark.parametrize(("text", "expected", "canonical"), [
    pytest.param("step=20,replica=1,phase=backward",
                 pb.FaultSpec(step=20, replica=1, phase="backward", microbatch=-1),
                 "step=20,replica=1,phase=backward", id="no-microbatch"),
    pytest.param("phase=forward, replica=0 ,step=3,microbatch=2",
                 pb.FaultSpec(step=3, replica=0, phase="forward", microbatch=2),
                 "step=3,replica=0,phase=forward,microbatch=2", id="any-order-and-spaces"),
    pytest.param("step=0,replica=7,phase=recompute,microbatch=-1",
                 pb.FaultSpec(step=0, replica=7, phase="recompute", microbatch=-1),
                 "step=0,replica=7,phase=recompute", id="explicit-middle"),
    pytest.param("step=2,replica=1,phase=reduce,rank=1",
                 pb.FaultSpec(step=2, replica=1, phase="reduce", microbatch=-1, rank=1),
                 "step=2,replica=1,phase=reduce,rank=1", id="a-rank-of-a-sharded-replica"),
])
def test_parse_and_format_fault_spec_round_trip(text, expected, canonical):
    assert_round_trip(text, expected, canonical)


@pytest.mark.parametrize("phase", ["forward", "backward", "reduce", "commit", "rebuild",
                                   "recompute"])
def test_every_phase_round_trips(phase):
    spec = pb.FaultSpec(step=4, replica=2, phase=phase, microbatch=1)
    assert parse_fault_spec(format_fault_spec(spec)) == spec


@pytest.mark.parametrize("text", ["", "step=1", "step=1,replica=0,phase=", "=1",
                                  "step=1,replica=0,phase=forward,microbatch=-2",
                                  "step=1.5,replica=0,phase=forward"])
def test_parse_fault_spec_rejects(text):
    with pytest.raises(FaultSpecError, match="malformed --kill"):
        parse_fault_spec(text)


@pytest.mark.parametrize(("text", "expected", "canonical"), [
    pytest.param("step=2,replica=1,phase=stop",
                 pb.FaultSpec(step=2, replica=1, phase="stop", microbatch=-1, seconds=0.0),
                 "step=2,replica=1,phase=stop", id="stop"),
    pytest.param("step=2,replica=1,phase=spin,microbatch=3",
                 pb.FaultSpec(step=2, replica=1, phase="spin", microbatch=3, seconds=0.0),
                 "step=2,replica=1,phase=spin,microbatch=3", id="spin"),
    pytest.param("phase=deadlock,step=0,replica=0",
                 pb.FaultSpec(step=0, replica=0, phase="deadlock", microbatch=-1, seconds=0.0),
                 "step=0,replica=0,phase=deadlock", id="deadlock"),
    pytest.param("step=5,replica=0,phase=slow",
                 pb.FaultSpec(step=5, replica=0, phase="slow", microbatch=-1, seconds=1.0),
                 "step=5,replica=0,phase=slow,seconds=1.0", id="slow-default-1s"),
    pytest.param("step=5,replica=0,phase=slow,seconds=0.25",
                 pb.FaultSpec(step=5, replica=0, phase="slow", microbatch=-1, seconds=0.25),
                 "step=5,replica=0,phase=slow,seconds=0.25", id="slow-seconds"),
    pytest.param("seconds=3,phase=slow,replica=1,step=4,microbatch=0",
                 pb.FaultSpec(step=4, replica=1, phase="slow", microbatch=0, seconds=3.0),
                 "step=4,replica=1,phase=slow,seconds=3.0,microbatch=0", id="slow-any-order"),
    pytest.param("step=5,replica=0,phase=slow,seconds=0",
                 pb.FaultSpec(step=5, replica=0, phase="slow", microbatch=-1, seconds=0.0),
                 "step=5,replica=0,phase=slow,seconds=0.0", id="slow-zero"),
    pytest.param("step=5,replica=0,phase=slow,seconds=0.1",
                 pb.FaultSpec(step=5, replica=0, phase="slow", microbatch=-1, seconds=0.1),
                 "step=5,replica=0,phase=slow,seconds=0.1", id="slow-every-digit"),
])
def test_hang_and_slow_phases_parse_and_round_trip(text, expected, canonical):
    assert_round_trip(text, expected, canonical)


@pytest.mark.parametrize(("text", "phrase"), [
    pytest.param("step=1,replica=0,phase=stop,seconds=2", "seconds= goes with phase=slow only",
                 id="seconds-with-stop"),
    pytest.param("step=1,replica=0,phase=spin,seconds=0", "seconds= goes with phase=slow only",
                 id="seconds-with-spin"),
    pytest.param("step=1,replica=0,phase=deadlock,seconds=1", "seconds= goes with phase=slow only",
                 id="seconds-with-deadlock"),
    pytest.param("step=1,replica=0,phase=forward,seconds=1", "seconds= goes with phase=slow only",
                 id="seconds-with-crash-phase"),
    pytest.param("step=1,replica=0,phase=slow,seconds=-1", "seconds must be in [0, 3600)",
                 id="negative-seconds"),
    pytest.param("step=1,replica=0,phase=slow,seconds=-0.001", "seconds must be in [0, 3600)",
                 id="slightly-negative-seconds"),
    pytest.param("step=1,replica=0,phase=slow,seconds=3600", "seconds must be in [0, 3600)",
                 id="an-hour-is-too-long"),
    pytest.param("step=1,replica=0,phase=slow,seconds=soon", "seconds a number",
                 id="non-numeric-seconds"),
    pytest.param("step=1,replica=0,phase=slow,seconds=nan", "seconds must be in [0, 3600)",
                 id="nan-seconds"),
    pytest.param("step=1,replica=0,phase=slow,seconds=inf", "seconds must be in [0, 3600)",
                 id="inf-seconds"),
    pytest.param("step=1,replica=0,phase=slow,seconds=1,seconds=2", "'seconds' given twice",
                 id="seconds-twice"),
])
def test_fault_seconds_rejected(text, phrase):
    with pytest.raises(FaultSpecError, match="malformed --kill") as info:
        parse_fault_spec(text)
    assert phrase in str(info.value)
