"""Job settings: the workload command, the built-in GPT's flags, job files (cli/jobargs.py,
cli/jobfile.py). Mistakes are one line and exit code 2; nothing here starts a job."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recover.cli import jobfile
from recover.cli.jobargs import job_from_args, job_to_args
from recover.cli.main import build_parser, job_parser
from recover.proto import pb
from tests.unit.test_cli_args import assert_one_line, no_launch, run_main  # noqa: F401 (autouse)

JOB_FILE = """
[job]
replicas = 3
steps = 12
global_microbatches = 9
reduce = "exact"
seed = 5
record_sample_ids = true

[workload]
command = ["python", "train.py", "--hidden", "64"]
config = { lr = 0.001, layers = [1, 2] }

[testing]
kill = ["step=3,replica=1,phase=backward"]
compute_ms = 5
"""


def parse(argv: list[str], command: str = "controller") -> pb.JobConfig:
    parser = build_parser()
    jobfile.apply(job_parser(parser, (command,)), argv)
    return job_from_args(parser.parse_args([command, *argv]))


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return str(path)


def test_a_command_after_dashes_is_the_workload() -> None:
    job = parse(["-R", "2", "--", "python", "train.py", "--lr", "1e-3", "--replicas", "9"])
    assert list(job.workload.command) == ["python", "train.py", "--lr", "1e-3", "--replicas", "9"]
    assert job.replicas == 2  # flags after -- belong to the script


def test_without_a_command_the_builtin_gpt_runs_with_its_flags() -> None:
    job = parse(["-B", "4", "--n-layer", "3"])
    command = list(job.workload.command)
    assert command[:3] == ["python", "-m", "recover.workloads.tinygpt"]
    assert command[command.index("--microbatch-size") + 1] == "4"
    assert command[command.index("--n-layer") + 1] == "3"


def test_job_to_args_round_trips_command_config_and_ledger_settings() -> None:
    job = parse(["--record-sample-ids", "--reduce", "exact", "--workload-config", '{"a": [1, 2]}',
                 "--", "python", "x.py", "--", "-weird"])
    assert job.check_determinism and job.record_sample_ids
    again = parse(job_to_args(job))
    assert again == job
    assert json.loads(again.workload.config_json) == {"a": [1, 2]}


@pytest.mark.parametrize(("flags", "gradient", "batch"), [
    (["--reduce", "exact"], True, True),
    ([], False, True),  # fast mode: the batch is loaded twice and compared, nothing computed
    (["--check-determinism"], True, True),
    (["--reduce", "exact", "--no-check-determinism"], False, False),
    (["--no-check-determinism"], False, False),
])
def test_the_determinism_check_by_mode(flags: list[str], gradient: bool, batch: bool) -> None:
    job = parse(flags)
    assert job.check_determinism is gradient
    assert (job.check_determinism or not job.skip_batch_check) is batch
    assert parse(job_to_args(job)) == job  # and back to the same flags


def test_a_job_file_sets_every_kind_of_setting(tmp_path: Path) -> None:
    job = parse(["--job", write(tmp_path, JOB_FILE)])
    assert (job.replicas, job.steps, job.global_microbatches, job.reduce, job.seed) == (
        3, 12, 9, "exact", 5)
    assert job.record_sample_ids and job.check_determinism
    assert list(job.workload.command) == ["python", "train.py", "--hidden", "64"]
    assert json.loads(job.workload.config_json) == {"layers": [1, 2], "lr": 0.001}
    assert [(f.step, f.replica, f.phase) for f in job.testing.faults] == [(3, 1, "backward")]
    assert job.testing.compute_ms == 5.0


def test_flags_win_over_the_job_file(tmp_path: Path) -> None:
    path = write(tmp_path, JOB_FILE)
    job = parse(["--job", path, "--steps", "20", "--kill", "step=4,replica=0,phase=forward",
                 "--", "python", "other.py"])
    assert job.steps == 20 and job.replicas == 3
    assert list(job.workload.command) == ["python", "other.py"]
    assert [f.step for f in job.testing.faults] == [3, 4]  # --kill adds to the file's


def test_a_job_file_can_configure_the_builtin_gpt(tmp_path: Path) -> None:
    path = write(tmp_path, "[workload]\nmicrobatch_size = 2\nlr = 0.5\n")
    job = parse([f"--job={path}"])
    command = list(job.workload.command)
    assert command[command.index("--lr") + 1] == "0.5"


def test_a_job_file_carries_credentials_for_the_controller(tmp_path: Path) -> None:
    path = write(tmp_path, '[security]\ntls_cert = "c.pem"\ntls_key = "k.pem"\n'
                           'tls_ca = "ca.pem"\ntoken_file = "tokens"\n')
    parser = build_parser()
    jobfile.apply(job_parser(parser, ("controller",)), ["--job", path])
    args = parser.parse_args(["controller", "--job", path, "--tls-ca", "other.pem"])
    assert (args.tls_cert, args.tls_key, args.tls_ca, args.token_file) == (
        "c.pem", "k.pem", "other.pem", "tokens")
    run_parser = build_parser()
    jobfile.apply(job_parser(run_parser, ("run",)), ["--job", write(tmp_path, "[security]\ntls = true\n")])
    assert run_parser.parse_args(["run"]).tls is True


@pytest.mark.parametrize("text, phrase", [
    ("[jobs]\nsteps = 3\n", "unknown section(s) ['jobs']"),
    ("[job]\nstep = 3\n", "unknown key(s) ['step'] in [job]"),
    ("[job]\nsteps = 'many'\n", "[job] steps: expected a whole number"),
    ("[job]\nsteps = 0\n", "[job] steps: must be at least 1"),
    ("[job]\nreduce = 'exactly'\n", "[job] reduce must be one of fast, exact"),
    ("[job]\nrecord_sample_ids = 1\n", "[job] record_sample_ids must be true or false"),
    ("[job]\nreplicas = [1]\n", "[job] replicas must be a single value"),
    ("[workload]\ncommand = 'python x.py'\n", "[workload] command must be a list of strings"),
    ("[workload]\ncommand = []\n", "[workload] command is empty"),
    ("[workload]\nconfig = 3\n", "[workload] config must be a table"),
    ("[workload]\ncommand = ['python', 'x.py']\nlr = 0.1\n", "has a command and built-in GPT"),
    ("[testing]\nkill = 'step=1'\n", "[testing] kill must be a list of strings"),
    ("[security]\ntls = true\n", "[security] tls: `recover controller` has no such option"),
    ("[security]\ntls_ca = 3\n", "[security] tls_ca must be a string"),
    ("job = 3\n", "[job] must be a table"),
    ("[job\n", "not valid TOML"),
    # Checks across settings name the file's keys, not the flags they stand for.
    ("[job]\nglobal_microbatches = 3\nreplicas = 4\n",
     "[job] global_microbatches (3) must be at least [job] replicas (4)"),
    ("[testing]\nkill = ['bogus']\n", "malformed [testing] kill 'bogus'"),
    ("[job]\ncheckpoint_keep = 5\n", "[job] checkpoint_keep goes with --checkpoint-dir"),
])
def test_job_file_mistakes_are_one_line(capsys, tmp_path: Path, text: str, phrase: str) -> None:
    code, out, err = run_main(capsys, ["controller", "--job", write(tmp_path, text)])
    assert code == 2 and out == ""
    assert_one_line(err, phrase)


@pytest.mark.parametrize("given", [["--replicas=4"], ["-R4"], ["--repl", "4"]])
def test_a_mistake_names_the_flag_where_the_command_line_gave_it(capsys, tmp_path: Path,
                                                                 given: list[str]) -> None:
    # The file sets replicas too; the command line's value, in any spelling, wins and keeps
    # its flag's name.
    path = write(tmp_path, "[job]\nglobal_microbatches = 3\nreplicas = 2\n")
    code, _, err = run_main(capsys, ["controller", "--job", path, *given])
    assert code == 2
    assert_one_line(err, f"[job] global_microbatches (3) must be at least --replicas (4): every "
                         f"replica needs a microbatch (in --job {path!r})")


def test_a_missing_job_file_is_one_line(capsys, tmp_path: Path) -> None:
    code, _, err = run_main(capsys, ["run", "--job", str(tmp_path / "nope.toml")])
    assert code == 2
    assert_one_line(err, "no such file")


@pytest.mark.parametrize("argv, phrase", [
    (["--seed", "99999999999999999999999"], "--seed must fit in 64 bits"),
    (["--steps", "10000000000000000"], "--steps must be at most"),
    (["--vocab-size", "1"], "--vocab-size must be in [2, 1048576], got 1"),
    (["--seq-len", "100000000"], "--seq-len must be in [1, 65536]"),
    (["--n-embd", "65536", "--n-head", "1", "--n-layer", "64"], "parameters (limit"),
    (["--reduce", "exact", "--reduce-dtype", "float32"], "--reduce-dtype applies to --reduce fast"),
    (["--workload-config", "nope"], "--workload-config is not JSON"),
    (["--workload-config", "[1]"], "--workload-config must be a JSON object"),
    (["stray"], "unexpected argument 'stray': the worker command goes after `--`"),
    (["-B", "4", "--", "python", "train.py"], "--microbatch-size configure the built-in GPT"),
    (["--", "no-such-program-here", "x"], "'no-such-program-here' is not a program on PATH"),
    (["--", "python", "missing_script.py"], "no script 'missing_script.py'"),
])
def test_workload_mistakes_are_one_line(capsys, tmp_path: Path, argv: list[str],
                                        phrase: str) -> None:
    code, out, err = run_main(capsys, ["run", "--out", str(tmp_path / "out"), "--quiet", *argv])
    assert code == 2 and out == ""
    assert_one_line(err, phrase)
