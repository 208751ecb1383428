"""Several processes (gloo on the CPU, 2 ranks under torchrun): DDP and FSDP2 train exactly as one process on
the same global batch, with accumulation over micro-batches of unequal token counts; a sharded run saves and
resumes exactly; each rank reads its own share of every batch."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
from helpers import SMALL_ARCH, SMALL_ARCH_ARGS

from tunekit import config, distributed, train
from tunekit.build import batch_plan, run_length
from tunekit.config import REPO_ROOT
from tunekit.data import batching
from tunekit.prepare import prepare
from tunekit.presets import tiny
from tunekit.stopping import read_metrics

WORKER = REPO_ROOT / "tests" / "e2e" / "dist_worker.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(spec: dict, tmp_path, nproc: int = 2, extra: tuple = ()) -> subprocess.CompletedProcess:
    path = tmp_path / f"spec{free_port()}.json"
    path.write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
           "127.0.0.1", "--master_port", str(free_port()), *extra, str(WORKER), str(path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT / "tests")}
    proc = subprocess.run(cmd, check=False, cwd=REPO_ROOT, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.slow
def test_a_cpu_launch_of_the_command_line_leaves_with_its_exit_code(tmp_path, small_data):
    """`torchrun -m tunekit.cli` on CPUs (gloo), as lesson 3 launches it: a run that succeeds exits 0 with its
    files written, and one that fails after its process group started exits with the command's own code. Both
    leave through `cli.leave`, without the interpreter's exit (where gloo's teardown sometimes aborted a rank)."""
    from tunekit.cli import leave

    out = tmp_path / "run"
    argv = ["train", "--preset", "tiny", "--out-dir", str(out), "--data", str(small_data), "--max-steps", "2",
            "--batch-size", "2", "--max-length", "128", "--warmup-steps", "1", *SMALL_ARCH_ARGS]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def launch() -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
               "127.0.0.1", "--master_port", str(free_port()), "-m", "tunekit.cli", *argv]
        return subprocess.run(cmd, check=False, cwd=REPO_ROOT, capture_output=True, text=True, env=env,
                              timeout=300)

    done = launch()
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert (out / "summary.json").exists() and (out / "adapter").is_dir()
    again = launch()  # the folder holds that run: refused once the group is up (RunFolderError, code 2)
    assert again.returncode != 0 and "holds another run" in again.stdout + again.stderr
    assert "exitcode  : 2" in again.stderr, again.stderr[-2000:]
    with pytest.raises(SystemExit) as e:  # no gloo group in this process: a plain exit
        leave(3)
    assert e.value.code == 3


def rows(cfg) -> list[dict]:
    return read_metrics(cfg.run_dir())


@pytest.fixture
def make(tmp_path, small_data):
    def make(name: str, **overrides) -> config.TuneConfig:
        kw = dict(out_dir=str(tmp_path / name), data=str(small_data), max_steps=4, batch_size=2, max_length=128,
                  warmup_steps=2, lr=3e-3, **SMALL_ARCH)
        return tiny(**{**kw, **overrides})
    return make


def assert_same_run(got, want, rel=1e-5):
    a, b = rows(got), rows(want)
    assert [r["step"] for r in a] == [r["step"] for r in b]
    assert [r["samples"] for r in a] == [r["samples"] for r in b] and [r["tokens"] for r in a] == [r["tokens"] for r in b]
    assert [r["loss"] for r in a] == pytest.approx([r["loss"] for r in b], rel=rel)
    assert [r["grad_norm"] for r in a] == pytest.approx([r["grad_norm"] for r in b], rel=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("parallel, packing", [("ddp", "pack"), ("ddp", "pad"), ("fsdp", "pack"), ("fsdp", "pad"),
                                               ("fsdp-keep", "pack"), ("fsdp-compiled", "pack")])
def test_two_ranks_train_as_one_process_on_the_global_batch(make, tmp_path, parallel, packing):
    """2 ranks x micro-batch 2 x accumulation 2 against 1 process x micro-batch 4 x accumulation 2. Padded
    batches give each rank and micro-batch its own target count: the loss is normalised by the step's total
    over all ranks, so the runs still agree. `fsdp-keep`: FSDP2 keeping gathered weights until backward;
    `fsdp-compiled`: each decoder block compiled (inductor) inside FSDP2's hooks, against the eager process."""
    keep, compiled = parallel == "fsdp-keep", parallel == "fsdp-compiled"
    parallel = "fsdp" if keep or compiled else parallel
    two = make(f"{parallel}-{packing}-{keep}-{compiled}", parallel=parallel, packing=packing, grad_accum=2,
               fsdp_reshard=not keep, compile="regional" if compiled else "none")
    torchrun({"config": config.config_dict(two)}, tmp_path)
    one = make(f"one-{packing}", packing=packing, grad_accum=2, batch_size=4)
    train.train(one, progress=False)
    assert_same_run(two, one)
    assert json.loads((two.run_dir() / "config.json").read_text())["parallel"] == parallel
    # The adapter rank 0 wrote (gathered from shards under FSDP2) is the one-process adapter, to 1e-5: the
    # gradients sum in another order (per rank, then across ranks), and 4 AdamW steps carry the difference.
    from safetensors.torch import load_file

    got, want = (load_file(c.run_dir() / "adapter" / "adapter_model.safetensors") for c in (two, one))
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-3, atol=1e-5)


