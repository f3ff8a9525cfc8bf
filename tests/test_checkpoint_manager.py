"""Checkpoints (``torchtitan_lite/checkpoint/manager.py``): exact resume after a crash, atomic
commits, keep_latest_k, seed and initial loads, one-line errors for broken checkpoints."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import TINY_ARGS
from tests.dist_utils import one_error_line, run_distributed, run_main
from torchtitan_lite.checkpoint.manager import committed_steps


def _train(argv: list[str], crash_at: int | None = None) -> dict[str, Any]:
    """Train with ``argv``; with ``crash_at``, raise inside that step (a crash mid-run).

    Each step also records the windows this rank read and one draw from the global RNG (the
    model uses none, so the draw shows whether a resume restored the generator)."""
    import torch

    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.trainer import Trainer

    trainer = Trainer(load_job_config(argv))
    start = trainer.step
    original = trainer.train_step
    samples: dict[int, list[int]] = {}
    draws: list[int] = []

    def recording_step() -> dict[str, float]:
        if crash_at is not None and trainer.step + 1 == crash_at:
            raise RuntimeError("injected crash")
        samples[trainer.step + 1] = _window_indices(trainer.loader)
        values = original()
        draws.append(int(torch.randint(0, 2**62, ())))
        return values

    trainer.train_step = recording_step
    history: list[dict[str, float]] = []
    try:
        history = trainer.train()
        outcome = "finished"
    except RuntimeError as exc:
        outcome = str(exc)
    finally:
        trainer.close(clean=crash_at is None)
    from torch.distributed.fsdp import FSDPModule

    return {"start": start, "history": history, "outcome": outcome, "samples": samples, "draws": draws,
            "fsdp": isinstance(trainer.model, FSDPModule),
            "blocked_s": None if trainer.checkpointer is None else trainer.checkpointer.last_blocked_s}


def _window_indices(loader: Any) -> list[int]:
    """The windows this rank reads in the loader's next global batch (one windowed source: the
    source's sample numbers are the run's)."""
    reader, per_rank = loader.sources[0].reader, loader.global_batch_size // loader.dp_size
    first = loader.step * loader.global_batch_size + loader.dp_rank * per_rank
    return [reader.index(first + i) for i in range(per_rank)]


def _argv(dump: Path, *extra: str) -> list[str]:
    return [*TINY_ARGS, "--job.dump_folder", str(dump), "--training.steps", "10",
            "--training.global_batch_size", "4", "--checkpoint.enable", "--checkpoint.interval", "5",
            *extra]


def _losses(result: dict[str, Any], first: int) -> list[float]:
    return [h["loss"] for h in result["history"] if h["step"] >= first]


def _global_samples(results: list[dict[str, Any]], steps: range) -> dict[int, list[int]]:
    """Per step, every window read by any rank (sorted): the global batch."""
    return {s: sorted(i for r in results for i in r["samples"][s]) for s in steps}


@pytest.mark.slow
@pytest.mark.parametrize("crash_at", [6, 7], ids=["stop_after_5", "crash_in_7"])
def test_resume_after_a_crash_is_bit_identical(tmp_path, crash_at):
    """Stopped right after the step-5 checkpoint, or in step 7 (step 6 lost): the resumed steps
    6-10 equal the uninterrupted run's bit for bit."""
    (full,) = run_distributed(_train, 1, _argv(tmp_path / "full"))
    # Two ranks would work the same; one keeps the test fast and the comparison bitwise.
    (crashed,) = run_distributed(_train, 1, _argv(tmp_path / "split"), crash_at)
    assert crashed["outcome"] == "injected crash"
    assert committed_steps(tmp_path / "split" / "checkpoint") == [5]
    (resumed,) = run_distributed(_train, 1, _argv(tmp_path / "split"))
    assert resumed["start"] == 5
    assert [h["step"] for h in resumed["history"]] == list(range(6, 11))
    expected = _losses(full, 6)
    got = _losses(resumed, 6)
    assert got == expected, (got, expected)  # bit-identical, not approximately equal
    assert [h["lr"] for h in resumed["history"]] == [h["lr"] for h in full["history"][5:]]
    # The RNG continues where it stopped (without restoring it, step 6 would repeat step 1's draw).
    assert resumed["draws"] == full["draws"][5:]
    assert {s: resumed["samples"][s] for s in range(6, 11)} == {s: full["samples"][s] for s in range(6, 11)}
    assert committed_steps(tmp_path / "split" / "checkpoint") == [5, 10]


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    """10 steps on 2 ranks with checkpoints at 5 and 10: (dump folder, per-rank results)."""
    dump = tmp_path_factory.mktemp("two_rank")
    return dump, run_distributed(_train, 2, _argv(dump))


