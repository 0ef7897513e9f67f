"""config/slurm.sbatch under a real Slurm on this machine (a controller and a node daemon started here, as root): a
job requeued in the middle of its run saves on the signal, starts again, resumes from that step and ends with the
losses and weights of the same run started by torchrun directly, bit for bit, its log saying so in a line each; the
script without --init_from=auto refuses its second start in one line and loses nothing. Skipped, with the reason,
where Slurm is not installed (Debian: apt-get install slurm-wlm) or the tests do not run as root."""

import os
import re
import shutil
import socket
import subprocess
import time

import pytest

from helpers import CPU_ENV, ROOT, STANDARD, assert_weights_close, losses, torchrun_run, weights

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    shutil.which("slurmctld") is None or shutil.which("munged") is None or os.geteuid() != 0,
    reason="needs Slurm and munge (apt-get install slurm-wlm) and root, to start a controller and a node here")]

# the run: long enough that a requeue lands in its middle, saved only at its end and on the signal
ARGS = [*[a for a in STANDARD if not a.startswith(("--max_iters", "--eval_interval", "--keep_last_n"))],
        "--max_iters=200", "--eval_interval=1000", "--log_interval=10", "--lr_decay_iters=200", "--device=cpu"]


def slurm_conf(folder, host):
    # one node, this machine, its CPUs; ports apart from a cluster's defaults; requeued jobs kept and requeueable
    return f"""ClusterName=gpttest
SlurmctldHost={host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd.pid
SlurmctldPort=6917
SlurmdPort=6918
JobRequeue=1
KillWait=30
MinJobAge=600
NodeName={host} CPUs={os.cpu_count()} RealMemory=1000 State=UNKNOWN
PartitionName=test Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


@pytest.fixture
def slurm(tmp_path):
    # a Slurm of this machine alone, for this test: munge (started if it is not), slurmctld and slurmd, ended after
    folder, host = tmp_path / "slurm", socket.gethostname().split(".")[0]
    for sub in ("state", "spool"):
        (folder / sub).mkdir(parents=True)
    (folder / "slurm.conf").write_text(slurm_conf(folder, host))
    env = {**os.environ, "SLURM_CONF": str(folder / "slurm.conf")}
    if subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode != 0:
        for path in ("/run/munge", "/var/log/munge", "/var/lib/munge", "/etc/munge"):
            os.makedirs(path, exist_ok=True)
            shutil.chown(path, "munge", "munge")
        subprocess.run(["runuser", "-u", "munge", "--", "munged"], check=True)
    daemons = [subprocess.Popen([name, "-D", "-f", str(folder / "slurm.conf")], env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL) for name in ("slurmctld", "slurmd")]
    try:
        deadline = time.monotonic() + 60
        while "idle" not in subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True,
                                           text=True).stdout:
            assert time.monotonic() < deadline, "the Slurm of this test did not come up in 60 s"
            time.sleep(0.5)
        yield env
    finally:
        subprocess.run(["scancel", "--full", "--user=root"], env=env, capture_output=True)
        for daemon in daemons:
            daemon.terminate()
            daemon.wait(timeout=30)


def submit(env, script, out_dir, data_dir, log):
    # sbatch SCRIPT ARGS as a user types it, on one node (this machine's cores) with two processes -> the job's id
    done = subprocess.run(["sbatch", "--parsable", "--nodes=1", f"--cpus-per-task={os.cpu_count()}", "--time=10",
                           f"--output={log}", str(script), *ARGS,
                           f"--data_dir={data_dir}", f"--out_dir={out_dir}"], cwd=ROOT, capture_output=True,
                          text=True, env={**env, **CPU_ENV, "PROCS_PER_NODE": "2"}, check=True)
    return done.stdout.strip().split(";")[0]


def state(env, job):
    shown = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True).stdout
    return re.search(r"JobState=(\w+)", shown)[1]


def wait_for(what, timeout=240):
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, f"waited {timeout} s"
        time.sleep(0.5)


def test_a_requeued_job_resumes_where_it_saved_and_ends_as_one_never_stopped(slurm, data_dir, tmp_path):
    cpu = tmp_path / "cpu.sbatch"  # as its comment tells a CPU cluster's user: the --gpus-per-node line deleted
    cpu.write_text("".join(line for line in (ROOT / "config" / "slurm.sbatch").read_text().splitlines(True)
                           if "--gpus-per-node" not in line))
    log = tmp_path / "job.out"
    job = submit(slurm, cpu, tmp_path / "run", data_dir, log)
    wait_for(lambda: log.exists() and re.search(r"^iter ([5-9]\d|1\d\d):", log.read_text(), re.M))
    subprocess.run(["scontrol", "requeue", job], env=slurm, check=True)  # as a preemption: SIGTERM, then requeued
    wait_for(lambda: state(slurm, job) == "PENDING")
    subprocess.run(["scontrol", "update", f"jobid={job}", "StartTime=now"], env=slurm, check=True)  # (not in 2 min)
    wait_for(lambda: state(slurm, job) in ("COMPLETED", "FAILED"))
    said = log.read_text()
    assert state(slurm, job) == "COMPLETED", said
    saved = re.findall(r"^SIGTERM: saved step (\d+) in ", said, re.M)
    assert len(saved) == 1 and f"resuming {tmp_path / 'run'}/ckpt.pt at step {saved[0]}" in said, said
    assert "job " + job + ", start 2" in said and "torchrun: SIGTERM, its workers stopped" in said
    assert "Traceback" not in said, said
    # the same run started by torchrun directly, never stopped
    torchrun_run(["--standalone", "--nproc_per_node=2", "train.py", *ARGS, f"--data_dir={data_dir}",
                  f"--out_dir={tmp_path / 'direct'}"], {**os.environ, **CPU_ENV})
    assert losses(tmp_path / "run") == losses(tmp_path / "direct")
    assert_weights_close(weights(tmp_path / "run"), weights(tmp_path / "direct"), atol=0)
    # the script without --init_from=auto: its start on a run that has a checkpoint is refused, nothing lost
    before = (tmp_path / "run" / "ckpt.pt").read_bytes()
    cpu.write_text(cpu.read_text().replace(" --init_from=auto", ""))
    job = submit(slurm, cpu, tmp_path / "run", data_dir, tmp_path / "refused.out")
    wait_for(lambda: state(slurm, job) in ("COMPLETED", "FAILED"))
    refusal = [line for line in (tmp_path / "refused.out").read_text().splitlines() if "holds a run already" in line]
    assert state(slurm, job) == "FAILED" and len(refusal) == 2, refusal  # one line from each process
    assert (tmp_path / "run" / "ckpt.pt").read_bytes() == before
