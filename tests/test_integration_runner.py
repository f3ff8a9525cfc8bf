"""The integration-test runner (scripts/integration_tests.py): case selection, baseline
comparison and reporting in-process; a fast subset and a broken baseline through the real
script, which launches real torchrun jobs on gloo."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import re
import shutil
import sys
from pathlib import Path

import pytest

from tests.dist_utils import REPO_ROOT, read_jsonl, run_command
from torchtitan_lite.config import JobConfig

SCRIPT = REPO_ROOT / "scripts" / "integration_tests.py"
BASELINES = REPO_ROOT / "tests" / "assets" / "losses"


def _load_script():
    spec = importlib.util.spec_from_file_location("integration_tests_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being built
    spec.loader.exec_module(module)
    return module


it = _load_script()


def _summary_row(output: str, case: str) -> str:
    rows = [line for line in output.splitlines() if re.match(rf"^{re.escape(case)}\s+\d+\s+(PASS|FAIL|SKIP)", line)]
    assert len(rows) == 1, f"no single summary row for {case}:\n{output}"
    return rows[0]


# --------------------------------------------------------------------------------------------
# The real script, as CI runs it (CPU processes on gloo)
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_fast_subset_passes_and_reports_skips(tmp_path: Path) -> None:
    """One real 2-rank case through the script: a real torchrun job whose losses match the stored
    baseline; a 4-rank case selected beside it is skipped. (Cases of several runs, such as a
    save and a resume, are checked in-process below with stand-in runs.)"""
    result = run_command(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--ngpu", "2",
         "--test_name", "default_reshard,hsdp_2x2", "--test_name", "hsdp_2x2",  # a repeated name runs once
         "--output_dir", str(tmp_path)],
        timeout=240,
    )
    output = f"rc={result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert result.returncode == 0, output
    assert re.search(r"^default_reshard\s+2\s+PASS\s+[\d.]+$", _summary_row(result.stdout, "default_reshard"))
    skip = _summary_row(result.stdout, "hsdp_2x2")
    assert re.search(r"^hsdp_2x2\s+4\s+SKIP\s+-\s+needs 4 ranks, --ngpu 2$", skip), output
    assert "1 passed, 0 failed, 1 skipped" in result.stdout, output
    # Only the selected case ran; its dump folder is kept with its records.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["default_reshard"]
    assert "[default_reshard] run 1/1: python -m torch.distributed.run --nproc_per_node=2" in result.stdout
    records = read_jsonl(tmp_path / "default_reshard" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4], records


def test_broken_baseline_fails_naming_case_and_step(monkeypatch, capsys, tmp_path: Path) -> None:
    """The script's main against a baseline with one loss changed by 1%: the runs (stand-ins
    that write the stored losses, which the real runs reproduce: see the test above) fail the
    case, naming its run and step, and the exit code is 1."""
    baselines = tmp_path / "losses"
    shutil.copytree(BASELINES, baselines)
    path = baselines / "cpu_checkpoint_resume.jsonl"
    stored = read_jsonl(path)
    records = [dict(r) for r in stored]
    records[6]["loss"] *= 1.01  # run 2 step 7, a 1% change: far beyond the CPU tolerance
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    calls = _fake_launcher(monkeypatch, [(0, "", [(r["step"], r["loss"]) for r in stored if r["run"] == run])
                                         for run in (1, 2)])

    code = it.main(["--device", "cpu", "--test_name", "checkpoint_resume", "--baseline_dir", str(baselines),
                    "--output_dir", str(tmp_path / "out")])
    output = capsys.readouterr().out
    assert code == 1, output
    assert [cmd[cmd.index("--training.steps") + 1] for cmd, _ in calls] == ["4", "8"]
    row = _summary_row(output, "checkpoint_resume")
    assert " FAIL " in row, output
    assert "checkpoint_resume: run 2 step 7: expected loss" in row, output
    assert f"{records[6]['loss']:.6f}" in row and f"got {stored[6]['loss']:.6f}" in row, output
    assert "0 passed, 1 failed, 0 skipped" in output, output
    # The unchanged baseline passes the same runs.
    calls = _fake_launcher(monkeypatch, [(0, "", [(r["step"], r["loss"]) for r in stored if r["run"] == run])
                                         for run in (1, 2)])
    assert it.main(["--device", "cpu", "--test_name", "checkpoint_resume", "--baseline_dir", str(BASELINES),
                    "--output_dir", str(tmp_path / "out")]) == 0
    assert "1 passed, 0 failed, 0 skipped" in capsys.readouterr().out


def test_list_runs_as_module() -> None:
    result = run_command([sys.executable, "-m", "scripts.integration_tests", "--list"], timeout=60)
    assert result.returncode == 0, result.stderr
    for case in it.CASES:
        assert f"{case.name}  ({case.ngpu} rank" in result.stdout


def test_unknown_test_name_is_a_usage_error() -> None:
    result = run_command([sys.executable, str(SCRIPT), "--test_name", "default_reshard,nope"], timeout=60)
    assert result.returncode == 2, result.stderr
    assert "unknown case(s) 'nope'" in result.stderr
    assert "default_reshard" in result.stderr  # the known names are listed


# --------------------------------------------------------------------------------------------
# The declared cases and their baselines
# --------------------------------------------------------------------------------------------


def test_cases_cover_the_required_features() -> None:
    names = set(it.case_names())
    assert {"default_reshard", "reshard_never", "reshard_always", "reshard_int_2", "bf16_mixed_precision",
            "cpu_offload", "hsdp_2x2", "gradient_accumulation", "checkpoint_resume",
            "async_checkpoint_resume", "resume_world_size_2_to_4", "seed_checkpoint", "hf_export_import",
            "validation", "context_parallel_2x2", "context_parallel_ulysses_4"} <= names
    assert len(names) == len(it.CASES)


@pytest.mark.parametrize("case", it.CASES, ids=lambda c: c.name)
def test_case_overrides_are_real_config_keys(case) -> None:
    config = JobConfig()
    sections = {f.name: {g.name for g in dataclasses.fields(getattr(config, f.name))}
                for f in dataclasses.fields(config)}
    for run in case.runs:
        for section, key in it.override_keys(run.overrides):
            assert key in sections.get(section, ()), f"{case.name}: --{section}.{key} is not a config key"
    # ngpu is what the case really needs: the most ranks any run uses.
    assert case.ngpu == max(case.nproc(run) for run in case.runs)


@pytest.mark.parametrize("case", it.CASES, ids=lambda c: c.name)
def test_cpu_baseline_exists_and_is_well_formed(case) -> None:
    records = read_jsonl(BASELINES / f"cpu_{case.name}.jsonl")
    assert records
    keys = [(r["run"], r["step"]) for r in records]
    assert keys == sorted(keys) and len(set(keys)) == len(keys)
    assert {r["run"] for r in records} <= set(range(1, len(case.runs) + 1))
    for r in records:
        assert set(r) <= {"run", "step", "loss", "validation_loss"}
        assert 0 < r["loss"] < 10


def test_default_job_baseline_learns() -> None:
    """The README's default job (the ``debug_model_default`` case, 100 steps through torchrun on 2
    ranks, which the runner compares with this baseline): a loss record at step 1 and every 10
    steps, clearly below a uniform guess over the byte vocabulary, validation at 50 and 100."""
    case = next(c for c in it.CASES if c.name == "debug_model_default")
    assert case.config_file == "train_configs/debug_model.toml" and case.runs == [it.Run([])]
    records = read_jsonl(BASELINES / "cpu_debug_model_default.jsonl")
    assert [r["step"] for r in records] == [1, *range(10, 101, 10)]
    losses = [r["loss"] for r in records]
    uniform = math.log(258)
    assert losses[-1] < uniform - 2.5 and losses[-1] < losses[0] - 2.5, losses
    validation = {r["step"]: r["validation_loss"] for r in records if "validation_loss" in r}
    assert sorted(validation) == [50, 100] and validation[100] < validation[50] < uniform, validation


def test_test_case_rejects_a_run_wider_than_its_ngpu() -> None:
    with pytest.raises(ValueError, match="run 2 uses 4 processes"):
        it.TestCase("x", "x", [[], it.Run([], nproc=4)], ngpu=2)
    case = it.TestCase("x", "x", [["--a.b", "1"]], ngpu=2)
    assert case.runs == [it.Run(["--a.b", "1"])] and case.nproc(case.runs[0]) == 2


# --------------------------------------------------------------------------------------------
# Selection
# --------------------------------------------------------------------------------------------


def _cases():
    return [it.TestCase("one", "", [[]], ngpu=1), it.TestCase("two", "", [[]], ngpu=2),
            it.TestCase("four", "", [[]], ngpu=4)]


def test_select_by_ngpu_reports_skips_with_reason() -> None:
    run, skipped = it.select_cases(_cases(), names=None, ngpu=2)
    assert [c.name for c in run] == ["one", "two"]
    assert [(c.name, reason) for c, reason in skipped] == [("four", "needs 4 ranks, --ngpu 2")]


def test_select_by_name_keeps_declared_order() -> None:
    names = it.parse_test_names(["four,one", " two ", "one"])
    assert names == ["four", "one", "two"]
    run, skipped = it.select_cases(_cases(), names=["four", "one"], ngpu=8)
    assert [c.name for c in run] == ["one", "four"] and skipped == []
    run, skipped = it.select_cases(_cases(), names=["four"], ngpu=1)
    assert run == [] and [c.name for c, _ in skipped] == ["four"]


def test_select_unknown_name_raises() -> None:
    with pytest.raises(ValueError, match=r"unknown case\(s\) 'five'.*known: one, two, four"):
        it.select_cases(_cases(), names=["one", "five"], ngpu=4)


# --------------------------------------------------------------------------------------------
# Baseline comparison
# --------------------------------------------------------------------------------------------


def _records(losses, run=1, first_step=1):
    return [{"run": run, "step": first_step + i, "loss": x} for i, x in enumerate(losses)]


def test_compare_equal_and_within_tolerance() -> None:
    expected = _records([6.0, 5.5, 5.0])
    assert it.compare_losses(expected, expected, rtol=0) is None
    assert it.compare_losses(expected, _records([6.0 * (1 + 5e-5), 5.5, 5.0]), rtol=1e-4) is None


def test_compare_names_first_differing_step() -> None:
    diff = it.compare_losses(_records([6.0, 5.5, 5.0]), _records([6.0, 5.6, 4.0]), rtol=1e-4)
    assert diff.startswith("run 1 step 2: expected loss 5.500000, got 5.600000")
    assert "> rtol 0.0001" in diff


def test_compare_missing_and_extra_records() -> None:
    expected = _records([6.0, 5.5]) + _records([5.2, 5.1], run=2, first_step=3)
    diff = it.compare_losses(expected, _records([6.0, 5.5]), rtol=1e-4)
    assert "2 loss records, baseline has 4" in diff and "run 2: 3,4" in diff
    diff = it.compare_losses(expected, _records([6.0, 5.5]) + _records([5.2, 5.1], run=2, first_step=1),
                             rtol=1e-4)
    assert diff.startswith("run 2 step 3: expected a record for it, got run 2 step 1")


def test_compare_nan_and_validation_loss() -> None:
    assert "got nan" in it.compare_losses(_records([6.0]), _records([float("nan")]), rtol=1.0)
    expected = [{"run": 1, "step": 2, "loss": 5.0, "validation_loss": 5.3}]
    assert it.compare_losses(expected, [{"run": 1, "step": 2, "loss": 5.0, "validation_loss": 5.3}],
                             rtol=1e-4) is None
    diff = it.compare_losses(expected, [{"run": 1, "step": 2, "loss": 5.0, "validation_loss": 5.4}], rtol=1e-4)
    assert diff.startswith("run 1 step 2: expected validation_loss 5.300000, got 5.400000")
    diff = it.compare_losses(expected, [{"run": 1, "step": 2, "loss": 5.0}], rtol=1e-4)
    assert "expected validation_loss 5.300000, got none" in diff


def test_loss_records_keep_run_step_and_losses_only() -> None:
    metrics = [{"step": 3, "run_id": "x", "loss": 5.0, "grad_norm": 1.0, "validation_loss": None},
               {"step": 4, "run_id": "x", "loss": 4.0, "validation_loss": 4.5}]
    assert it.loss_records(metrics, run=2) == [
        {"run": 2, "step": 3, "loss": 5.0}, {"run": 2, "step": 4, "loss": 4.0, "validation_loss": 4.5}]


# --------------------------------------------------------------------------------------------
# run_case with a stand-in for the launch: baselines, failures and the summary
# --------------------------------------------------------------------------------------------


def _fake_launcher(monkeypatch, outcomes):
    """Each call appends its losses to metrics.jsonl and returns its (exit code, stderr)."""
    calls = []

    def fake_run_process(cmd, *, env, timeout, log_prefix):
        code, stderr, losses = outcomes[len(calls)]
        calls.append((cmd, env))
        dump = Path(cmd[cmd.index("--job.dump_folder") + 1])
        with open(dump / "metrics.jsonl", "a") as f:
            for step, loss in losses:
                f.write(json.dumps({"step": step, "run_id": "r", "loss": loss, "validation_loss": None}) + "\n")
        return code, stderr

    monkeypatch.setattr(it, "run_process", fake_run_process)
    return calls


def _run(case, tmp_path, *, generate=False, rtol=None):
    return it.run_case(case, device="cpu", config_file=tmp_path / "base.toml", output_dir=tmp_path / "out",
                       baseline_dir=tmp_path / "losses", generate=generate, rtol=rtol, timeout=5)


def test_run_case_generates_then_compares_all_runs(monkeypatch, tmp_path: Path) -> None:
    case = it.TestCase("resume", "", [it.Run(["--x.y", "{dump}/a"], nproc=1), it.Run([], nproc=2)], ngpu=2)
    outcomes = [(0, "", [(1, 6.0), (2, 5.0)]), (0, "", [(3, 4.0)])]
    calls = _fake_launcher(monkeypatch, outcomes)

    missing = _run(case, tmp_path)
    assert missing.status == "FAIL"
    assert "resume: no baseline" in missing.reason and "--generate_baselines --device cpu" in missing.reason

    calls.clear()
    generated = _run(case, tmp_path, generate=True)
    assert generated.status == "PASS"
    assert read_jsonl(tmp_path / "losses" / "cpu_resume.jsonl") == [
        {"run": 1, "step": 1, "loss": 6.0}, {"run": 1, "step": 2, "loss": 5.0}, {"run": 2, "step": 3, "loss": 4.0}]
    dump = str((tmp_path / "out" / "resume").resolve())
    (cmd1, env), (cmd2, _) = calls
    assert "--nproc_per_node=1" in cmd1 and "--nproc_per_node=2" in cmd2
    assert cmd1[-2:] == ["--x.y", f"{dump}/a"]  # {dump} replaced
    assert cmd1[cmd1.index("--job.dump_folder") + 1] == dump
    assert env["OMP_NUM_THREADS"] == "1" and env["CUDA_VISIBLE_DEVICES"] == ""

    calls.clear()
    assert _run(case, tmp_path).status == "PASS"  # a fresh dump folder each time
    calls.clear()
    outcomes[1] = (0, "", [(3, 4.1)])
    failed = _run(case, tmp_path)
    assert failed.status == "FAIL"
    assert failed.reason.startswith("resume: run 2 step 3: expected loss 4.000000, got 4.100000")
    calls.clear()
    assert _run(case, tmp_path, rtol=0.05).status == "PASS"


def test_run_case_reports_exit_code_and_error_line(monkeypatch, tmp_path: Path) -> None:
    stderr = (
        "[rank1]: Traceback (most recent call last):\n"
        "[rank1]:   File \"x.py\", line 1, in <module>\n"
        "[rank1]: RuntimeError: No backend type associated with device type cpu\n"
        "E1121 22:17:10.632000 22661 api.py:1002] failed (exitcode: 1) local_rank: 1\n"
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
        "============================================================\n"
        "  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html\n"
        "============================================================\n"
    )
    case = it.TestCase("offload", "", [[], []], ngpu=2)
    _fake_launcher(monkeypatch, [(0, "", [(1, 6.0)]), (1, stderr, [])])
    result = _run(case, tmp_path)
    assert result.status == "FAIL"
    assert result.reason == ("offload: run 2/2 exited with code 1: "
                             "RuntimeError: No backend type associated with device type cpu")

    _fake_launcher(monkeypatch, [(None, "", [])])
    result = _run(it.TestCase("hang", "", [[]], ngpu=2), tmp_path)
    assert result.status == "FAIL" and result.reason.startswith("hang: run 1/1 timed out after 5 s")


def test_last_error_line_prefers_the_ranks_error() -> None:
    assert it.last_error_line("error: training.steps: invalid value 'x'\nW1121 closing\n"
                              "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n====\n"
                              ) == "error: training.steps: invalid value 'x'"
    assert it.last_error_line("just a line\n\n") == "just a line"
    assert it.last_error_line("") == "(stderr is empty)"


def test_summary_table() -> None:
    table = it.format_summary([it.CaseResult("default_reshard", 2, "PASS", 7.31),
                               it.CaseResult("hsdp_2x2", 4, "SKIP", 0.0, "needs 4 ranks, --ngpu 2"),
                               it.CaseResult("validation", 2, "FAIL", 3.0, "validation: run 1 step 2: ...")])
    lines = table.splitlines()
    assert lines[0].split() == ["case", "ranks", "result", "seconds", "reason"]
    assert lines[2].split() == ["default_reshard", "2", "PASS", "7.3"]
    assert lines[3].split(None, 4) == ["hsdp_2x2", "4", "SKIP", "-", "needs 4 ranks, --ngpu 2"]
    assert "validation: run 1 step 2" in lines[4]
    assert lines[-1] == "1 passed, 1 failed, 1 skipped in 10.3 s"


def test_run_process_timeout_kills_the_whole_group(tmp_path: Path) -> None:
    """A hanging run is killed with every process it started (torchrun and its ranks)."""
    import os
    import time

    if not Path("/proc/self/stat").exists():
        pytest.skip("needs /proc to see the state of the killed process")
    pid_file = tmp_path / "child.pid"
    started = time.monotonic()
    code, _ = it.run_process(["bash", "-c", f"sleep 60 & echo $! > {pid_file}; wait"], env=dict(os.environ),
                             timeout=1, log_prefix=tmp_path / "run1")
    # Hang bound: killed at the 1 s timeout, long before the 60 s sleep would have ended.
    assert code is None and time.monotonic() - started < 30
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        stat = Path(f"/proc/{child}/stat")
        if not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"process {child} of the timed-out run is still alive")
    assert (tmp_path / "run1.stdout.log").exists() and (tmp_path / "run1.stderr.log").exists()


# --------------------------------------------------------------------------------------------
# Restarts: a run's own launch (script, torchrun options, environment), repeated steps, a case's
# own check, --repeat
# --------------------------------------------------------------------------------------------


def test_loss_records_keep_the_last_record_of_a_step_logged_again() -> None:
    """A run whose workers torchrun restarted logs the steps after its checkpoint again; the
    records kept are the last ones (those the run's final weights descend from), in step order."""
    metrics = [{"step": s, "loss": float(s)} for s in (1, 2, 3)] + [{"step": s, "loss": s + 0.5} for s in (3, 4)]
    assert it.loss_records(metrics, run=1) == [
        {"run": 1, "step": 1, "loss": 1.0}, {"run": 1, "step": 2, "loss": 2.0},
        {"run": 1, "step": 3, "loss": 3.5}, {"run": 1, "step": 4, "loss": 4.5}]


def test_run_case_launches_a_runs_script_with_its_torchrun_options_and_environment(
        monkeypatch, tmp_path: Path) -> None:
    seen = []
    case = it.TestCase("killed", "", [it.Run(["--training.steps", "2"], script="tests/kill_at_step.py",
                                             torchrun_args=["--max-restarts=2"], env={"KILL_AT_STEP": "2"})],
                       check=lambda runs, device: seen.append((runs, device)) or "no restart seen")
    calls = _fake_launcher(monkeypatch, [(0, "", [(1, 6.0), (1, 6.0), (2, 5.0)])])
    result = _run(case, tmp_path, generate=True)
    (cmd, env), = calls
    entry = cmd.index(str(REPO_ROOT / "tests" / "kill_at_step.py"))
    assert cmd[entry - 1] == "--max-restarts=2" and "-m" not in cmd[entry:]
    assert cmd[entry + 1] == "--job.config_file" and cmd[-2:] == ["--training.steps", "2"]
    assert env["KILL_AT_STEP"] == "2" and env["OMP_NUM_THREADS"] == "1"
    # The case's check sees every record as logged; its finding fails the case, and no baseline
    # is written from a run that failed it.
    (runs, device), = seen
    assert [[r["step"] for r in run] for run in runs] == [[1, 1, 2]] and device == "cpu"
    assert result.status == "FAIL" and result.reason == "killed: no restart seen"
    assert not (tmp_path / "losses" / "cpu_killed.jsonl").exists()


def _restart_runs(*, restarted_loss: float | None = None, restart: bool = True) -> list[list[dict]]:
    full = [{"step": s, "loss": 6.0 - s / 10} for s in range(1, 31)]
    again = [dict(r) for r in full[10:]]
    if restarted_loss is not None:
        again[5]["loss"] = restarted_loss  # step 16
    return [full, full[:11] + again if restart else [dict(r) for r in full]]


def test_restart_case_check_wants_the_restart_and_the_uninterrupted_losses() -> None:
    case = next(c for c in it.CASES if c.name == "restart_after_kill")
    assert case.runs[1].torchrun_args == ["--max-restarts=2"] and case.runs[1].script == "tests/kill_at_step.py"
    assert case.runs[1].env == {"KILL_RANK": "1", "KILL_AT_STEP": "12"}
    assert case.check(_restart_runs(), "cpu") is None
    assert case.check(_restart_runs(restart=False), "cpu") == (
        "run 2 logged steps 1-30, expected 1-11 and, after the restart from step 10, 11-30")
    near = 6.0 - 1.6 + 1e-7
    assert case.check(_restart_runs(restarted_loss=near), "cpu") == (
        f"run 2 after its restart, step 16: loss {near!r}, the uninterrupted run 1's 4.4 (bit for bit)")
    assert case.check(_restart_runs(restarted_loss=near), "cuda") is None  # within cuda's rtol


def test_repeat_passes_only_when_every_repeat_passed(monkeypatch, capsys, tmp_path: Path) -> None:
    outcomes = iter(["PASS", "FAIL", "PASS"])

    def fake_run_case(case, *, output_dir, **kwargs):
        status = next(outcomes)
        return it.CaseResult(case.name, case.ngpu, status, 1.0, "" if status == "PASS" else f"bad in {output_dir.name}")

    monkeypatch.setattr(it, "run_case", fake_run_case)
    code = it.main(["--device", "cpu", "--test_name", "default_reshard", "--repeat", "3",
                    "--output_dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 1
    assert "[default_reshard] repeat 2/3 FAIL in 1.0 s: bad in repeat-2" in out
    assert re.search(r"^default_reshard\s+2\s+FAIL\s+3\.0\s+2/3 repeats passed; repeat 2: bad in repeat-2$",
                     _summary_row(out, "default_reshard")), out
    with pytest.raises(SystemExit):
        it.main(["--repeat", "2", "--generate_baselines"])
