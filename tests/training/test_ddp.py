"""training/distributed.py: `torchrun` with 2 gloo ranks (`--strategy ddp`) takes the
single-process steps (float64 on the toy), its checkpoint resumes as 1 rank, and 2 fsdp2 ranks
started by `--nproc 2` resume a 1-process run."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from store.run_files import MetricsLog
from tests.helpers import REPO
from training import checkpoint as ckpt
from training.config import TrainConfig
from training.trainer import train

SETTINGS = dict(objective="grpo", dtype="float64", batch_size=24, token_budget=160, lr=1e-3, seed=3)


def weights(run_dir, step):
    return load_file(ckpt.checkpoint_dir(run_dir, step) / "model.safetensors")


def max_diff(a, b):
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def torchrun_train(run_dir, toy_dir, steps, self_launched=False, strategy="ddp"):
    """`groupforge train --strategy ddp|fsdp2` on 2 ranks: under the user's torchrun, or with --nproc 2."""
    flags = [f"--{key.replace('_', '-')}={value}" for key, value in SETTINGS.items()]
    train_cmd = ["train", str(run_dir), "--steps", str(steps), "--model", str(toy_dir / "model"),
                 "--strategy", strategy, *flags]
    if self_launched:
        cmd = [sys.executable, "-m", "pipelines.cli", *train_cmd, "--nproc", "2"]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "pipelines.cli", *train_cmd]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


@pytest.mark.parametrize("strategy", [
    # fsdp2 checks all ddp does and more; ddp ranks also train in test_trainer.py's grad-noise check
    pytest.param("ddp", marks=pytest.mark.exhaustive),
    "fsdp2",
])
def test_two_gloo_ranks_take_the_single_process_steps_and_resume_as_one(curated_run, toy_dir, tmp_path, strategy):
    single, ddp = tmp_path / "single", tmp_path / "ddp"
    shutil.copytree(curated_run, single)
    shutil.copytree(curated_run, ddp)
    cfg = TrainConfig(**SETTINGS)
    train(single, cfg, steps=3, model=toy_dir / "model")
    torchrun_train(ddp, toy_dir, steps=3, strategy=strategy)

    assert weights(ddp, 3)["lm_head.weight"].dtype == torch.float64
    assert max_diff(weights(single, 3), weights(ddp, 3)) < 1e-6
    assert max_diff(weights(single, 3), load_file(toy_dir / "model" / "model.safetensors")) > 1e-4  # it trained
    one, two = MetricsLog(single).steps(), MetricsLog(ddp).steps()
    assert [s["step"] for s in two] == [1, 2, 3]  # rank 0 alone wrote, once per step
    for a, b in zip(one, two):
        assert b["rows"] == a["rows"] and b["response_tokens"] == a["response_tokens"]
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-9) and b["grad_norm"] == pytest.approx(a["grad_norm"])

    # the 2-rank checkpoint is a plain HF folder: one process resumes from it
    train(single, cfg, steps=5, model=toy_dir / "model")
    train(ddp, cfg, steps=5, model=toy_dir / "model")
    assert max_diff(weights(single, 5), weights(ddp, 5)) < 1e-6

    # and 2 ranks resume a 1-process run, started by `groupforge train --nproc 2` itself: with fsdp2,
    # whose ranks each load their shards of the full checkpoint (a ddp rank loads it whole, as one process does)
    if strategy == "ddp":
        return
    train(single, cfg, steps=6, model=toy_dir / "model")
    done = torchrun_train(ddp, toy_dir, steps=6, self_launched=True, strategy=strategy)
    assert "5 -> 6" in done.stdout  # rank 0 printed the summary, once
    assert done.stdout.count("5 -> 6") == 1
    assert max_diff(weights(single, 6), weights(ddp, 6)) < 1e-6
    assert not (ddp / ".lock").read_text()  # the lock was held by the launcher and released


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.exhaustive  # another launch (dtype) of the check above; make test-exhaustive runs it
def test_two_nodes_by_c10d_rendezvous_on_localhost(curated_run, toy_dir, tmp_path):
    """Two torchrun "nodes" (one rank each) meeting at a c10d rendezvous on 127.0.0.1, as two
    machines would: the same weights as one process."""
    single, nodes = tmp_path / "single", tmp_path / "nodes"
    shutil.copytree(curated_run, single)
    shutil.copytree(curated_run, nodes)
    train(single, TrainConfig(**SETTINGS), steps=2, model=toy_dir / "model")
    flags = [f"--{key.replace('_', '-')}={value}" for key, value in SETTINGS.items()]
    endpoint = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                               "--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                               "--rdzv-id", "gf-test", "-m", "pipelines.cli", "train", str(nodes), "--steps", "2",
                               "--model", str(toy_dir / "model"), "--strategy", "ddp", *flags],
                              cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for node in (0, 1)]
    outputs = [proc.communicate(timeout=600)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    assert max_diff(weights(single, 2), weights(nodes, 2)) < 1e-6


@pytest.mark.exhaustive  # another launch (dtype) of the check above; make test-exhaustive runs it
def test_fsdp2_in_float32_on_gloo(curated_run, toy_dir, tmp_path):
    """float32 takes another reduction path than float64 in FSDP2 (gloo has no PREMUL_SUM): it
    must run, and stay close to one process."""
    single, sharded = tmp_path / "single", tmp_path / "fsdp2"
    shutil.copytree(curated_run, single)
    shutil.copytree(curated_run, sharded)
    float32 = {**SETTINGS, "dtype": "float32"}
    train(single, TrainConfig(**float32), steps=2, model=toy_dir / "model")
    flags = [f"--{key.replace('_', '-')}={value}" for key, value in float32.items()]
    done = subprocess.run([sys.executable, "-m", "pipelines.cli", "train", str(sharded), "--steps", "2", "--model",
                           str(toy_dir / "model"), "--strategy", "fsdp2", "--nproc", "2", *flags], cwd=REPO,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert weights(sharded, 2)["lm_head.weight"].dtype == torch.float32
    assert max_diff(weights(single, 2), weights(sharded, 2)) < 1e-4
