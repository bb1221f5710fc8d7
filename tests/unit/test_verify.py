"""`recover verify` (cli/verify.py): comparing two runs' ledgers."""

from __future__ import annotations

import json

import pytest

from recover.cli.jobargs import UsageError
from recover.cli.main import main
from recover.cli.verify import compare, load_summary

STEPS = 4


def summary(steps: int = STEPS) -> dict:
    return {
        "job_id": "j",
        "steps_committed": steps,
        "microbatches_per_step": [16] * steps,
        "sample_digest_per_step": [f"{i:02d}" + "ab" * 31 for i in range(steps)],
        "param_sha256_per_step": [f"{i:02d}" + "cd" * 31 for i in range(steps)],
        "loss_per_step": [4.0 - 0.25 * i for i in range(steps)],
    }


def altered(key: str, step: int, value) -> dict:
    s = summary()
    s[key] = list(s[key])
    s[key][step] = value
    return s


def test_identical():
    verdict = compare(summary(), summary())
    assert verdict.identical
    assert verdict.first_difference is None
    assert verdict.message.startswith(f"identical: {STEPS} steps")


DIFF_ROWS = [
    pytest.param("microbatches_per_step", 2, 12, "microbatches 16 vs 12", id="microbatches"),
    pytest.param("sample_digest_per_step", 1, "ff" * 32, "sample digest 01abababab", id="samples"),
    pytest.param("param_sha256_per_step", 3, "ee" * 32, "parameters 03cdcdcdcdcd vs eeeeeeeeeeee",
                 id="parameters"),
    pytest.param("loss_per_step", 0, 4.0000001, "loss 4.0 vs 4.0000001", id="loss"),
    pytest.param("param_sha256_per_step", 0, "00" + "cd" * 30 + "ce", "parameters",
                 id="parameters-differ-only-in-last-char"),
]


@pytest.mark.parametrize(("key", "step", "value", "phrase"), DIFF_ROWS)
def test_first_difference(key, step, value, phrase):
    verdict = compare(summary(), altered(key, step, value))
    assert not verdict.identical
    assert verdict.first_difference == step
    assert verdict.message.startswith(f"differ: first at step {step}: ")
    assert phrase in verdict.message, verdict.message
    # Symmetric in which run is first.
    assert compare(altered(key, step, value), summary()).first_difference == step


def test_earliest_step_wins_and_fields_in_order():
    b = altered("loss_per_step", 1, 9.0)
    b["param_sha256_per_step"][3] = "x"
    assert compare(summary(), b).first_difference == 1
    c = altered("param_sha256_per_step", 2, "y")
    c["microbatches_per_step"][2] = 3
    verdict = compare(summary(), c)
    assert verdict.first_difference == 2 and "microbatches" in verdict.message


def test_loss_rtol():
    b = altered("loss_per_step", 2, 3.5 * (1 + 1e-6))
    assert not compare(summary(), b).identical
    assert compare(summary(), b, loss_rtol=1e-5).identical
    assert not compare(summary(), b, loss_rtol=1e-7).identical
    # rtol never hides the other fields.
    c = altered("sample_digest_per_step", 2, "zz")
    assert not compare(summary(), c, loss_rtol=1.0).identical


@pytest.mark.parametrize(("a", "b"), [(STEPS, STEPS - 2), (STEPS - 1, STEPS)])
def test_different_step_counts(a, b):
    verdict = compare(summary(a), summary(b))
    assert not verdict.identical
    assert verdict.first_difference is None
    assert verdict.message == f"differ: {a} vs {b} committed steps (the first {min(a, b)} agree)"


def test_different_step_counts_but_earlier_difference_wins():
    short = summary(2)
    short["microbatches_per_step"][1] = 15
    verdict = compare(summary(), short)
    assert verdict.first_difference == 1


def test_runs_without_a_committed_step_compare_nothing_and_do_not_pass():
    verdict = compare(summary(0), summary(0))
    assert not verdict.identical and verdict.message == ("nothing to compare: neither run "
                                                          "committed a step")
    assert compare(summary(), summary(0)).message == "nothing to compare: one run committed no step"


def test_parameters_a_failed_run_did_not_record_are_said_and_never_pass():
    failed = summary()
    failed["param_sha256_per_step"] = [*failed["param_sha256_per_step"][:3], None]
    for a, b in ((summary(), failed), (failed, failed)):
        verdict = compare(a, b)
        assert not verdict.identical  # nothing proven at step 3: never a pass
        assert verdict.message == ("not all compared: 4 steps agree where both runs recorded "
                                   "them, but parameters were not recorded by a run at step 3"
                                   ), verdict.message
    other = altered("param_sha256_per_step", 1, "ee" * 32)
    assert compare(other, failed).message.startswith("differ: first at step 1: parameters")


# ---------------------------------------------------------------- files and the CLI

def write(path, data) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return str(path)


