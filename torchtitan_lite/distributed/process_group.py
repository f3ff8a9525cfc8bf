"""Process group, device choice and collective timeouts (the mesh: :mod:`.mesh`); a
torchrun worker's exit when its launcher dies (:func:`exit_with_launcher`, from
:mod:`torchtitan_lite.run.launcher_watch`)."""

from __future__ import annotations

import atexit
import datetime
import gc
import logging
import os
import socket
import sys
import time
import uuid
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from torchtitan_lite.run.launcher_watch import LAUNCHER_GONE_EXIT_CODE, exit_with_launcher

__all__ = [
    "choose_device",
    "backend_for",
    "init_distributed",
    "set_collective_timeout",
    "world_info_from_env",
    "local_world_size_from_env",
    "destroy_distributed",
    "forget_dtensor_plans",
    "free_port",
    "release_process_groups",
    "attempt_store",
    "exit_with_launcher",
    "LAUNCHER_GONE_EXIT_CODE",
]

logger = logging.getLogger(__name__)


def world_info_from_env() -> tuple[int, int, int]:
    """``(rank, local_rank, world_size)`` from torchrun's environment (``0, 0, 1`` without it)."""
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    return rank, local_rank, world_size


def local_world_size_from_env() -> int | None:
    """Processes on this node: torchrun's ``LOCAL_WORLD_SIZE`` (None without it: one node)."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(value) if value.isdigit() and int(value) > 0 else None


def choose_device(local_rank: int | None = None) -> torch.device:
    """The one place the compute device is chosen: this rank's CUDA device if any, else CPU."""
    if torch.cuda.is_available():
        if local_rank is None:
            local_rank = world_info_from_env()[1]
        count = torch.cuda.device_count()
        if local_rank < count:
            return torch.device("cuda", local_rank)
        if count == 1:
            # One visible GPU per process (CUDA_VISIBLE_DEVICES set per rank by a launcher).
            return torch.device("cuda", 0)
        raise RuntimeError(
            f"LOCAL_RANK={local_rank} but only {count} CUDA devices are visible; start at "
            f"most {count} processes per node (torchrun --nproc_per_node)"
        )
    return torch.device("cpu")


def backend_for(device: torch.device, *, cpu_collectives: bool = False) -> str:
    """The one place the backend string is built.

    ``nccl`` on CUDA, ``gloo`` on CPU, and ``cuda:nccl,cpu:gloo`` on CUDA when CPU tensors take
    part in collectives too (CPU offload: gradient-norm clipping reduces CPU gradients).
    """
    if device.type == "cuda":
        return "cuda:nccl,cpu:gloo" if cpu_collectives else "nccl"
    if device.type == "cpu":
        return "gloo"
    raise ValueError(f"unsupported device type {device.type!r}; expected cuda or cpu")


def init_distributed(
    device: torch.device, *, cpu_collectives: bool = False, timeout_s: float = 600.0
) -> None:
    """Create the default process group from torchrun's environment.

    Without torchrun (no ``MASTER_ADDR``), a single-process group is created on a free local
    port so that FSDP and DTensor work the same way as in a multi-process run. Under torchrun's
    agent store, the group's keys live in a namespace of this attempt (:func:`attempt_store`),
    so that workers restarted by ``--max-restarts`` never read a dead attempt's addresses. The
    first call also registers :func:`release_process_groups` to run at interpreter exit. A
    torchrun worker first arranges to exit when its launcher dies (:func:`exit_with_launcher`).
    """
    global _release_registered
    exit_with_launcher()
    if not _release_registered:
        atexit.register(release_process_groups)
        _release_registered = True
    if dist.is_initialized():
        if device.type == "cuda" and cpu_collectives:
            config = str(dist.get_backend_config())
            if "cpu:" not in config:
                raise RuntimeError(
                    f"the existing process group ({config}) has no CPU backend, which CPU offload "
                    "needs for gradient clipping; create it with backend 'cuda:nccl,cpu:gloo'"
                )
        return
    if "MASTER_ADDR" not in os.environ:
        # Without torchrun: a one-process group on a free port, passed explicitly rather than
        # through os.environ (which child processes would inherit, port included).
        where: dict[str, Any] = {"init_method": f"tcp://127.0.0.1:{free_port()}", "rank": 0, "world_size": 1}
    elif os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # Under torchrun: the agent's store outlives the workers it restarts (see attempt_store).
        rank, _, world_size = world_info_from_env()
        agent_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                                    is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
        where = {"store": attempt_store(agent_store, rank=rank, world_size=world_size, timeout_s=timeout_s),
                 "rank": rank, "world_size": world_size}
    else:  # a launcher that sets MASTER_ADDR/PORT and lets rank 0 host a new store (env://)
        where = {}
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = backend_for(device, cpu_collectives=cpu_collectives)
    dist.init_process_group(
        backend=backend,
        timeout=datetime.timedelta(seconds=timeout_s),
        device_id=device if device.type == "cuda" else None,
        **where,
    )
    logger.info(
        "process group: backend=%s world_size=%d device=%s", backend, dist.get_world_size(), device
    )


