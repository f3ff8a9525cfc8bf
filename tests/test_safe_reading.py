"""What a checkpoint may hold (``torchtitan_lite/checkpoint/safe_reading.py``): DCP's metadata pickle
is built from an allow-list of DCP's own classes and plain data, non-tensor values are read as
plain data only; a checkpoint from elsewhere never runs code.

The hostile metadata files are real exploits: each one, read by ``pickle.loads`` (what torch's own
``FileSystemReader`` does), creates its marker file. Read by the project (a unit test, then a
resume, ``checkpoint.initial_load_path`` and ``scripts/convert_checkpoint.py``), none does: each
is one line naming the file and the refused name, exit 4."""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import zlib
from pathlib import Path

import pytest
import torch

from tests.conftest import TINY_ARGS
from tests.dist_utils import one_error_line, run_distributed, run_main
from torchtitan_lite.checkpoint.manager import CHECKSUMS_FILE, committed_steps
from torchtitan_lite.checkpoint.safe_reading import (
    METADATA_GLOBALS,
    SafeFileSystemReader,
    SafeLoadPlanner,
    UnsafeCheckpointError,
    failure_reason,
    read_metadata_file,
)

# --------------------------------------------------------------------------------------------
# A small pickle assembler: the payloads are written opcode by opcode, as an attacker would
# (pickle's own writer refuses a dotted name that does not resolve to the same object).
# --------------------------------------------------------------------------------------------


def _s(text: str) -> bytes:
    data = text.encode()
    return b"\x8c" + bytes([len(data)]) + data if len(data) < 256 else b"X" + len(data).to_bytes(4, "little") + data


def _b(data: bytes) -> bytes:
    return b"C" + bytes([len(data)]) + data if len(data) < 256 else b"B" + len(data).to_bytes(4, "little") + data


def _glob(module: str, name: str) -> bytes:
    return _s(module) + _s(name) + b"\x93"  # STACK_GLOBAL


def _call(func: bytes, *args: bytes) -> bytes:
    return func + b"(" + b"".join(args) + b"tR"  # MARK args TUPLE REDUCE


def _getattr(obj: bytes, name: str) -> bytes:
    return _call(_glob("builtins", "getattr"), obj, _s(name))


def _pickle(body: bytes) -> bytes:
    return b"\x80\x04" + body + b"."


def _payloads(marker: Path) -> dict[str, tuple[bytes, str]]:
    """Hostile ``.metadata`` files, each creating ``marker`` when unpickled by ``pickle``, with the
    name the project must refuse."""
    shell = _s(f"touch {marker}")
    python = _s(f"open({str(marker)!r}, 'w').close()")
    system = _glob("posix", "system")
    evil = pickle.dumps(_System(f"touch {marker}"))  # a full pickle, for the torch.load reducers
    evil_file = marker.with_name(marker.name + ".pt")
    evil_file.write_bytes(evil)
    metadata = "torch.distributed.checkpoint.metadata"
    return {
        # The reported hole: pickle protocol 4 resolves a dotted name below an allowed module.
        "dotted_name": (_pickle(_call(_glob("torch.distributed.checkpoint.filesystem", "os.system"), shell)),
                        "torch.distributed.checkpoint.filesystem.os.system"),
        # getattr on a module reached through an allowed module's namespace.
        "getattr": (_pickle(_call(_call(_glob("builtins", "getattr"),
                                        _glob("torch.distributed.checkpoint.filesystem", "os"), _s("system")),
                                  shell)), "builtins.getattr"),
        # getattr from an allowed class to its module's globals, to os, to os.system.
        "getattr_on_class": (_pickle(_call(_getattr(_call(_getattr(_getattr(_getattr(
            _glob(metadata, "Metadata"), "__init__"), "__globals__"), "get"), _s("os")), "system"), shell)),
            "builtins.getattr"),
        "eval": (_pickle(_call(_glob("builtins", "eval"), python)), "builtins.eval"),
        "exec": (_pickle(_call(_glob("builtins", "exec"), python)), "builtins.exec"),
        # getattr(__import__("os"), "system")(cmd), __import__ named first (memoized).
        "import": (_pickle(_glob("builtins", "__import__") + b"\x940"
                           + _call(_getattr(_call(b"h\x00", _s("os")), "system"), shell)), "builtins.__import__"),
        "posix_system": (_pickle(_call(system, shell)), "posix.system"),
        "os_system": (_pickle(_call(_glob("os", "system"), shell)), "os.system"),
        "torch_storage_reducer": (_pickle(_call(_glob("torch.storage", "_load_from_bytes"), _b(evil))),
                                  "torch.storage._load_from_bytes"),
        # partial(torch.load, path, weights_only=False)(): torch.load is named first (memoized).
        "torch_load": (_pickle(_glob("torch", "load") + b"\x940" + _call(_glob("functools", "partial"), b"h\x00")
                               + b"(h\x00(" + _s(str(evil_file)) + b"t}" + _s("weights_only") + b"\x89sNtb)R"),
                       "torch.load"),
        # A partial called inside real-looking metadata: Metadata({"x": partial(system, cmd)()}).
        "nested_partial": (_pickle(_call(_glob(metadata, "Metadata"),
                                         b"}" + _s("x") + _call(_call(_glob("functools", "partial"), system, shell))
                                         + b"s")), "functools.partial"),
    }


