"""What a checkpoint may hold (``torchtitan_lite/checkpoint/safe_reading.py``): DCP's metadata pickle
and non-tensor values are read as plain data only, never as arbitrary objects."""

from __future__ import annotations

import pickle

import pytest


def test_metadata_with_foreign_objects_is_refused(tmp_path):
    """DCP metadata is a pickle; loading refuses anything but DCP's own classes."""
    import io

    from torchtitan_lite.checkpoint.safe_reading import _MetadataUnpickler

    class Evil:
        def __reduce__(self):
            return (print, ("owned",))

    with pytest.raises(pickle.UnpicklingError, match="builtins.print"):
        _MetadataUnpickler(io.BytesIO(pickle.dumps(Evil()))).load()


def test_non_tensor_values_are_read_as_plain_data_only(tmp_path):
    """A checkpoint whose optimizer hyper-parameters carry a pickled object is refused."""
    import torch
    import torch.distributed.checkpoint as dcp

    from torchtitan_lite.checkpoint.safe_reading import SafeFileSystemReader, SafeLoadPlanner, failure_reason

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
