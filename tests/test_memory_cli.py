"""``python -m torchtitan_lite.memory``'s command line: its own options' mistakes (one line each,
with the option meant), the table's "peak in" column, and ``--longest_seq_len`` below 1,024 tokens.
(Its estimates against the allocator: tests/test_memory_estimate.py.)"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from tests.dist_utils import REPO_ROOT
from torchtitan_lite.memory import cli, longest
from torchtitan_lite.memory.estimate import CATEGORY_NAMES, MemoryEstimate

GRPO_TOY = str(REPO_ROOT / "train_configs" / "grpo_toy.toml")
MIB = 2**20


def _errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> list[str]:
    """The lines ``main(argv)`` prints on stderr, having exited 2 with nothing on stdout."""
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "", captured.out
    lines = captured.err.splitlines()
    assert lines and all(line.startswith("error: ") for line in lines), lines
    return [line.removeprefix("error: ") for line in lines]


@pytest.mark.parametrize("argv, line", [
    # A misspelt option of the command's own, with its value: one line, the option meant.
    (["--world_size", "2", "--device_memory_gb", "80"], "unknown option '--device_memory_gb'; did you mean "
                                                        "'--device_memory_gib'?"),
    (["--world_size", "2", "--longest_seq_lenn"], "unknown option '--longest_seq_lenn'; did you mean "
                                                  "'--longest_seq_len'?"),
    (["--world_size", "2", "--longest-seq-len"], "unknown option '--longest-seq-len'; did you mean "
                                                 "'--longest_seq_len'?"),
    (["--world_size", "2", "--device_typ=cpu"], "unknown option '--device_typ'; did you mean '--device_type'?"),
    # The misspelt --world_size is the mistake: not also "--world_size missing".
    (["--world_sise", "2"], "unknown option '--world_sise'; did you mean '--world_size'?"),
    # A job setting without its section: the one key of that name.
    (["--world_size", "2", "--memory_budget_gib", "3"], "unknown option '--memory_budget_gib'; did you mean "
                                                        "'--parallelism.memory_budget_gib'?"),
    # Nothing close: the command's own options, and where the rest go.
    (["--world_size", "2", "--budget_gib", "3"], "unknown option '--budget_gib'; this command's own are "
                                                 "--world_size, --ranks_per_node, --device_type, --device_memory_gib, "
                                                 "--host_memory_gib, --json, --longest_seq_len and every other is a "
                                                 "job setting, --section.key value (see --help)"),
    # Bad values: the option, the value, what is allowed.
    (["--world_size", "two"], "--world_size: invalid value 'two'; expected an integer >= 1"),
    (["--world_size", "2", "--device_type", "tpu"], "--device_type: invalid value 'tpu'; expected one of cuda, cpu "
                                                    "(where the job will run)"),
    (["--world_size", "2", "--device_memory_gib=0"], "--device_memory_gib: invalid value '0'; expected a number > 0"),
    (["--world_size", "2", "--longest_seq_len", "5"], "--longest_seq_len: takes no value (got '5'); give "
                                                      "--longest_seq_len alone"),
    (["--world_size", "2", "--json"], "--json: expects a value (PATH)"),
    (["--world_size", "--longest_seq_len"], "--world_size: expects a value (N)"),
    (["--training.seq_len", "64"], "--world_size: missing; expected the ranks of the job, an integer >= 1 (e.g. "
                                   "--world_size 8)"),
])
def test_each_mistake_of_the_commands_own_options_is_one_line(argv: list[str], line: str,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert _errors(["--job.config_file", GRPO_TOY, *argv], capsys) == [line]


def test_every_mistake_of_a_command_line_at_once(capsys: pytest.CaptureFixture[str]) -> None:
    """Own options' and the job's mistakes together, one line each: the command's own first, in the
    order given, then the job config's (as the config reports them)."""
    lines = _errors(["--world_size", "two", "--device_type", "tpu", "--devise_memory_gib", "8",
                     "--training.seq_len", "abc", "--training.stepz", "3"], capsys)
    assert len(lines) == 5, lines
    assert lines[0].startswith("--world_size: invalid value 'two'")
    assert lines[1].startswith("--device_type: invalid value 'tpu'")
    assert lines[2] == "unknown option '--devise_memory_gib'; did you mean '--device_memory_gib'?"
    config = sorted(lines[3:])
    assert config[0].startswith("training.seq_len: invalid value 'abc'"), lines
    assert config[1].startswith("unknown key 'training.stepz'") and "did you mean 'training.steps'?" in config[1]


