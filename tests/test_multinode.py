"""Training across machines: two torchrun agents on this machine act as two nodes (loopback)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import TINY_ARGS
from tests.dist_utils import REPO_ROOT, free_port, read_jsonl, run_distributed

JOB = [*TINY_ARGS, "--training.steps", "4", "--training.local_batch_size", "1",
       "--training.global_batch_size", "4"]


def _agent(dump: Path, port: int) -> subprocess.Popen[str]:
    """One torchrun agent ("node") of a 2-node job with 2 processes per node."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=2",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=loopback",
           "--local-addr=127.0.0.1", "--max-restarts=0",
           "-m", "torchtitan_lite.train", *JOB, "--job.dump_folder", str(dump)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)


def _one_node_default_mesh(argv: list[str]) -> dict[str, Any]:
    """Train with ``argv`` on one node's ranks (torchrun's variables: LOCAL_WORLD_SIZE is the
    world size); the mesh the trainer built."""
    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.trainer import Trainer

    trainer = Trainer(load_job_config(argv))
    mesh = trainer.mesh.describe()
    trainer.train()
    trainer.close()
    return mesh


@pytest.mark.slow
@pytest.mark.runner  # the runner's node_killed_two_loopback_nodes case launches two loopback nodes too
def test_two_loopback_nodes_form_an_hsdp_mesh_and_match_one_agent(tmp_path):
    dump = tmp_path / "two_nodes"
    port = free_port()
    agents = [_agent(dump, port), _agent(dump, port)]
    outputs = []
    try:
        for agent in agents:
            out, _ = agent.communicate(timeout=240)
            outputs.append(out)
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()
    assert [a.returncode for a in agents] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    log = "\n".join(outputs)
    # The default replicate degree (0) puts one replica on each node: 2 × (world / 2).
    assert "mesh {'dp_replicate': 2, 'dp_shard': 2}" in log, log[-3000:]
    two_nodes = [r["loss"] for r in read_jsonl(dump / "metrics.jsonl")]
    assert len(two_nodes) == 4

    # One node's 4 processes with the same mesh (the test helper's ranks, with torchrun's
    # variables): the same ranks do the same work, bitwise.
    meshes = run_distributed(_one_node_default_mesh, 4, [*JOB, "--job.dump_folder", str(tmp_path / "one_agent"),
                                                         "--parallelism.data_parallel_replicate_degree", "2"])
    assert meshes == [{"dp_replicate": 2, "dp_shard": 2}] * 4
    one_agent = [r["loss"] for r in read_jsonl(tmp_path / "one_agent" / "metrics.jsonl")]
    assert two_nodes == one_agent
    # (On one node the default is plain FSDP over all 4 ranks: test_default_replicate_degree_is_one_replica_per_node;
    # HSDP's losses equal FSDP's: tests/test_checkpoint_manager.py, test_resume_across_layouts.py.)


def test_default_replicate_degree_is_one_replica_per_node():
    from torchtitan_lite.distributed import ParallelDims

    def dims(replicate: int, shard: int, world: int, local: int | None) -> tuple[int, int]:
        d = ParallelDims.resolve(dp_replicate=replicate, dp_shard=shard, world_size=world, local_world_size=local)
        return d.dp_replicate, d.dp_shard

    assert dims(0, -1, 16, 8) == (2, 8)  # 2 nodes of 8: shard within a node
    assert dims(0, -1, 8, 8) == (1, 8)  # one node: plain FSDP
    assert dims(0, -1, 8, None) == (1, 8)  # no torchrun: one node
    assert dims(0, 4, 16, 8) == (4, 4)  # an explicit shard degree: replicate over the rest
    assert dims(1, -1, 16, 8) == (1, 16)  # 1: shard over every rank of every node
    import pytest

    with pytest.raises(ValueError, match="data_parallel_replicate_degree=-2 must be >= 1, -1"):
        ParallelDims.resolve(dp_replicate=-2, dp_shard=-1, world_size=4)


@pytest.mark.scenario  # (left out of the default selection: .ci/run runs it; docs/testing.md)
@pytest.mark.slow
def test_launcher_script_runs_a_job_and_slurm_script_parses(tmp_path):
    from tests.dist_utils import run_command

    result = run_command(["bash", "scripts/run_train.sh", *JOB, "--job.dump_folder", str(tmp_path / "job"),
                          "--training.steps", "2"], timeout=180, extra_env={"NGPU": "2"})
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-2000:])
    assert [r["step"] for r in read_jsonl(tmp_path / "job" / "metrics.jsonl")] == [1, 2]
    assert "mesh {'dp_shard': 2}" in result.stdout  # one node: plain FSDP over its ranks
    missing = run_command(["bash", "scripts/run_train.sh"], timeout=60, extra_env={"NNODES": "2", "NGPU": "1"})
    assert missing.returncode != 0 and "set RDZV_ENDPOINT=HOST:PORT" in missing.stderr
    assert run_command(["bash", "-n", "scripts/multinode_trainer.slurm"], timeout=30).returncode == 0