class _System:
    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def test_hostile_metadata_runs_nothing(tmp_path):
    """Each payload runs under plain ``pickle.loads`` (they are real exploits); read by the
    project, none runs, and each is one line naming the file and the refused name."""
    import warnings

    marker = tmp_path / "marker"
    for name, (data, refused) in _payloads(marker).items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.load(weights_only=False) warns
            try:
                pickle.loads(data)
            except Exception:  # what the payload returns need not be metadata
                pass
        assert marker.exists(), f"{name}: the payload is not a working exploit"
        marker.unlink()

        file = tmp_path / f"{name}.metadata"
        file.write_bytes(data)
        with pytest.raises(UnsafeCheckpointError) as info:
            read_metadata_file(file)
        message = str(info.value)
        assert not marker.exists(), f"{name}: the payload ran"
        assert "\n" not in message and str(file) in message and refused in message, (name, message)
        assert info.value.exit_code == 4


def test_allowed_classes_cannot_be_changed():
    """``BUILD`` on an allowed class itself (which ``pickle`` turns into ``setattr`` on the class,
    for every later use in the process) is refused, and so is a dunder attribute on an instance."""
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    poison = _pickle(_glob("torch.distributed.checkpoint.metadata", "Metadata") + b"N}" + _s("planner_data")
                     + _s("poisoned") + b"s\x86b")  # BUILD (None, {"planner_data": "poisoned"})
    before = Metadata.planner_data
    try:
        pickle.loads(poison)
        assert Metadata.planner_data == "poisoned"  # what pickle does
    finally:
        Metadata.planner_data = before
    with pytest.raises(UnsafeCheckpointError, match="setting the state of torch.distributed.checkpoint.metadata"):
        read_metadata_file("poison.metadata", poison)
    assert Metadata.planner_data is before
    dunder = _pickle(_call(_glob("torch.distributed.checkpoint.metadata", "StorageMeta")) + b"}"
                     + _s("__class__") + _s("x") + b"sb")
    with pytest.raises(UnsafeCheckpointError, match="setting attributes"):
        read_metadata_file("dunder.metadata", dunder)
    assert StorageMeta().checkpoint_id is None