@pytest.mark.parametrize("world,extra", [
    (1, []),
    (4, ["--training.local_batch_size", "1"]),
    (4, ["--training.local_batch_size", "1", "--parallelism.data_parallel_replicate_degree", "2"]),
], ids=["one_process", "fsdp4", "hsdp2x2"])
@pytest.mark.slow
def test_resume_at_another_world_size(tmp_path, two_rank_run, world, extra):
    """Saved on 2 ranks, resumed on 1 (one process: the plain model, no FSDP), 4 (FSDP) or 2 × 2
    (HSDP): the losses continue those of the 2-rank run and the global batches of steps 6-10 are
    exactly the ones it read."""
    base, two = two_rank_run
    assert all(r["fsdp"] for r in two)
    resumed_dump = tmp_path / "resumed"
    shutil.copytree(base / "checkpoint" / "step-5", resumed_dump / "checkpoint" / "step-5")
    results = run_distributed(_train, world, _argv(resumed_dump, *extra))
    assert all(r["start"] == 5 for r in results)
    assert all(r["fsdp"] == (world > 1) for r in results)
    expected, got = _losses(two[0], 6), _losses(results[0], 6)
    assert len(got) == 5
    for g, e in zip(got, expected, strict=True):
        assert abs(g - e) <= 1e-5 * abs(e), (got, expected)
    steps = range(6, 11)
    assert _global_samples(results, steps) == _global_samples(two, steps)  # none skipped or repeated


def test_one_process_checkpoint_resumes_on_two_ranks(tmp_path):
    """A checkpoint of one process (plain model, no FSDP: whole tensors in DCP) resumes on 2 FSDP
    ranks: steps 6-10 continue the one-process run (fp32, within 1e-5: only the order of the
    sums differs) and read exactly its global batches."""
    (one,) = run_distributed(_train, 1, _argv(tmp_path / "one"))
    assert not one["fsdp"] and committed_steps(tmp_path / "one" / "checkpoint") == [5, 10]
    resumed_dump = tmp_path / "resumed"
    shutil.copytree(tmp_path / "one" / "checkpoint" / "step-5", resumed_dump / "checkpoint" / "step-5")
    results = run_distributed(_train, 2, _argv(resumed_dump))
    assert all(r["start"] == 5 and r["fsdp"] for r in results)
    expected, got = _losses(one, 6), _losses(results[0], 6)
    assert len(got) == 5 and got != _losses(one, 1)[:5]
    for g, e in zip(got, expected, strict=True):
        assert abs(g - e) <= 1e-5 * abs(e), (got, expected)
    steps = range(6, 11)
    assert _global_samples(results, steps) == _global_samples([one], steps)