@pytest.mark.slow
def test_a_sharded_run_resumes_exactly(make, tmp_path):
    """FSDP2: at step 2 every rank writes its shards (torch.distributed.checkpoint, nothing gathered); the run
    stops at step 3 (as a kill would), resumes from step 2, and its loss curve is that of the uninterrupted
    run."""
    killed = make("killed", parallel="fsdp", max_steps=6, save_every=2)
    torchrun({"config": config.config_dict(killed), "stop_after": 3}, tmp_path)
    assert [r["step"] for r in rows(killed)] == [1, 2, 3]
    shards = sorted(p.name for p in (killed.run_dir() / "ckpt-0000002" / "sharded").iterdir())
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp"], shards
    torchrun({"config": config.config_dict(killed), "resume": True}, tmp_path)
    clean = make("clean", max_steps=6, batch_size=4)
    train.train(clean, progress=False)
    assert_same_run(killed, clean)


def test_each_rank_reads_its_share_of_every_global_batch():
    for sampler in ("plain", "grouped"):
        def make(rank, world, bs, start=0):
            if sampler == "plain":
                return batching.EpochSampler(103, seed=3, epoch=1, start=start, rank=rank, world=world)
            lengths = list(range(103))
            return batching.LengthGroupedSampler(lengths, bs, seed=3, epoch=1, start=start, rank=rank, world=world)

        one = list(make(0, 1, 8))
        shares = [list(make(r, 2, 4)) for r in range(2)]
        assert len(shares[0]) == len(shares[1]) == 51
        assert not set(shares[0]) & set(shares[1])
        for i in range(51 // 4):  # batch i of every rank = batch i of one process with twice the batch
            assert sorted(shares[0][4 * i:4 * i + 4] + shares[1][4 * i:4 * i + 4]) == sorted(one[8 * i:8 * i + 8])
        assert list(make(1, 2, 4, start=8)) == shares[1][8:]  # a resumed rank starts where it stopped


def test_auto_parallel_is_fsdp_for_full_and_ddp_for_adapters():
    assert distributed.choose_parallel("auto", "full") == "fsdp"
    assert distributed.choose_parallel("auto", "lora") == distributed.choose_parallel("auto", "qlora") == "ddp"
    assert distributed.choose_parallel("ddp", "full") == "ddp"
    with pytest.raises(config.ConfigError, match="parallel"):
        tiny(parallel="zero3")


def test_one_process_needs_no_process_group():
    assert distributed.world_size() == 1 and distributed.rank() == 0 and distributed.is_main()
    assert distributed.all_reduce_sum(5) == 5
    assert distributed.main_first(lambda: "ran") == "ran"


def test_the_doctor_reads_infiniband_and_interfaces_from_sysfs(tmp_path):
    from tunekit import doctor

    ib, net = tmp_path / "infiniband", tmp_path / "net"
    (ib / "mlx5_0" / "ports" / "1").mkdir(parents=True)
    (ib / "mlx5_0" / "ports" / "1" / "state").write_text("4: ACTIVE\n")
    for name, state in (("eth0", "up"), ("ib0", "up"), ("lo", "unknown")):
        (net / name).mkdir(parents=True)
        (net / name / "operstate").write_text(state + "\n")
    assert doctor.infiniband_devices(str(ib)) == ["mlx5_0 port 1: ACTIVE"]
    assert doctor.network_interfaces(str(net)) == {"eth0": "up", "ib0": "up", "lo": "unknown"}
    rows = dict(doctor.distributed_report({"NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": "en"}, str(ib), str(net)))
    assert "InfiniBand port is ACTIVE" in rows["NCCL_IB_DISABLE"] and "Unset it" in rows["NCCL_IB_DISABLE"]
    assert "matches none" in rows["NCCL_SOCKET_IFNAME"] and "e.g. eth0" in rows["NCCL_SOCKET_IFNAME"]
    interfaces = doctor.network_interfaces(str(net))
    assert doctor.check_socket_ifname("eth", interfaces) is None  # a prefix, as NCCL reads it
    assert doctor.check_socket_ifname("=eth", interfaces) is not None  # `=`: exact names only
    assert doctor.check_socket_ifname("^docker,lo", interfaces) is None  # exclusions are not checked
    empty = dict(doctor.distributed_report({}, str(tmp_path / "none"), str(net)))
    assert empty["InfiniBand"].startswith("none")


@pytest.mark.slow
def test_an_interface_that_does_not_exist_is_refused_at_start(tmp_path, make):
    cfg = make("badnet")
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"config": config.config_dict(cfg)}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), str(WORKER), str(spec)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "nope0"}
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode != 0
    assert "GLOO_SOCKET_IFNAME=nope0 matches none of this machine's interfaces" in proc.stdout + proc.stderr