def test_allow_list_names_no_module_or_code():
    """Every allowed global is a DCP metadata class, a plain-data builder or a torch dtype,
    layout or memory format: nothing that reaches a module, an attribute or code."""
    import types

    for (module, name), value in METADATA_GLOBALS.items():
        assert "." not in name, (module, name)
        assert not isinstance(value, (types.ModuleType, types.BuiltinFunctionType)), (module, name)
        if isinstance(value, types.FunctionType):  # the one function: a layout by its name
            assert (module, name) == ("torch.serialization", "_get_layout")
    assert ("builtins", "getattr") not in METADATA_GLOBALS


def test_foreign_dcp_checkpoint_loads(tmp_path):
    """A checkpoint written by torch's own ``dcp.save`` (a module and its AdamW optimizer, and a
    few plain values), outside the project, loads through the project's reader exactly."""
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    for _ in range(2):
        model(torch.randn(3, 8)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    saved = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
             "extra": {"step": 2, "name": "run", "ratio": 0.5, "tags": ["a", "b"]}}
    dcp.save(saved, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)

    fresh = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1.0)
    fresh(torch.randn(3, 8)).sum().backward()
    fresh_optimizer.step()  # creates the state the load fills
    target = {"model": fresh.state_dict(), "optimizer": fresh_optimizer.state_dict(),
              "extra": {"step": 0, "name": "", "ratio": 0.0, "tags": []}}
    dcp.load(target, storage_reader=SafeFileSystemReader(str(tmp_path / "ckpt")), planner=SafeLoadPlanner(),
             no_dist=True)
    fresh_optimizer.load_state_dict(target["optimizer"])
    for key, value in model.state_dict().items():
        assert torch.equal(target["model"][key], value), key
    for index, state in optimizer.state_dict()["state"].items():
        for key, value in state.items():
            assert torch.equal(fresh_optimizer.state_dict()["state"][index][key], value), (index, key)
    assert fresh_optimizer.param_groups[0]["lr"] == 1e-3 and fresh_optimizer.param_groups[0]["betas"] == (0.9, 0.95)
    assert target["extra"] == saved["extra"]
    metadata = read_metadata_file(tmp_path / "ckpt" / ".metadata")
    assert set(metadata.state_dict_metadata) >= {"model.0.weight", "optimizer.state.0.exp_avg", "extra.step"}


def test_metadata_with_foreign_objects_is_refused():
    """An object of any other class is refused by name."""

    class Evil:
        def __reduce__(self):
            return (print, ("owned",))

    with pytest.raises(UnsafeCheckpointError, match="builtins.print"):
        read_metadata_file("evil.metadata", pickle.dumps(Evil()))
    with pytest.raises(UnsafeCheckpointError, match="holds a dict, not DCP's Metadata"):
        read_metadata_file("plain.metadata", pickle.dumps({"a": 1}))


def test_non_tensor_values_are_read_as_plain_data_only(tmp_path):
    """A checkpoint whose optimizer hyper-parameters carry a pickled object is refused."""
    import torch.distributed.checkpoint as dcp

    class Evil:
        def __reduce__(self):
            return (print, ("owned",))

    path = tmp_path / "evil"
    dcp.save({"optimizer": {"lr": Evil(), "w": torch.ones(2)}}, checkpoint_id=str(path), no_dist=True)
    target = {"optimizer": {"lr": 0.0, "w": torch.zeros(2)}}
    with pytest.raises(BaseException, match="not plain data") as info:  # DCP's is a BaseException
        dcp.load(target, storage_reader=SafeFileSystemReader(str(path)), planner=SafeLoadPlanner(), no_dist=True)
    reason = failure_reason(info.value)
    assert reason.startswith("value 'optimizer.lr' is not plain data") and "print" in reason, reason
    assert target["optimizer"]["lr"] == 0.0
    # Plain values load as before.
    dcp.save({"optimizer": {"lr": 0.5, "betas": (0.9, 0.95), "w": torch.ones(2)}},
             checkpoint_id=str(tmp_path / "plain"), no_dist=True)
    target = {"optimizer": {"lr": 0.0, "betas": (0.0, 0.0), "w": torch.zeros(2)}}
    dcp.load(target, storage_reader=SafeFileSystemReader(str(tmp_path / "plain")), planner=SafeLoadPlanner(),
             no_dist=True)
    assert target["optimizer"]["lr"] == 0.5 and target["optimizer"]["betas"] == (0.9, 0.95)
    assert torch.equal(target["optimizer"]["w"], torch.ones(2))