@pytest.mark.slow
def test_keep_latest_k_and_two_rank_resume(tmp_path):
    dump = tmp_path / "run"
    run_distributed(_train, 2, _argv(dump, "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "2"))
    folder = dump / "checkpoint"
    assert committed_steps(folder) == [8, 10]
    assert sorted(p.name for p in folder.iterdir()) == ["step-10", "step-8"]  # nothing partial left
    # Resume an explicit earlier step on 2 ranks (step 10 moved away: it would be overwritten).
    shutil.move(str(folder / "step-10"), str(dump / "kept-step-10"))
    results = run_distributed(_train, 2, _argv(dump, "--checkpoint.load_step", "8",
                                               "--checkpoint.keep_latest_k", "2"))
    assert results[0]["start"] == 8 and [h["step"] for h in results[0]["history"]] == [9, 10]


@pytest.mark.scenario  # (left out of the default selection: .ci/run runs it; docs/testing.md)
@pytest.mark.slow
def test_rank_killed_mid_save_leaves_the_previous_checkpoint_latest(tmp_path, two_rank_run):
    """SIGKILL one rank of a 2-rank torchrun job while step 10 is being written: step 5 stays
    the latest committed checkpoint, and the next run resumes from it and ends like an
    uninterrupted run."""
    import sys

    from tests.dist_utils import free_port, read_jsonl, run_command

    dump = tmp_path / "killed"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--nnodes=1", "--max-restarts=0",
           "tests/kill_during_save.py", *_argv(dump)]
    killed = run_command(cmd, timeout=180, extra_env={"KILL_AT_STEP": "10", "KILL_RANK": "1"})
    assert killed.returncode != 0
    assert "Signals.SIGKILL" in killed.stderr or "-9" in killed.stderr, killed.stderr[-2000:]
    folder = dump / "checkpoint"
    assert committed_steps(folder) == [5]
    # The half-written save is never a step-10: the surviving rank 0 removes it when its save
    # fails, unless torchrun stops rank 0 first (then it stays, without metadata, until the next
    # save clears it).
    (folder / ".step-10.partial" / ".metadata").exists() and pytest.fail("metadata written by a killed save")

    resumed = run_distributed(_train, 2, _argv(dump))
    assert resumed[0]["start"] == 5
    assert committed_steps(folder) == [5, 10]
    assert not (folder / ".step-10.partial").exists()
    _, full = two_rank_run
    assert _losses(resumed[0], 6) == _losses(full[0], 6)
    assert [r["step"] for r in read_jsonl(dump / "metrics.jsonl")][-1] == 10


def _model_tensors(step_dir: Path) -> dict[str, Any]:
    """The model tensors of a DCP checkpoint, read in one process."""
    import torch
    import torch.distributed.checkpoint as dcp

    from torchtitan_lite.checkpoint.safe_reading import SafeFileSystemReader

    meta = SafeFileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
    model = {k[len("model."):]: torch.empty(m.size, dtype=m.properties.dtype)
             for k, m in meta.items() if k.startswith("model.")}
    dcp.load({"model": model}, storage_reader=SafeFileSystemReader(str(step_dir)), no_dist=True)
    return model


@pytest.mark.slow
def test_keep_latest_k_with_sync_and_async_saves(tmp_path):
    """keep_latest_k = 2 keeps exactly the two newest checkpoints; async saves write the same
    files with the same tensors as sync ones, and resuming from them gives the same losses."""
    import torch

    outcome = {}
    for mode in ("disabled", "async"):
        dump = tmp_path / mode
        args = ("--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "2", "--checkpoint.async_mode", mode)
        full = run_distributed(_train, 2, _argv(dump, *args))
        folder = dump / "checkpoint"
        assert committed_steps(folder) == [8, 10]
        assert sorted(p.name for p in folder.iterdir()) == ["step-10", "step-8"]  # nothing partial left
        files = {step: sorted(p.name for p in (folder / f"step-{step}").iterdir()) for step in (8, 10)}
        assert files[8] == [".metadata", "__0_0.distcp", "__1_0.distcp", "checksums.json", "train_state.json"], files
        # Resume an explicit earlier step: training continues from step 8 with the same losses
        # (once step 10, which it would overwrite, is moved out of the folder).
        shutil.move(str(folder / "step-10"), str(dump / "kept-step-10"))
        resumed = run_distributed(_train, 2, _argv(dump, "--checkpoint.load_step", "8", *args))
        assert resumed[0]["start"] == 8 and [h["step"] for h in resumed[0]["history"]] == [9, 10]
        assert _losses(resumed[0], 9) == _losses(full[0], 9)
        outcome[mode] = {"files": files, "losses": _losses(resumed[0], 9),
                         "tensors": _model_tensors(folder / "step-8")}
    sync, background = outcome["disabled"], outcome["async"]
    assert background["files"] == sync["files"] and background["losses"] == sync["losses"]
    assert sync["tensors"].keys() == background["tensors"].keys()
    assert all(torch.equal(sync["tensors"][k], background["tensors"][k]) for k in sync["tensors"])


def test_seed_checkpoint_starts_identical_runs_on_one_and_two_ranks(tmp_path):
    """Jobs started as `python -m torchtitan_lite.train` (its ``main``, in a rank process with
    torch already imported, see :func:`run_main`) write the seed checkpoint once; it starts
    the same run on one and two ranks."""
    seed_dump = tmp_path / "seed"
    create = [*_argv(seed_dump), "--checkpoint.create_seed_checkpoint"]
    # The second run: once written, it is never overwritten by another seed run.
    ((made, again),) = run_distributed(run_main, 1, [[*create, "--debug.seed", "7"], create])
    assert made.returncode == 0, made.stderr
    assert committed_steps(seed_dump / "checkpoint") == [0]
    state = json.loads((seed_dump / "checkpoint" / "step-0" / "train_state.json").read_text())
    assert state["model_only"] is True and state["model_args"]["dim"] == 64
    assert again.returncode == 2 and "already holds checkpoints" in again.stderr
    # Both ranks of a 2-process job (torchrun's variables) refuse it; local rank 0 says why.
    on_two = [ranks[0] for ranks in run_distributed(
        run_main, 2, [_argv(tmp_path / "seed_two", "--checkpoint.create_seed_checkpoint")], False)]
    assert on_two[1].returncode == 2 and on_two[1].stderr == "", on_two[1].stderr
    assert "error: checkpoint.create_seed_checkpoint: invalid value True; expected one process (this job " \
        "has 2)" in one_error_line(on_two[0], 2)

    runs = {}
    for world in (1, 2):
        dump = tmp_path / f"from_seed_{world}"
        shutil.copytree(seed_dump / "checkpoint", dump / "checkpoint")
        # --debug.seed 42 would give other weights: these must come from the seed checkpoint.
        runs[world] = run_distributed(_train, world, _argv(dump, "--training.steps", "3"))[0]
        assert runs[world]["start"] == 0
    (scratch,) = run_distributed(_train, 1, _argv(tmp_path / "scratch", "--training.steps", "3"))
    one, two = _losses(runs[1], 1), _losses(runs[2], 1)
    for a, b in zip(one, two, strict=True):
        assert abs(a - b) <= 1e-5 * abs(a), (one, two)
    # Same data as the seed-42 run from scratch, other weights: they came from the checkpoint.
    assert runs[1]["samples"] == scratch["samples"]
    assert abs(one[0] - _losses(scratch, 1)[0]) > 1e-3


def _foreign_checkpoint(path: Path) -> None:
    """A committed-looking checkpoint of another model (one Linear layer), made without a
    process group."""
    import torch
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": torch.nn.Linear(4, 3).state_dict()}, checkpoint_id=str(path), no_dist=True)
    (path / "train_state.json").write_text(json.dumps({"step": 3}))


@pytest.mark.slow
def test_corrupt_or_incompatible_checkpoints_are_one_clear_error(tmp_path):
    """Each broken checkpoint stops the job before training with one line naming the checkpoint
    and what is wrong; none of them silently trains from scratch.

    Two of the jobs run as real processes (`python -m torchtitan_lite.train`: all of their stderr
    is the one line, and the exit code is the process's); the others run the same ``main`` in
    one rank process (:func:`run_main`)."""
    import sys
    from concurrent.futures import ThreadPoolExecutor

    from tests.dist_utils import run_command

    dump = tmp_path / "run"
    ((trained,),) = run_distributed(run_main, 1, [_argv(dump, "--training.steps", "2")])
    assert trained.returncode == 0, trained.stderr
    step2 = dump / "checkpoint" / "step-2"
    assert committed_steps(dump / "checkpoint") == [2]

    # Each job: (its argv, its exit code); a checkpoint that cannot be used exits 4, a config
    # that contradicts itself 2. They are prepared first, then all run.
    jobs: dict[str, tuple[list[str], int]] = {}

    def job(name: str, *extra: str, folder: Path = dump, code: int = 4) -> None:
        jobs[name] = ([*_argv(folder, "--training.steps", "4"), *extra], code)

    # Another shape: the same folder with a larger vocabulary (embedding shapes differ).
    job("shape", "--model.vocab_size", "300")
    job("load_step", "--checkpoint.load_step", "7")
    job("exclude_train_state", "--checkpoint.exclude_from_loading", "train_state")
    job("load_step_disabled", "--checkpoint.load_step", "2", "--checkpoint.no-enable", code=2)

    # Another model's weights, given as the starting point.
    foreign = tmp_path / "foreign" / "step-3"
    _foreign_checkpoint(foreign)
    job("foreign", "--checkpoint.initial_load_path", str(foreign), folder=tmp_path / "fresh")

    # A shard file deleted by hand, or cut short.
    broken = tmp_path / "missing_file"
    shutil.copytree(dump, broken)
    (broken / "checkpoint" / "step-2" / "__0_0.distcp").unlink()
    job("missing_file", folder=broken)
    broken = tmp_path / "truncated"
    shutil.copytree(dump, broken)
    with (broken / "checkpoint" / "step-2" / "__0_0.distcp").open("r+b") as fh:
        fh.truncate(1000)
    job("truncated", folder=broken)

    # A committed folder missing its metadata or with an unreadable train state.
    for name, damage in [("no_metadata", ".metadata"), ("bad_state", "train_state.json")]:
        broken = tmp_path / name
        shutil.copytree(dump, broken)
        target = broken / "checkpoint" / "step-2" / damage
        if damage == ".metadata":
            target.unlink()
        else:
            target.write_text("{not json")
        job(name, folder=broken)

    # Settings that cannot work are refused by config validation, before anything is built.
    job("nowhere", "--checkpoint.initial_load_path", str(tmp_path / "nowhere"), folder=tmp_path / "fresh", code=2)
    job("not_dcp", "--checkpoint.initial_load_path", str(tmp_path), folder=tmp_path / "fresh", code=2)
    job("last_save_in_hf", "--checkpoint.last_save_in_hf", code=2)
    job("initial_load_in_hf", "--checkpoint.initial_load_in_hf", code=2)

    real = ("shape", "last_save_in_hf")  # one checkpoint error, one config error
    in_process = [name for name in jobs if name not in real]
    with ThreadPoolExecutor(len(real)) as pool:  # the processes start while the others run
        started = {name: pool.submit(run_command, [sys.executable, "-m", "torchtitan_lite.train", *jobs[name][0]],
                                     timeout=120) for name in real}
        (results,) = run_distributed(run_main, 1, [jobs[name][0] for name in in_process])
        outcome = {**dict(zip(in_process, results, strict=True)),
                   **{name: future.result() for name, future in started.items()}}
    error = {name: one_error_line(outcome[name], code) for name, (_, code) in jobs.items()}

    assert error["shape"] == (f"error: checkpoint {str(step2)!r}: model tensor 'tok_embeddings.weight' has "
                              "shape [258, 64] there but [300, 64] in this model")
    assert "checkpoint.load_step: invalid value 7" in error["load_step"]
    assert error["exclude_train_state"] == (
        f"error: checkpoint.load_step: resuming at step 0 would overwrite the later checkpoints [2] in "
        f"{str(dump / 'checkpoint')!r}; move them out of the folder (or use another checkpoint.folder) "
        "to continue from there")
    assert "checkpoint.load_step: invalid value 2; resuming a step needs checkpoint.enable = true" in \
        error["load_step_disabled"]
    assert "has no model tensor 'tok_embeddings.weight': it was saved from another model (it holds 2 " \
        "model tensors, e.g. 'bias')" in error["foreign"], error["foreign"]
    # With no earlier checkpoint to fall back on (checkpoint.on_corrupt), the one line says what
    # is wrong with the newest and that none verifies.
    assert "is incomplete: data file '__0_0.distcp' is missing; no checkpoint in" in error["missing_file"]
    assert "is corrupt: data file '__0_0.distcp' has 1000 bytes, its metadata needs at least" in error["truncated"]
    for name, damage in [("no_metadata", ".metadata"), ("bad_state", "train_state.json")]:
        line = error[name]
        assert str(tmp_path / name / "checkpoint" / "step-2") in line, line
        assert ("is incomplete: its DCP .metadata file is missing" in line if damage == ".metadata"
                else "cannot be read" in line), line
    assert "checkpoint.initial_load_path: invalid value" in error["nowhere"]
    assert "not a DCP checkpoint folder (no .metadata file)" in error["not_dcp"]
    assert "checkpoint.last_save_in_hf: invalid value True; a Hugging Face export holds only weights" in \
        error["last_save_in_hf"]
    assert "checkpoint.initial_load_in_hf: invalid value True" in error["initial_load_in_hf"]


@pytest.mark.slow
def test_model_only_last_save_and_initial_load(tmp_path):
    """last_save_model_only writes bf16 weights only; a new run starts from them through
    initial_load_path (step 0, fresh optimizer); initial_load_model_only = false continues a
    full checkpoint from another folder."""
    import torch

    from torchtitan_lite.checkpoint.safe_reading import SafeFileSystemReader

    dump = tmp_path / "export"
    full = run_distributed(_train, 2, _argv(dump, "--checkpoint.last_save_model_only",
                                            "--checkpoint.export_dtype", "bfloat16",
                                            "--checkpoint.keep_latest_k", "1"))[0]
    folder = dump / "checkpoint"
    assert committed_steps(folder) == [5, 10]  # the weights-only export does not push out step 5
    meta = SafeFileSystemReader(str(folder / "step-10")).read_metadata().state_dict_metadata
    assert all(k.startswith("model.") for k in meta), sorted(meta)[:5]
    assert {m.properties.dtype for m in meta.values()} == {torch.bfloat16}
    assert any(k.startswith("optimizer.") for k in
               SafeFileSystemReader(str(folder / "step-5")).read_metadata().state_dict_metadata)
    state = json.loads((folder / "step-10" / "train_state.json").read_text())
    assert state["model_only"] and state["export_dtype"] == "bfloat16" and state["step"] == 10

    # Fine-tune from the exported weights: step 0, fp32 master weights equal to the bf16 export.
    (tuned,) = run_distributed(_train, 1, _argv(tmp_path / "tune", "--training.steps", "2",
                                                "--checkpoint.initial_load_path", str(folder / "step-10")))
    assert tuned["start"] == 0 and [h["step"] for h in tuned["history"]] == [1, 2]
    (scratch,) = run_distributed(_train, 1, _argv(tmp_path / "scratch", "--training.steps", "2"))
    assert tuned["history"][0]["loss"] < scratch["history"][0]["loss"] - 1.0  # trained weights

    # A full checkpoint from another folder continues exactly (model, optimizer, data, step).
    cont = run_distributed(_train, 2, _argv(tmp_path / "cont", "--checkpoint.initial_load_path",
                                            str(folder / "step-5"), "--checkpoint.no-initial_load_model_only"))[0]
    assert cont["start"] == 5
    assert _losses(cont, 6) == _losses(full, 6)


@pytest.mark.slow
def test_hf_export_import_and_converter_through_the_trainer(tmp_path):
    """A 2-rank job's last save in Hugging Face layout starts a new job (initial_load_in_hf); the
    same folder converted to DCP by scripts/convert_checkpoint.py starts an identical one."""
    import sys

    from tests.dist_utils import run_command
    from torchtitan_lite.checkpoint.hf_storage import check_hf_config

    dump = tmp_path / "export"
    run_distributed(_train, 2, _argv(dump, "--training.steps", "4", "--checkpoint.interval", "2",
                                     "--checkpoint.last_save_model_only", "--checkpoint.last_save_in_hf"))
    hf_dir = dump / "checkpoint" / "step-4"
    assert committed_steps(dump / "checkpoint") == [2, 4]
    assert sorted(p.name for p in hf_dir.iterdir()) == [  # the byte tokenizer: ids, no tokenizer files
        "config.json", "generation_config.json", "model-00001-of-00001.safetensors", "model.safetensors.index.json",
        "train_state.json"]
    assert json.loads((hf_dir / "train_state.json").read_text())["format"] == "hf"
    from torchtitan_lite.models import get_model_spec

    spec = get_model_spec("llama3")
    check_hf_config(hf_dir, spec, spec.model_args("tiny"))
    # Re-running the finished job resumes from the HF-format step 4: nothing left to train.
    again = run_distributed(_train, 1, _argv(dump, "--training.steps", "4"))[0]
    assert again["start"] == 4 and again["history"] == []

    converted = tmp_path / "converted" / "step-0"
    done = run_command([sys.executable, "scripts/convert_checkpoint.py", "from-hf", str(hf_dir), str(converted)],
                       timeout=120)
    assert done.returncode == 0, done.stderr
    from_hf = run_distributed(
        _train,
        2,
        _argv(
            tmp_path / "a",
            "--training.steps",
            "2",
            "--checkpoint.initial_load_path",
            str(hf_dir),
            "--checkpoint.initial_load_in_hf",
        ),
    )[0]
    from_dcp = run_distributed(
        _train, 2, _argv(tmp_path / "b", "--training.steps", "2", "--checkpoint.initial_load_path", str(converted))
    )[0]
    scratch = run_distributed(_train, 2, _argv(tmp_path / "c", "--training.steps", "2"))[0]
    assert from_hf["start"] == from_dcp["start"] == 0
    assert _losses(from_hf, 1) == _losses(from_dcp, 1)
    assert _losses(from_hf, 1)[0] < _losses(scratch, 1)[0] - 0.5  # the trained weights, not a fresh init