def _estimate(where: tuple[str, str] = ("backward", ""), peak: int = 0) -> MemoryEstimate:
    zeros = dict.fromkeys(CATEGORY_NAMES, 0)
    return MemoryEstimate(
        world_size=2, dp_replicate=1, dp_shard=2, reshard_after_forward_mode="default", param_dtype="float32",
        reduce_dtype="float32", cpu_offload=False, local_batch_size=1, seq_len=8, grad_accum_steps=1,
        optimizer="AdamW", peak=peak, peak_phase=where[0], peak_module=where[1], categories=zeros, device_peak=peak,
        device_peak_phase=where[0], device_peak_module=where[1], device_categories=zeros, cpu_peak=0)


def test_peak_in_column_shows_whole_module_names() -> None:
    """The "peak in" column is as wide as its longest entry: a block's linear whole, the parenthesis
    closed, and the fits column after it on every row."""
    long = ("backward", "layers.22.feed_forward.w2")
    estimates = [_estimate(long), _estimate(("optimizer", ""))]
    for table in (cli._table(estimates, "default", 2**30, ("MiB", MIB)),
                  cli._stage_table(estimates, "default", 2**30, ("MiB", MIB))):
        lines = table.splitlines()
        assert lines[2].rstrip().endswith("backward (layers.22.feed_forward.w2) yes"), lines
        assert lines[3].rstrip().endswith("yes") and " optimizer " in lines[3], lines
        assert len({line.rstrip().rindex(" ") for line in lines[1:]}) == 1, lines  # the last column aligned


def _stub_estimates(monkeypatch: pytest.MonkeyPatch, peak_of: Any) -> list[int]:
    """The CLI's estimates replaced by ones whose device peak is ``peak_of(seq_len)``; returns the
    lengths estimated, as they come. (What is checked is the search over real plans of the job.)"""
    estimated: list[int] = []

    def stub(spec: Any, args: Any, shape: Any, *, reshard_after_forward_mode: Any, **fields: Any) -> MemoryEstimate:
        estimated.append(shape.seq_len)
        return _estimate(peak=int(peak_of(shape.seq_len)))

    monkeypatch.setattr(longest, "estimate_memory", stub)  # (the search's)
    monkeypatch.setattr(cli, "estimate_memory", stub)  # (the table's)
    return estimated


_TRIED = re.compile(r"^seq_len (\d+): estimated peak ([\d.]+) GiB per rank, (fits|does not fit)$", re.M)


