"""`recover` command-line mistakes end in one line on stderr, never a traceback.

Most cases call `recover.cli.main.main` in-process; one runs the real console
entry point in a subprocess. Nothing here may start a job: a guard replaces
what would launch processes or serve, so a validation that wrongly passes
fails the test instead of training.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

import recover.cli.launcher as launcher_mod
import recover.controller.server as server_mod
from recover.cli.jobargs import UsageError, job_from_args, job_to_args, parse_address
from recover.cli.main import build_parser, main
from recover.proto import pb

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def no_launch(monkeypatch):
    """Fail instead of starting a job, and keep the `recover` logger as it was."""
    def refuse(*args, **kwargs):
        raise AssertionError("the arguments were accepted: a job would have started")

    monkeypatch.setattr(launcher_mod, "LocalJob", refuse)
    monkeypatch.setattr(server_mod, "serve", refuse)
    logger = logging.getLogger("recover")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    yield
    logger.handlers[:], logger.level, logger.propagate = saved


def run_main(capsys, argv: list[str]) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_line(err: str, phrase: str) -> None:
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {err!r}"
    assert err.endswith("\n") and not err.endswith("\n\n")
    assert phrase in lines[0], f"{phrase!r} not in {lines[0]!r}"


USAGE_CASES = [
    # A stray flag is reported by the command it was given to, with that command's --help.
    pytest.param(["run", "--bogus"], "recover run: unrecognized arguments: --bogus (see "
                 "`recover run --help`)", id="unknown-flag"),
    pytest.param(["status", "--frobnicate", "1"], "recover status: unrecognized arguments: "
                 "--frobnicate 1", id="unknown-flag-status"),
    pytest.param(["certs", "token", "--bogus"], "recover certs token: unrecognized arguments",
                 id="unknown-flag-subcommand"),
    pytest.param(["frobnicate"], "invalid choice: 'frobnicate'", id="unknown-command"),
    pytest.param([], "the following arguments are required: COMMAND", id="no-command"),
    pytest.param(["run", "-R", "0"], "argument --replicas/-R: must be at least 1, got 0",
                 id="zero-replicas"),
    pytest.param(["run", "--steps", "ten"], "expected a whole number, got 'ten'",
                 id="non-integer-steps"),
    pytest.param(["run", "-M", "2", "--replicas", "4"],
                 "--global-microbatches (2) must be at least --replicas (4)", id="M-below-R"),
    pytest.param(["controller", "-M", "2", "--replicas", "4"],
                 "--global-microbatches (2) must be at least --replicas (4)",
                 id="M-below-R-controller"),
    pytest.param(["run", "--n-embd", "10", "--n-head", "4"],
                 "--n-embd (10) must be a multiple of --n-head (4)", id="n-embd-vs-n-head"),
    pytest.param(["run", "--lr", "0"], "--lr must be a positive number, got 0.0", id="zero-lr"),
    pytest.param(["run", "--lr", "inf"], "--lr must be a positive number, got inf", id="inf-lr"),
    pytest.param(["run", "--group-timeout", "-1"], "--group-timeout must be a positive number",
                 id="negative-group-timeout"),
    pytest.param(["controller", "--agent-timeout", "-3"], "must be a positive number of seconds",
                 id="negative-agent-timeout"),
    pytest.param(["agent", "--controller", "127.0.0.1:1", "--connect-timeout", "0"],
                 "must be a positive number of seconds", id="zero-connect-timeout"),
    pytest.param(["run", "--kill", "step=1,replica=0"], "missing ['phase']",
                 id="kill-missing-phase"),
    pytest.param(["run", "--kill", "step=1,replica=0,phase=explode"],
                 "phase must be one of forward, backward, reduce, commit, rebuild, recompute",
                 id="kill-bad-phase"),
    pytest.param(["run", "--kill", "step=one,replica=0,phase=forward"],
                 "step, replica, microbatch and rank must be integers", id="kill-non-integer-step"),
    pytest.param(["run", "--kill", "step=1,replica=0,phase=forward,rank=2",
                  "--ranks-per-replica", "2"],
                 "rank 2 does not exist (a replica has 2 ranks", id="kill-rank-beyond-replica"),
    pytest.param(["run", "--ranks-per-replica", "0"], "must be at least 1",
                 id="zero-ranks-per-replica"),
    pytest.param(["run", "--kill", "step=1,replica=0,phase=forward,colour=red"],
                 "unknown key(s) ['colour']", id="kill-unknown-key"),
    pytest.param(["run", "--kill", "step=1,replica=0,phase=forward,step=2"],
                 "'step' given twice", id="kill-key-twice"),
    pytest.param(["run", "--kill", "garbage"], "expected key=value pairs", id="kill-no-pairs"),
    pytest.param(["run", "--kill", "step=-1,replica=0,phase=forward"],
                 "values must not be negative", id="kill-negative-step"),
    pytest.param(["run", "--steps", "5", "--kill", "step=5,replica=0,phase=forward"],
                 "step 5 is beyond the last step (4)", id="kill-step-beyond-steps"),
    pytest.param(["run", "--replicas", "2", "--kill", "step=1,replica=2,phase=forward"],
                 "replica 2 does not exist (replicas are 0..1)", id="kill-replica-beyond"),
    pytest.param(["run", "--replicas", "2", "--agents", "3"],
                 "--agents 3: give 1 to 2 (whole replicas on each), or a multiple of the "
                 "replicas and spares (2)", id="too-many-agents"),
    pytest.param(["run", "--replicas", "2", "--ranks-per-replica", "2", "--agents", "6"],
                 "whose share of each replica divides its 2 ranks (a replica spanning agents)",
                 id="agents-that-cannot-share-a-replica"),
    pytest.param(["controller", "--store", "zookeeper://x:2181"],
                 "unsupported store 'zookeeper://x:2181'", id="controller-bad-store"),
    pytest.param(["controller", "--store", "etcd://x"], "'x' is not HOST:PORT",
                 id="controller-malformed-etcd-url"),
    pytest.param(["run", "--store", "etcd://a:1,b"], "recover run: --store: store URL",
                 id="run-malformed-etcd-url"),
    pytest.param(["controller", "--port", "70000"], "--port 70000 is not a port number",
                 id="controller-bad-port"),
    pytest.param(["run", "--controllers", "2"], "--controllers 2 needs a shared store",
                 id="run-standbys-on-memory-store"),
    pytest.param(["run", "--controllers", "0"], "--controllers must be at least 1",
                 id="run-zero-controllers"),
    pytest.param(["agent", "--controller", "127.0.0.1:1,"], "has an empty address",
                 id="agent-controller-list-empty-part"),
    pytest.param(["agent", "--controller", "127.0.0.1:1,nope"], "--controller 'nope' is not HOST:PORT",
                 id="agent-controller-list-bad-part"),
    pytest.param(["controller", "--lease-ttl", "1"], "--lease-ttl must be 2..60 seconds",
                 id="controller-lease-ttl-too-short"),
    pytest.param(["agent", "--controller", "nonsense"], "--controller 'nonsense' is not HOST:PORT",
                 id="agent-controller-nonsense"),
    pytest.param(["agent", "--controller", "127.0.0.1:1", "--slots", "0"],
                 "--slots must be at least 1, got 0", id="agent-zero-slots"),
    pytest.param(["agent"], "the following arguments are required: --controller",
                 id="agent-without-controller"),
    pytest.param(["run", "--max-restarts", "5000"], "--max-restarts: must be between 0 and 1000",
                 id="run-too-many-restarts"),
    pytest.param(["agent", "--controller", "127.0.0.1:1", "--max-restarts", "-1"],
                 "--max-restarts: must be between 0 and 1000", id="agent-negative-restarts"),
    pytest.param(["run", "--restart-window", "0"], "--restart-window: must be a positive number",
                 id="run-zero-restart-window"),
    pytest.param(["status", "--controller", "localhost"], "--controller 'localhost' is not HOST:PORT",
                 id="status-controller-without-port"),
    pytest.param(["controller", "--host", "256.1.1.1"], "--host '256.1.1.1' is neither an IP",
                 id="controller-host-not-an-address"),
    pytest.param(["controller", "--host", "192.0.2.7"], "is not an address of this machine",
                 id="controller-host-not-local"),
    pytest.param(["run", "--store", "etcd://127.0.0.1:1", "--store-timeout", "1"],
                 "recover run: --store etcd://127.0.0.1:1: no answer within 1s",
                 id="run-etcd-unreachable"),
    pytest.param(["controller", "--store", "etcd://127.0.0.1:1", "--store-timeout", "1"],
                 "recover controller: --store etcd://127.0.0.1:1: no answer within 1s",
                 id="controller-etcd-unreachable"),
]


@pytest.mark.parametrize(("argv", "phrase"), USAGE_CASES)
def test_usage_errors_exit_2_with_one_line(capsys, tmp_path, argv, phrase):
    if argv[:1] == ["run"]:
        argv = [*argv, "--out", str(tmp_path / "out"), "--quiet"]
    code, out, err = run_main(capsys, argv)
    assert code == 2
    assert out == ""
    assert_one_line(err, phrase)


def test_an_empty_out_folder_is_refused(capsys):
    code, out, err = run_main(capsys, ["run", "--quiet", "--out", ""])
    assert code == 2 and out == ""
    assert_one_line(err, "--out is empty")


def test_status_with_nobody_listening_exits_1(capsys, monkeypatch):
    code, out, err = run_main(capsys, ["status", "--controller", "127.0.0.1:1",
                                       "--timeout", "0.5"])
    assert code == 1
    assert out == ""
    assert_one_line(err, "recover status: no controller answers at 127.0.0.1:1")


def test_agent_with_nobody_listening_exits_1(capsys):
    code, out, err = run_main(capsys, ["agent", "--controller", "127.0.0.1:1",
                                       "--connect-timeout", "1"])
    assert code == 1
    assert out == ""
    assert_one_line(err, "recover agent: cannot reach the controller at 127.0.0.1:1")


def test_agent_subprocess_prints_no_traceback():
    result = subprocess.run(
        [sys.executable, "-m", "recover.cli.main", "agent", "--controller", "127.0.0.1:1",
         "--connect-timeout", "1"],
        capture_output=True, text=True, timeout=30, cwd=REPO, stdin=subprocess.DEVNULL)
    assert result.returncode == 1, result.stderr
    assert result.stdout == ""
    assert_one_line(result.stderr, "cannot reach the controller at 127.0.0.1:1 "
                                   "(nothing answered within 1s)")


# ---------------------------------------------------------------- job flags

def parse_job(argv: list[str]) -> pb.JobConfig:
    return job_from_args(build_parser().parse_args(["controller", *argv]))


@pytest.mark.parametrize("argv", [
    pytest.param(["--job-id", "defaults"], id="defaults"),
    pytest.param(["-R", "3", "-T", "7", "-M", "9", "-B", "5", "--seed", "-42", "--lr", "1.25e-4",
                  "--job-id", "custom", "--n-layer", "3", "--n-embd", "48", "--n-head", "6",
                  "--seq-len", "17", "--vocab-size", "101", "--group-timeout", "2.5",
                  "--kill", "step=6,replica=2,phase=reduce",
                  "--kill", "step=0,replica=0,phase=backward,microbatch=3"], id="everything-set"),
    pytest.param(["--lr", "0.1", "--group-timeout", "0.30000000000000004"],
                 id="floats-keep-every-digit"),
])
def test_job_to_args_round_trip(argv):
    job = parse_job(argv)
    again = parse_job(job_to_args(job))
    assert again == job
    assert again.SerializeToString(deterministic=True) == job.SerializeToString(deterministic=True)


def test_round_trip_of_job_id_starting_with_dash():
    job = parse_job(["--job-id=-nightly"])
    assert job.job_id == "-nightly"
    assert parse_job(job_to_args(job)) == job


def test_round_trip_keeps_faults_in_order():
    job = parse_job(["-R", "2", "-T", "9", "--job-id", "j",
                     "--kill", "step=8,replica=1,phase=commit",
                     "--kill", "step=2,replica=0,phase=rebuild"])
    assert [(f.step, f.replica, f.phase) for f in job.testing.faults] == [(8, 1, "commit"),
                                                                  (2, 0, "rebuild")]
    assert parse_job(job_to_args(job)).testing.faults == job.testing.faults


def test_default_job_id_is_random():
    assert parse_job([]).job_id != parse_job([]).job_id


@pytest.mark.parametrize(("text", "ok"), [
    ("127.0.0.1:50051", True), ("host.example:1", True), ("[::1]:65535", True),
    ("nonsense", False), (":80", False), ("host:", False), ("host:0", False),
    ("host:65536", False), ("host:http", False),
])
def test_parse_address(text, ok):
    if ok:
        assert parse_address(text) == text
    else:
        with pytest.raises(UsageError, match="is not HOST:PORT"):
            parse_address(text)


# ---------------------------------------------------------------- hang/slow phases, policy, reduce
# (the `--kill` specs themselves: test_fault_specs.py)

@pytest.mark.parametrize("phase", ["stop", "spin", "deadlock", "slow"])
def test_new_phases_round_trip_through_job_to_args(phase):
    job = parse_job(["-R", "2", "-T", "3", "--job-id", "j",
                     "--kill", f"step=1,replica=1,phase={phase},microbatch=0"])
    assert [f.phase for f in job.testing.faults] == [phase]
    assert parse_job(job_to_args(job)) == job


def test_reduce_exact_and_policy_drop_round_trip():
    job = parse_job(["--reduce", "exact", "--policy", "drop", "--hang-timeout", "0.75",
                     "--hang-factor", "3.5", "--job-id", "j"])
    assert (job.reduce, job.policy, job.hang_timeout_s, job.hang_factor) == ("exact", "drop",
                                                                            0.75, 3.5)
    again = parse_job(job_to_args(job))
    assert again == job
    assert again.SerializeToString(deterministic=True) == job.SerializeToString(deterministic=True)
    defaults = parse_job(["--job-id", "j"])
    assert (defaults.reduce, defaults.policy, defaults.hang_timeout_s,
            defaults.hang_factor) == ("fast", "proportional", 2.0, 10.0)
    assert parse_job(job_to_args(defaults)) == defaults


def test_job_to_args_with_unset_policy_means_proportional():
    job = parse_job(["--job-id", "j"])
    job.policy = ""
    assert parse_job(job_to_args(job)).policy == "proportional"


@pytest.mark.parametrize(("argv", "phrase"), [
    pytest.param(["--hang-timeout", "0"], "--hang-timeout must be a positive number, got 0.0",
                 id="zero-hang-timeout"),
    pytest.param(["--hang-timeout", "inf"], "--hang-timeout must be a positive number, got inf",
                 id="inf-hang-timeout"),
    pytest.param(["--hang-timeout", "nan"], "--hang-timeout must be a positive number",
                 id="nan-hang-timeout"),
    pytest.param(["--hang-factor", "-1"], "--hang-factor must be a positive number, got -1.0",
                 id="negative-hang-factor"),
    pytest.param(["--reduce", "exactish"], "argument --reduce: invalid choice: 'exactish'",
                 id="bad-reduce"),
    pytest.param(["--policy", "shrink"], "argument --policy: invalid choice: 'shrink'",
                 id="bad-policy"),
    pytest.param(["--kill", "step=1,replica=0,phase=stop,seconds=2"],
                 "seconds= goes with phase=slow only", id="kill-seconds-with-stop"),
    pytest.param(["--kill", "step=1,replica=0,phase=slow,seconds=-2"], "seconds must be in [0, 3600)",
                 id="kill-negative-seconds"),
])
@pytest.mark.parametrize("command", ["run", "controller"])
def test_new_flags_usage_errors_exit_2_with_one_line(capsys, tmp_path, command, argv, phrase):
    argv = [command, *argv]
    if command == "run":
        argv += ["--out", str(tmp_path / "out"), "--quiet"]
    code, out, err = run_main(capsys, argv)
    assert code == 2
    assert out == ""
    assert_one_line(err, phrase)


@pytest.mark.parametrize(("argv", "phrase"), [
    (["certs", "init", "FILE"], "recover certs: 'FILE' is a file, not a folder"),
    (["certs", "init", "DIR/ca", "--days", "99999999"], "--days must be 1..36500, got 99999999"),
    (["certs", "issue", "DIR/ca", "c1", "--role", "controller", "--host", "not a host!"],
     "--host 'not a host!' is neither an IP address nor a DNS name"),
    (["certs", "token", "--subject", "two words"], "--subject 'two words': one word"),
    (["certs", "issue", "DIR/ca", "c1", "--role", "controller", "--host", "999.1.1.1"],
     "--host '999.1.1.1' is neither an IP address nor a DNS name"),
    (["certs", "init", "DIR/ca2", "--name", ""], "the name '' must be 1 to 64 printable"),
    (["certs", "init", "DIR/ca2", "--name", "n" * 65], "must be 1 to 64 printable characters"),
    (["certs", "issue", "DIR/ca", "n" * 65, "--role", "agent"], "must be 1 to 64 printable"),
    (["certs", "issue", "DIR/junk", "a", "--role", "agent"], "the CA in DIR/junk does not load"),
    (["certs", "issue", "DIR/mixed", "a", "--role", "agent"],
     "DIR/mixed/ca-key.pem is not the key of DIR/mixed/ca.pem"),
    (["stop", "--timeout", "-1"], "--timeout: must be a positive number of seconds"),
    (["drain", "host0", "--timeout", "0"], "--timeout: must be a positive number of seconds"),
    (["run", "--job", "/dev/urandom"], "--job '/dev/urandom': not a regular file"),
    (["run", "--job", "DIR"], "not a regular file"),
    (["run", "--checkpoint-dir", "FILE"], "--checkpoint-dir 'FILE' is a file, not a folder"),
    (["run", "--checkpoint-dir", "DIR/ck", "--checkpoint-keep", "9" * 20],
     "--checkpoint-keep must be at most 2147483647"),
    (["run", "--checkpoint-dir", "DIR/ck", "--checkpoint-every", "9" * 20],
     "--checkpoint-every must be at most 2147483647"),
    (["run", "--job", "DIR/job.toml", "--job", "DIR/job.toml"], "--job given 2 times"),
    (["run", "--ckpt-every-steps", "1"], "--ckpt-every-steps is the checkpoint-and-restart "
                                         "baseline's (--mode ckpt-restart)"),
    (["controller", "--checkpoint-dir", "FILE"], "--checkpoint-dir 'FILE' is a file, not a folder"),
], ids=lambda value: value if isinstance(value, str) else None)
def test_inputs_that_used_to_hang_or_trace_back_are_one_line(capsys, tmp_path, argv, phrase):
    """Issue 22 point 5: each of these hung, printed a traceback or was accepted."""
    file = tmp_path / "a-file"
    file.write_text("")
    main(["certs", "init", str(tmp_path / "ca")])  # the CA that `issue` signs with
    main(["certs", "init", str(tmp_path / "other")])
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "ca.pem").write_text("junk\n")
    (tmp_path / "junk" / "ca-key.pem").write_text("junk\n")
    (tmp_path / "job.toml").write_text("[job]\nsteps = 3\n")
    (tmp_path / "mixed").mkdir()  # one CA's certificate, another's key
    (tmp_path / "mixed" / "ca.pem").write_bytes((tmp_path / "ca" / "ca.pem").read_bytes())
    (tmp_path / "mixed" / "ca-key.pem").write_bytes((tmp_path / "other" / "ca-key.pem").read_bytes())
    capsys.readouterr()
    argv = [a.replace("FILE", str(file)).replace("DIR", str(tmp_path)) for a in argv]
    if argv[0] == "run":
        argv += ["--out", str(tmp_path / "out"), "--quiet"]
    code, out, err = run_main(capsys, argv)
    assert code == 2 and out == ""
    assert_one_line(err, phrase.replace("FILE", str(file)).replace("DIR", str(tmp_path)))
    assert not (tmp_path / "ca2").exists()  # a CA refused leaves no folder behind


def test_a_job_file_larger_than_settings_can_be_is_refused(capsys, tmp_path):
    big = tmp_path / "job.toml"
    big.write_text("# padding\n" * 200_000)
    code, _, err = run_main(capsys, ["run", "--job", str(big), "--out", str(tmp_path / "o")])
    assert code == 2
    assert_one_line(err, "a job file is at most 1024 KiB")


def test_server_only_tls_off_loopback_is_refused_unless_insecure(capsys, tmp_path):
    """Issue 22 point 5: TLS without a client CA or tokens looks secured but lets every caller
    act as an agent or operator; on a network address it needs --insecure."""
    from recover.cli.certs import init_ca, issue
    from recover.common.security import Role

    init_ca(tmp_path, "test CA", 1)
    cert, key = issue(tmp_path, "controller", [Role.CONTROLLER], ["127.0.0.1"], 1)
    tls = ["--tls-cert", str(cert), "--tls-key", str(key)]
    code, out, err = run_main(capsys, ["controller", "--host", "0.0.0.0", *tls])
    assert code == 2 and out == ""
    assert_one_line(err, "recover controller: --host 0.0.0.0 with TLS but neither --tls-ca nor "
                         "--token-file would let anyone who reaches it act as an agent")
    # Allowed: said so, on loopback, or with client certificates; the job would start (the
    # fixture refuses to serve, which is how "accepted" shows here).
    for argv in (["--host", "0.0.0.0", *tls, "--insecure"], ["--host", "127.0.0.1", *tls],
                 ["--host", "0.0.0.0", *tls, "--tls-ca", str(tmp_path / "ca.pem")]):
        with pytest.raises(AssertionError, match="the arguments were accepted"):
            main(["controller", *argv])


STORE_ROWS = [  # url, --insecure-store, allowed, phrase of the reason (empty: none)
    ("memory://", False, True, ""),
    ("etcds://192.0.2.1:2379?ca=ca.pem", False, True, ""),
    ("etcd://127.0.0.1:2379", False, True, "anyone on this machine can write the job's keys"),
    ("etcd://192.0.2.1:2379,127.0.0.1:2379", False, False,
     "plaintext etcd on 192.0.2.1 would let anyone who reaches it choose the job's leader"),
    ("etcd://192.0.2.1:2379", True, True, "(--insecure-store): whoever reaches it decides"),
]


@pytest.mark.parametrize(("url", "insecure", "allowed", "phrase"), STORE_ROWS,
                         ids=["memory", "tls", "loopback-warns", "remote-refused",
                              "remote-said-insecure"])
def test_a_plaintext_store_off_this_machine_needs_insecure_store(url, insecure, allowed, phrase):
    """Issue 22 point 2: whoever writes a plaintext etcd chooses the leader (and so what
    every agent runs)."""
    from recover.controller.store_url import store_exposure

    decision = store_exposure(url, insecure_store=insecure,
                              is_loopback=lambda host: host == "127.0.0.1")
    assert decision.allowed is allowed
    assert (phrase in decision.reason) if phrase else decision.reason == ""


def test_the_refusal_is_one_line_before_any_connection(capsys, tmp_path):
    # 192.0.2.1 is a documentation address: the refusal comes before anything reaches it.
    code, out, err = run_main(capsys, ["controller", "--store", "etcd://192.0.2.1:2379"])
    assert code == 2 and out == ""
    assert_one_line(err, "recover controller: --store etcd://192.0.2.1:2379: plaintext etcd on "
                         "192.0.2.1")
    code, out, err = run_main(capsys, ["run", "--store", "etcd://192.0.2.1:2379", "--out",
                                       str(tmp_path / "out"), "--quiet"])
    assert code == 2 and out == ""
    assert_one_line(err, "use etcds:// (TLS)")