def test_load_summary_file_and_directory(tmp_path):
    write(tmp_path / "run" / "summary.json", summary())
    assert load_summary(str(tmp_path / "run")) == summary()
    assert load_summary(str(tmp_path / "run" / "summary.json")) == summary()


@pytest.mark.parametrize("kind", ["missing-file", "empty-dir", "not-json", "binary"])
def test_load_summary_bad_input(tmp_path, kind):
    if kind == "missing-file":
        path = tmp_path / "nope.json"
    elif kind == "empty-dir":
        path = tmp_path / "run"
        path.mkdir()
    elif kind == "not-json":
        path = tmp_path / "summary.json"
        path.write_text("this is not json {")
    else:
        path = tmp_path / "summary.json"
        path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(UsageError) as info:
        load_summary(str(path))
    message = str(info.value)
    assert message.startswith("recover verify: ")
    assert "\n" not in message


def run_verify(capsys, argv):
    code = main(["verify", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cli_exit_codes(tmp_path, capsys):
    a = write(tmp_path / "a" / "summary.json", summary())
    same = write(tmp_path / "same" / "summary.json", summary())
    other = write(tmp_path / "b" / "summary.json", altered("param_sha256_per_step", 1, "x" * 64))
    close = write(tmp_path / "c" / "summary.json", altered("loss_per_step", 1, 3.75 * (1 + 1e-9)))

    code, out, err = run_verify(capsys, [str(tmp_path / "a"), same])
    assert (code, err) == (0, "")
    assert out.startswith("identical: ") and out.count("\n") == 1

    code, out, err = run_verify(capsys, [a, other])
    assert (code, err) == (1, "")
    assert out.startswith("differ: first at step 1: parameters") and out.count("\n") == 1

    assert run_verify(capsys, [a, close])[0] == 1
    assert run_verify(capsys, [a, close, "--loss-rtol", "1e-6"])[0] == 0

    code, out, err = run_verify(capsys, [a, str(tmp_path / "missing")])
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("recover verify: no run at ")

    (tmp_path / "junk.json").write_text("[1, 2")
    code, out, err = run_verify(capsys, [str(tmp_path / "junk.json"), a])
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "is not a summary.json" in err

    code, out, err = run_verify(capsys, [a])
    assert code == 2 and out == "" and err.count("\n") == 1


@pytest.mark.parametrize(("data", "phrase"), [
    pytest.param([1, 2], "expected a JSON object, found list", id="list"),
    pytest.param({}, "no steps_committed count", id="empty-object"),
    pytest.param({"steps_committed": "3"}, "no steps_committed count", id="count-not-int"),
    pytest.param({**summary(), "sample_digest_per_step": None}, "no sample_digest_per_step list",
                 id="ledger-not-a-list"),
    pytest.param({**summary(), "loss_per_step": [2.0]}, "loss_per_step has 1 entries for",
                 id="short-list"),
    pytest.param({k: v for k, v in summary().items() if k != "param_sha256_per_step"},
                 "no param_sha256_per_step list", id="missing-key"),
])
def test_load_summary_rejects_non_summaries(tmp_path, data, phrase):
    with pytest.raises(UsageError) as info:
        load_summary(write(tmp_path / "summary.json", data))
    message = str(info.value)
    assert phrase in message and "\n" not in message, message


def test_load_summary_unreadable_is_a_usage_error(tmp_path):
    (tmp_path / "run" / "summary.json").mkdir(parents=True)  # read_text: IsADirectoryError
    with pytest.raises(UsageError, match="cannot read .*summary.json: Is a directory"):
        load_summary(str(tmp_path / "run"))


@pytest.mark.parametrize(("left", "right", "rtol", "same"), [
    pytest.param(float("nan"), float("nan"), 1.0, False, id="nan-never-equal"),
    pytest.param(2.0, float("nan"), 1.0, False, id="nan-on-one-side"),
    pytest.param(float("inf"), float("inf"), 0.0, True, id="equal-infinities"),
    pytest.param(1.0, 1.1, 0.095, True, id="symmetric-uses-the-larger"),
    pytest.param(1.1, 1.0, 0.095, True, id="symmetric-other-order"),
    pytest.param(1.0, 1.1, 0.05, False, id="beyond-tolerance"),
    pytest.param(0.0, 0.0, 0.0, True, id="zeros"),
])
def test_loss_tolerance_is_symmetric_and_nan_aware(left, right, rtol, same):
    a = summary()
    b = altered("loss_per_step", 1, right)
    a["loss_per_step"][1] = left
    assert compare(a, b, loss_rtol=rtol).identical is same
    assert compare(b, a, loss_rtol=rtol).identical is same


@pytest.mark.parametrize("rtol", ["-1e-3", "nan", "inf"])
def test_cli_rejects_bad_loss_rtol(tmp_path, capsys, rtol):
    a = write(tmp_path / "a" / "summary.json", summary())
    code, out, err = run_verify(capsys, [a, a, f"--loss-rtol={rtol}"])
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "--loss-rtol must be a finite number >= 0" in err


def with_buffers(buffers: str) -> dict:
    """A summary whose step digests cover buffers too: PARAMS+BUFFERS (trainer/digest.py)."""
    s = summary()
    s["param_sha256_per_step"] = [f"{d}+{buffers * 32}" for d in s["param_sha256_per_step"]]
    return s


def test_buffer_digests_say_which_part_differs():
    same = compare(with_buffers("b1"), with_buffers("b1"))
    assert same.identical and "parameters and buffers after every step" in same.message
    verdict = compare(with_buffers("b1"), with_buffers("b2"))
    assert verdict.message == ("differ: first at step 0: buffers b1b1b1b1b1b1 vs b2b2b2b2b2b2 "
                               "(parameters agree)")
    params = with_buffers("b1")
    params["param_sha256_per_step"][2] = "ee" * 32 + "+" + "b1" * 32
    assert "step 2: parameters 02cdcdcdcdcd vs eeeeeeeeeeee" in compare(with_buffers("b1"),
                                                                        params).message
    assert "the other's do not" in compare(summary(), with_buffers("b1")).message


@pytest.mark.parametrize(("scheme_a", "scheme_b", "compared"), [
    pytest.param("sha256/16MiB", "sha256/16MiB", True, id="same-scheme"),
    pytest.param(None, "sha256/16MiB", True, id="one-run-reported-none"),
    pytest.param("sha256/16MiB", "absent", False, id="an-older-builds-summary"),
    pytest.param("sha256", "sha256/16MiB", False, id="two-schemes"),
])
def test_digests_made_two_ways_are_not_compared(scheme_a, scheme_b, compared):
    a, b = summary(), altered("param_sha256_per_step", 1, "ee" * 32)
    a["digest_scheme"] = scheme_a
    if scheme_b != "absent":  # a summary of a build before the key: one sha256 stream
        b["digest_scheme"] = scheme_b
    verdict = compare(a, b)
    assert not verdict.identical
    if compared:
        assert verdict.first_difference == 1 and "parameters" in verdict.message
    else:
        assert verdict.first_difference is None
        assert verdict.message.startswith("parameters not compared: one run's digests are")
        assert f"the {STEPS} steps' microbatches, samples and loss agree" in verdict.message
        lost = altered("loss_per_step", 2, 9.0)
        lost["digest_scheme"] = scheme_a
        assert compare(lost, b).first_difference == 2  # the rest is still compared


FAST_ROWS = [
    # (reduce of run a, of run b, loss rtol, parameters differ, loss off by, identical, phrase)
    pytest.param("exact", "exact", 1e-4, True, 0.0, False, "differ: first at step 2: parameters",
                 id="exact-bits-always-compared"),
    pytest.param("fast", "fast", 0.0, True, 0.0, False, "fast mode: equal up to summation order",
                 id="fast-bits-asked-for-says-why"),
    pytest.param("fast", "exact", 0.0, True, 0.0, False, "--loss-rtol 1e-4 checks",
                 id="one-fast-run-says-why"),
    pytest.param("fast", "fast", 1e-4, True, 0.0, True, "parameters differ from step 2",
                 id="fast-promise-kept"),
    pytest.param("fast", "fast", 1e-4, True, 1e-3, False, "differ: first at step 3: loss",
                 id="fast-loss-beyond-tolerance"),
    pytest.param("fast", "fast", 1e-4, False, 0.0, True, "identical: 4 steps",
                 id="fast-same-bits-identical"),
    pytest.param(None, "fast", 1e-4, True, 0.0, True, "agree as fast mode promises",
                 id="an-older-summary-without-reduce"),
]


@pytest.mark.parametrize(("reduce_a", "reduce_b", "rtol", "params_differ", "loss_off", "same",
                          "phrase"), FAST_ROWS)
def test_fast_mode_is_held_to_what_it_promises(reduce_a, reduce_b, rtol, params_differ, loss_off,
                                               same, phrase):
    a, b = summary(), summary()
    if reduce_a:
        a["reduce"] = reduce_a
    b["reduce"] = reduce_b
    if params_differ:
        b["param_sha256_per_step"] = [*a["param_sha256_per_step"][:2], "ee" * 32, "ff" * 32]
    if loss_off:
        b["loss_per_step"] = [*a["loss_per_step"][:3], a["loss_per_step"][3] * (1 + loss_off)]
    # Samples still count in fast mode: it promises the same ones.
    verdict = compare(a, b, rtol)
    assert verdict.identical is same, verdict.message
    assert phrase in verdict.message, verdict.message
    if rtol and reduce_b == "fast":
        c = altered("sample_digest_per_step", 1, "ff" * 32)
        c["reduce"] = "fast"
        assert compare(a, c, rtol).message.startswith("differ: first at step 1: sample digest")