_ATTEMPT_KEY = "torchtitan_lite/attempt"


def attempt_store(store: dist.Store, *, rank: int, world_size: int, timeout_s: float,
                  max_poll_s: float = 1.0) -> dist.PrefixStore:
    """A namespace of ``store`` that every rank of this attempt shares and no earlier attempt wrote
    into: the process group's keys (gloo's listening addresses, NCCL's unique id) then cannot be
    read from a dead attempt.

    Why: torchrun (c10d rendezvous, torch >= 2.5) hosts the workers' store in its agent
    (``TORCHELASTIC_USE_AGENT_STORE=True``) and, in torch 2.13, keeps that one store server for
    the agent's whole life. A restarted worker group creates its default group under the same
    keys as the group it replaces (``default_pg/0//cpu//0/<rank>``), and a rank that asks for a
    peer's address before that peer has written it is handed the dead peer's: gloo's
    connectFullMesh fails with "Connection refused" (or connects to whatever reuses the port and
    hangs), so ``--max-restarts`` restarts failed or hung. Upstream: pytorch/pytorch#135712
    (successive attempts' keys collide in the shared store; it was closed by #135957, which still
    creates that store once per agent, so the collision remains in 2.13) and the open
    pytorch/pytorch#167288 (the same with NCCL). ``TORCHELASTIC_RESTART_COUNT`` cannot name the
    attempt: each agent counts its own restarts, so nodes disagree (pytorch/pytorch#108158).

    How: rank 0 draws a random token and publishes it. Every other rank reads the token (possibly
    a dead attempt's), acknowledges it under ``<token>/ack/<rank>`` with a random nonce of its
    own, and waits for ``<token>/go/<nonce>``, which only a rank 0 that read this very nonce can
    write; when the published token changes meanwhile it acknowledges the new one. Rank 0 writes
    the go keys once every rank has acknowledged its token. Everyone then uses
    ``torchtitan_lite/attempt/<token>/`` as the group's store. Raises ``RuntimeError`` when the
    handshake has not completed within ``timeout_s``.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    if rank == 0:
        token = uuid.uuid4().hex
        store.set(f"{_ATTEMPT_KEY}/token", token)
        acks = [f"{_ATTEMPT_KEY}/{token}/ack/{r}" for r in range(1, world_size)]
        if acks:
            try:
                store.wait(acks, timeout)
            except dist.DistStoreError as exc:
                missing = [r for r, key in enumerate(acks, 1) if not store.check([key])]
                raise RuntimeError(f"process group: ranks {missing} did not join within {timeout_s:g} s "
                                   f"(comm.init_timeout_seconds)") from exc
            nonces = [n.decode() for n in store.multi_get(acks)]
            store.multi_set([f"{_ATTEMPT_KEY}/{token}/go/{n}" for n in nonces], ["1"] * len(nonces))
    else:
        nonce = uuid.uuid4().hex
        deadline = time.monotonic() + timeout_s
        acknowledged, poll = "", 0.01
        while True:
            token = store.get(f"{_ATTEMPT_KEY}/token").decode()  # waits for a first rank 0
            if token != acknowledged:
                store.set(f"{_ATTEMPT_KEY}/{token}/ack/{rank}", nonce)
                acknowledged, poll = token, 0.01
            if store.check([f"{_ATTEMPT_KEY}/{token}/go/{nonce}"]):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"process group: rank 0 of this attempt did not answer rank {rank} "
                                   f"within {timeout_s:g} s (comm.init_timeout_seconds)")
            time.sleep(poll)
            poll = min(poll * 2, max_poll_s)
    return dist.PrefixStore(f"{_ATTEMPT_KEY}/{token}", store)


def set_collective_timeout(seconds: float, groups: Sequence[Any] = ()) -> None:
    """Set the timeout of the default process group and of ``groups`` (the mesh's: FSDP's and the
    data-parallel collectives run on them; a background save's): a collective that a dead or hung
    peer never joins then fails with an error after ``seconds`` instead of waiting for the
    creation timeout."""
    from torch.distributed.distributed_c10d import _set_pg_timeout

    timeout = datetime.timedelta(seconds=seconds)
    seen: set[int] = set()
    for group in [dist.group.WORLD, *groups]:
        if group is not None and id(group) not in seen:
            seen.add(id(group))
            _set_pg_timeout(timeout, group)


def forget_dtensor_plans() -> None:
    """Empty DTensor's sharding and redistribution caches.

    Their keys compare meshes by layout, not identity, and their values hold the mesh (and so the
    process-group names) of the run that filled them. A second run in the same process (a new
    process group, a new mesh of the same shape) would otherwise be handed a plan whose
    collectives name groups that no longer exist: "Could not resolve the process group
    registered under the name 7" at the first gradient clipping of an HSDP job. Called when a
    mesh is built and when the process group is destroyed."""
    from torch.distributed.tensor import DTensor, _redistribute

    propagator = DTensor._op_dispatcher.sharding_propagator
    for cache in (getattr(propagator, "propagate_op_sharding", None),
                  getattr(type(propagator), "_propagate_tensor_meta_cached", None),
                  getattr(_redistribute, "_gen_transform_infos", None)):
        if hasattr(cache, "cache_clear"):
            cache.cache_clear()
    if hasattr(_redistribute, "clear_redistribute_planner_cache"):
        _redistribute.clear_redistribute_planner_cache()
    native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)  # C++ fast path's
    if native is not None:
        native()


def destroy_distributed(*, barrier: bool = True) -> None:
    """Tear the process group down.

    On a clean exit the barrier first keeps a fast rank from closing connections that a slower
    one is still using (gloo aborts the process otherwise); after an error pass
    ``barrier=False`` so a failing rank does not wait for peers stuck in a collective.
    """
    if dist.is_initialized():
        if barrier:
            dist.barrier()
        dist.destroy_process_group()
    forget_dtensor_plans()


_release_registered = False


def release_process_groups() -> None:
    """Free destroyed process groups while Python is fully alive (run at exit by ``atexit``).

    ``destroy_process_group`` only drops c10d's own references. Meshes still hold their
    groups: in reference cycles of models that are gone, and in DTensor's sharding caches,
    which live until interpreter shutdown. A gloo worker thread that then drops the last
    reference to a collective's tensor needs the GIL, cannot have it during shutdown, and
    aborts the process ("terminate called without an active exception", SIGABRT) after a
    run that succeeded. So, once no group is initialised: forget the last uncaught
    exception's traceback (its frames may hold the trainer), collect the cycles, and empty
    the group registry of every mesh still alive (none is usable now). The groups are then
    destroyed here, and their destructor joins the worker threads. Registered by
    :func:`init_distributed`; while a group is initialised this does nothing.
    """
    if dist.is_initialized():
        return
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if getattr(sys, name, None) is not None:
            setattr(sys, name, None)
    gc.collect()
    for obj in gc.get_objects():
        # The MRO, not isinstance: DeviceMesh's metaclass hook would run on every object and
        # warn about deprecated ones.
        if DeviceMesh in type(obj).__mro__:
            getattr(obj, "_pg_registry", {}).clear()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