def test_longest_seq_len_searches_below_1024_tokens(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """train_configs/grpo_toy.toml (8 tokens) on a device of 0.5 GiB (budget 0.45 GiB), its peak
    1 MiB a token: 1,024 tokens do not fit, so the search halves below them (512 does not either,
    256 fits) and bisects to 1/8 of the length: 448 tokens."""
    estimated = _stub_estimates(monkeypatch, lambda seq_len: seq_len * MIB)
    assert cli.main(["--job.config_file", GRPO_TOY, "--world_size", "2", "--device_memory_gib", "0.5",
                     "--longest_seq_len"]) == 0
    out = capsys.readouterr().out
    tried = [(int(n), verdict == "fits") for n, _, verdict in _TRIED.findall(out)]
    assert tried == [(1024, False), (512, False), (256, True), (384, True), (448, True), (480, False)], out
    assert [n for n, _ in tried] == estimated
    assert out.splitlines()[-1].startswith("longest seq_len that fits: 448 tokens (448 per rank; 6 estimates in"), out
    assert "on CUDA devices" in out.splitlines()[0]


def test_longest_seq_len_says_in_one_line_when_not_even_the_shortest_length_fits(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The toy's completions are 2 tokens (grpo.max_completion_length), so its shortest sequence is
    3: with every length over the budget the search goes down to 3 tokens, and no shorter, and
    says so in one line."""
    estimated = _stub_estimates(monkeypatch, lambda seq_len: (seq_len + 100) * MIB)
    assert cli.main(["--job.config_file", GRPO_TOY, "--world_size", "2", "--device_memory_gib", "0.1",
                     "--longest_seq_len"]) == 0
    out = capsys.readouterr().out
    assert estimated == [1024, 512, 256, 128, 64, 32, 16, 8, 4, 3], out
    assert out.splitlines()[-1].startswith("no seq_len fits: even 3 tokens, the shortest this job allows, need "
                                           "0.10 GiB per rank, over the budget of 0.0900 GiB (10 estimates in"), out


def test_longest_seq_len_tries_only_lengths_context_and_tensor_parallel_split(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Context parallel 3 (6 chunks a sequence) × tensor parallel 2 on 6 ranks: every length tried
    is a multiple of 6 (from 1,026 down), planned for a CPU job (--device_type cpu)."""
    estimated = _stub_estimates(monkeypatch, lambda seq_len: seq_len * MIB)
    assert cli.main(["--model.flavor", "debugmodel", "--world_size", "6", "--parallelism.context_parallel_degree", "3",
                     "--parallelism.tensor_parallel_degree", "2", "--training.seq_len", "240", "--device_memory_gib",
                     "0.25", "--device_type", "cpu", "--longest_seq_len"]) == 0
    out = capsys.readouterr().out
    assert estimated[0] == 1026 and all(n % 6 == 0 for n in estimated), estimated
    found = int(re.search(r"^longest seq_len that fits: (\d+) tokens", out, re.M).group(1))
    fitting = [n for n in estimated if n * MIB <= 0.9 * 0.25 * 2**30]
    assert found == max(fitting) and found < 1026 and found % 6 == 0
    assert any(n > found and n - found <= found // 8 for n in estimated), estimated  # to 1/8 of the length
    assert "as CPU processes" in out.splitlines()[0], out


@pytest.mark.slow
def test_longest_seq_len_of_a_real_estimate_below_1024_tokens(capsys: pytest.CaptureFixture[str]) -> None:
    """The tiny Llama, one row, estimated for real on a device of 5 MiB: the longest length that
    fits is under 1,024 tokens (the job's own 8 fit), every length tried that fits is shorter than
    every one that does not, and the next length tried above the answer is within 1/8 of it."""
    assert cli.main(["--model.flavor", "tiny", "--training.local_batch_size", "1", "--training.seq_len", "8",
                     "--world_size", "2", "--device_memory_gib", str(5 / 1024), "--longest_seq_len"]) == 0
    out = capsys.readouterr().out
    tried = [(int(n), verdict == "fits") for n, _, verdict in _TRIED.findall(out)]
    found = int(re.search(r"^longest seq_len that fits: (\d+) tokens", out, re.M).group(1))
    assert tried[0] == (1024, False) and 8 <= found < 1024, out
    assert found == max(n for n, ok in tried if ok) < min(n for n, ok in tried if not ok) <= found + found // 8, out


def test_cli_says_which_device_it_planned_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """The first line and a note name the device type, and the JSON has it; a CPU job gets no
    verdict from a CUDA device's size (none here either way)."""
    import json

    _stub_estimates(monkeypatch, lambda seq_len: MIB)
    for device_type, said in (("cuda", "on CUDA devices"), ("cpu", "as CPU processes")):
        path = tmp_path / f"{device_type}.json"
        assert cli.main(["--job.config_file", GRPO_TOY, "--world_size", "2", "--device_type", device_type,
                         "--json", str(path)]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert said in lines[0], lines
        assert any(line.startswith(f"planned for {said.split()[-2]} ") and f"(--device_type {device_type})" in line
                   for line in lines), lines
        assert json.loads(path.read_text())["device_type"] == device_type