@pytest.mark.slow
def test_a_rank_that_dies_stops_the_others_with_an_error(tmp_path, make):
    """Rank 1 exits at its first step; rank 0, waiting in the step's all-reduce, fails within seconds
    (gloo sees the closed connection) instead of hanging until the timeout."""
    import time

    cfg = make("dies", max_steps=50)
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"config": config.config_dict(cfg), "die_on_rank": 1}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), str(WORKER), str(spec)]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode != 0 and time.monotonic() - t0 < 120


@pytest.mark.slow
def test_two_nodes_on_localhost_train_as_one_process(make, tmp_path):
    """Two torchrun "nodes" of one process each (--nnodes 2, --node_rank 0 and 1, one master address): the
    multi-node launch of the README, on one machine."""
    two = make("nodes")
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"config": config.config_dict(two)}))
    port, env = free_port(), {**os.environ, "OMP_NUM_THREADS": "1"}
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(n),
                               "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", str(port),
                               str(WORKER), str(spec)], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for n in (0, 1)]
    logs = [p.communicate(timeout=600)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], "\n".join(log[-2000:] for log in logs)
    one = make("one", batch_size=4)
    train.train(one, progress=False)
    assert_same_run(two, one)


@pytest.mark.slow
def test_accelerate_launch_with_the_shipped_config(make, tmp_path):
    """`accelerate launch --config_file tunekit/launch/accelerate_ddp.yaml` starts the processes; tunekit does
    the rest (on this CPU machine they use gloo)."""
    pytest.importorskip("accelerate")
    two = make("accelerate")
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"config": config.config_dict(two)}))
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(REPO_ROOT / "tunekit" / "launch" / "accelerate_ddp.yaml"), "--num_processes", "2", "--main_process_port",
           str(free_port()), str(WORKER), str(spec)]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    one = make("one", batch_size=4)
    train.train(one, progress=False)
    assert_same_run(two, one)


def test_global_batch_sets_the_accumulation_for_the_gpus_there_are():
    cfg = tiny(batch_size=2, global_batch=16)
    assert batch_plan(cfg, 1).grad_accum == 8 and batch_plan(cfg, 2).grad_accum == 4
    assert batch_plan(tiny(grad_accum=3), 2).grad_accum == 3  # unset: grad_accum as given
    with pytest.raises(config.ConfigError, match=r"'global_batch' = 6: .* batch_size 2 on 2 GPU\(s\) \(4 rows each\); "
                                                 r"use 4 or 8"):
        batch_plan(tiny(batch_size=2, global_batch=6), 2)


def test_a_global_batch_that_does_not_divide_is_refused_before_any_work(make):
    cfg = make("uneven", batch_size=4, global_batch=6)
    with pytest.raises(config.ConfigError, match="global_batch"):
        train.train(cfg, progress=False)
    assert not cfg.run_dir().exists()


@pytest.mark.slow
def test_a_resume_on_another_number_of_processes_is_refused(make, tmp_path):
    from tunekit import checkpoint

    two = make("two", parallel="ddp", max_steps=6, save_every=2)
    torchrun({"config": config.config_dict(two), "stop_after": 3}, tmp_path)
    assert checkpoint.checkpoint_world(checkpoint.latest_checkpoint(two.run_dir())) == 2
    with pytest.raises(checkpoint.CheckpointError, match=r"written by a run on 2 process\(es\), this one has 1"):
        train.train(two, resume=True, progress=False)


def test_the_run_length_counts_each_ranks_share_of_the_rows():
    """40 rows, batch 4: 10 batches an epoch in one process, 5 on each of 2 (each rank reads 20 rows)."""
    cfg = tiny(batch_size=4, epochs=2.0)
    assert run_length(cfg, 40, 1, say=lambda *a: None).max_steps == 20
    assert run_length(cfg, 40, 2, say=lambda *a: None).max_steps == 10
    assert len(batching.EpochSampler(40, seed=0, rank=1, world=2)) // 4 == 5  # what the loader gives a rank


@pytest.mark.slow
def test_too_few_rows_for_every_rank_is_an_error_not_a_hang(make, tmp_path):
    """Enough packed rows for one batch in one process, but not once they are split between 2 ranks: without
    the check, each rank's loader would give no batch and the loop would wait for one forever."""
    cfg = make("few")
    rows = prepare(cfg, verbose=False)[2]["packed_rows"]
    few = make("few2", batch_size=rows // 2 + 1)
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"config": config.config_dict(few)}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), str(WORKER), str(spec)]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode != 0
    assert f"packed rows on each of 2 processes, fewer than one batch of {rows // 2 + 1}" in proc.stdout + proc.stderr