def _plant(step: Path, data: bytes) -> None:
    """Replace a committed step's ``.metadata`` and update its checksums to match, as anyone who
    can write the folder can."""
    (step / ".metadata").write_bytes(data)
    sums = json.loads((step / CHECKSUMS_FILE).read_text())
    sums["files"][".metadata"] = {"size": len(data), "crc32": f"{zlib.crc32(data) & 0xFFFFFFFF:08x}"}
    (step / CHECKSUMS_FILE).write_text(json.dumps(sums))


@pytest.mark.slow
def test_hostile_checkpoint_stops_every_way_in(tmp_path):
    """A real two-step checkpoint of the tiny model, its newest ``.metadata`` replaced by each
    payload (checksums updated): a resume (with an earlier checkpoint that verifies to fall back
    on), ``checkpoint.initial_load_path`` and ``scripts/convert_checkpoint.py to-hf`` each stop
    with one line naming the file and the refused name and exit 4; no marker is created, and the
    hostile folder is left where it was (not set aside as damage)."""
    from tests.test_convert_checkpoint import _convert

    dump = tmp_path / "run"
    base = [*TINY_ARGS, "--training.global_batch_size", "2", "--checkpoint.enable", "--checkpoint.interval", "1"]
    ((trained,),) = run_distributed(run_main, 1, [[*base, "--job.dump_folder", str(dump), "--training.steps", "2"]])
    assert trained.returncode == 0, trained.stderr
    assert committed_steps(dump / "checkpoint") == [1, 2]
    marker_dir = tmp_path / "markers"
    marker_dir.mkdir()
    payloads = _payloads(marker_dir / "marker")
    # The checksum format the test writes is the manager's own: an unchanged file still verifies.
    crc = json.loads((dump / "checkpoint" / "step-2" / CHECKSUMS_FILE).read_text())["files"][".metadata"]["crc32"]
    assert crc == f"{zlib.crc32((dump / 'checkpoint' / 'step-2' / '.metadata').read_bytes()) & 0xFFFFFFFF:08x}"

    jobs: list[list[str]] = []
    for name, (data, _) in payloads.items():
        run = tmp_path / name
        shutil.copytree(dump, run)
        _plant(run / "checkpoint" / "step-2", data)
        jobs.append([*base, "--job.dump_folder", str(run), "--training.steps", "4"])  # resume
        jobs.append([*base, "--job.dump_folder", str(tmp_path / f"{name}_fresh"), "--training.steps", "4",
                     "--checkpoint.initial_load_path", str(run / "checkpoint" / "step-2")])
    (results,) = run_distributed(run_main, 1, jobs)
    for index, (name, (_, refused)) in enumerate(payloads.items()):
        hostile = tmp_path / name / "checkpoint" / "step-2"
        for result in results[2 * index: 2 * index + 2]:
            line = one_error_line(result, 4)
            assert str(hostile / ".metadata") in line and refused in line, (name, line)
        assert committed_steps(tmp_path / name / "checkpoint") == [1, 2], name  # not renamed .corrupt
        converted = _convert("to-hf", str(hostile), str(tmp_path / f"{name}_hf"))
        assert converted.returncode == 4, (name, converted.stderr)
        lines = converted.stderr.strip().splitlines()
        assert len(lines) == 1 and refused in lines[0] and str(hostile / ".metadata") in lines[0], (name, lines)
    assert sorted(os.listdir(marker_dir)) == ["marker.pt"], "a payload ran"


def test_estimator_hand_off_folder_is_private(monkeypatch):
    """The estimator's child-process pickles live in a folder only this user can enter, that it
    created for the call."""
    import subprocess

    from torchtitan_lite.memory import estimate
    from torchtitan_lite.models.llama3 import LLAMA3_SPEC

    seen: list[int] = []

    def fake_run(cmd, **kwargs):
        path = Path(cmd[-1])
        seen.append(path.parent.stat().st_mode & 0o777)
        path.write_bytes(pickle.dumps(("ok", 42)))
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(estimate.subprocess, "run", fake_run)
    assert estimate.in_child_process("x:y", LLAMA3_SPEC, None, {}) == 42
    assert seen == [0o700]


def test_metadata_of_every_layout_reads(tmp_path):
    """Sharded metadata with an optimizer, as FSDP2 (2 ranks), HSDP (2 replicas) and FSDP2 with
    CPU offload save it: read by the allow-list it is the object ``pickle.load`` builds, and the
    checkpoint loads back through the project's reader and planner on the same layout."""
    results = run_distributed(_save_and_load_sharded, 2, str(tmp_path))
    assert results[0] == results[1]
    for layout, path in results[0].items():
        data = (Path(path) / ".metadata").read_bytes()
        ours, theirs = read_metadata_file(Path(path) / ".metadata"), pickle.load(io.BytesIO(data))
        assert ours.state_dict_metadata == theirs.state_dict_metadata, layout
        assert ours.storage_data == theirs.storage_data and ours.planner_data == theirs.planner_data, layout


def _save_and_load_sharded(folder: str) -> dict[str, str]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    from torchtitan_lite.distributed import init_distributed

    init_distributed(torch.device("cpu"))
    layouts = {"fsdp": ({}, init_device_mesh("cpu", (2,))),
               "hsdp": ({}, init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))),
               "cpu_offload": ({"offload_policy": CPUOffloadPolicy(pin_memory=False)}, init_device_mesh("cpu", (2,)))}
    paths = {}

    def build(options: dict, mesh) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
        for layer in model:
            fully_shard(layer, mesh=mesh, **options)
        fully_shard(model, mesh=mesh, **options)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    for layout, (options, mesh) in layouts.items():
        model, optimizer = build(options, mesh)
        model(torch.randn(2, 8)).sum().backward()
        optimizer.step()
        path = str(Path(folder) / layout)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=path)
        fresh, fresh_optimizer = build(options, mesh)
        fresh(torch.randn(2, 8)).sum().backward()
        fresh_optimizer.step()
        model_sd, optim_sd = get_state_dict(fresh, fresh_optimizer)
        target = {"model": model_sd, "optimizer": optim_sd}
        dcp.load(target, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner())
        set_state_dict(fresh, fresh_optimizer, model_state_dict=target["model"], optim_state_dict=target["optimizer"])
        for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
            assert torch.equal(a.full_tensor(), b.full_tensor()), layout
        paths[layout] = path
    dist.barrier()
    return paths


def test_data_files_outside_the_folder_are_refused(tmp_path):
    """Metadata made of allowed classes only, but placing a data file outside the checkpoint
    folder (an absolute path, or ``..``): refused before anything is read from there."""
    import dataclasses

    import torch.distributed.checkpoint as dcp

    from torchtitan_lite.checkpoint.storage import check_files

    dcp.save({"w": torch.ones(3)}, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    metadata = read_metadata_file(tmp_path / "ck" / ".metadata")
    check_files(tmp_path / "ck", metadata.storage_data)  # as written: fine
    for outside in ("../secret.distcp", "/etc/passwd"):
        moved = {k: dataclasses.replace(v, relative_path=outside) for k, v in metadata.storage_data.items()}
        with pytest.raises(UnsafeCheckpointError, match="outside the checkpoint folder"):
            check_files(tmp_path / "ck", moved)
