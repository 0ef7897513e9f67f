"""config/slurm.sbatch under a real Slurm on this machine: a cluster of two nodes, each a network namespace with
its own address and host name (node1, node2), a node daemon in each and the controller on node1, started here as
root. A job requeued in the middle of its run, on one node with two processes or on two nodes with one each, saves
on the signal, starts again, resumes from that step and ends with the losses and weights of the same run started by
torchrun directly, bit for bit, its log saying so in a line each. A user's mistakes (no --init_from=auto in the
script, a requeue onto other settings, an out_dir one node does not see) end in one line and lose nothing. Skipped,
with the reason, where Slurm is not installed (Debian: apt-get install slurm-wlm) or the tests do not run as root."""

import os
import re
import shutil
import subprocess
import time

import pytest

from helpers import CPU_ENV, ROOT, STANDARD, assert_weights_close, losses, on_cpu, standard_run, weights

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not all(map(shutil.which, ("slurmctld", "slurmd", "munged", "ip", "nsenter", "unshare"))) or os.geteuid() != 0,
    reason="needs Slurm and munge (apt-get install slurm-wlm), iproute2 and root, to start a cluster of two "
           "network namespaces here")]

# The job's step 5 waits for the signal of the test's requeue (at most 120 s), once a process: the requeue lands in
# the middle of the run however loaded the machine is. Only the time changes, not what is computed.
PAUSE = """
import os as _os, signal as _signal, time as _time
import lib.data as _data
_train, _mark = _data.Batches.train, {mark!r} + _os.environ["RANK"]
def _paused(self, step, index):
    if step == 5 and not _os.path.exists(_mark):
        open(_mark, "w").close()
        _stop, _until = getattr(_signal.getsignal(_signal.SIGTERM), "__self__", None), _time.monotonic() + 120
        while not getattr(_stop, "requested", False) and _time.monotonic() < _until:  # (train.py's StopRequest)
            _time.sleep(0.05)
    return _train(self, step, index)
_data.Batches.train = _paused
"""


def slurm_conf(folder):
    # two nodes of this machine's CPUs; ports apart from a cluster's defaults; requeued jobs kept and requeueable
    return f"""ClusterName=gpttest
SlurmctldHost=node1
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool-%n
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd-%n.pid
SlurmctldPort=6917
SlurmdPort=6918
JobRequeue=1
KillWait=30
MinJobAge=600
NodeName=node1 NodeAddr=10.77.0.1 CPUs={os.cpu_count()} RealMemory=1000 State=UNKNOWN
NodeName=node2 NodeAddr=10.77.0.2 CPUs={os.cpu_count()} RealMemory=1000 State=UNKNOWN
PartitionName=test Nodes=node1,node2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


class Cluster:
    """Two nodes: network namespaces joined by a virtual cable, each process in them under its node's host name,
    with /etc/hosts naming both. Node 2 mounts a folder of its own over `unshared` (an out_dir it does not share)."""

    def __init__(self, folder):
        self.folder, self.unshared, tag = folder, folder / "unshared", f"gpt{os.getpid()}"
        self.spaces = [f"{tag}n1", f"{tag}n2"]
        self.unshared.mkdir()
        (folder / "state").mkdir()
        (folder / "hosts").write_text("127.0.0.1 localhost\n::1 localhost\n10.77.0.1 node1\n10.77.0.2 node2\n")
        (folder / "slurm.conf").write_text(slurm_conf(folder))
        self.env = {**os.environ, "SLURM_CONF": str(folder / "slurm.conf")}
        cable = [f"{tag}a", f"{tag}b"]
        ip = [["netns", "add", self.spaces[0]], ["netns", "add", self.spaces[1]],
              ["link", "add", cable[0], "type", "veth", "peer", "name", cable[1]]]
        for n, (space, end) in enumerate(zip(self.spaces, cable), 1):
            ip += [["link", "set", end, "netns", space], ["-n", space, "link", "set", end, "name", "eth0"],
                   ["-n", space, "addr", "add", f"10.77.0.{n}/24", "dev", "eth0"],
                   ["-n", space, "link", "set", "eth0", "up"], ["-n", space, "link", "set", "lo", "up"]]
        for args in ip:
            subprocess.run(["ip", *args], check=True, capture_output=True)

    def command(self, node, *args):
        # args as a process of node (1 or 2) runs them
        mounts = f"mount --bind {self.folder}/hosts /etc/hosts"
        if node == 2:
            mounts += f" && mount -t tmpfs none {self.unshared}"
        return ["nsenter", f"--net=/run/netns/{self.spaces[node - 1]}", "unshare", "--uts", "--mount",
                "--propagation", "private", "sh", "-c", f'hostname node{node} && {mounts} && exec "$@"', "sh", *args]

    def run(self, *args, cwd=None, env=None):
        # a Slurm command (sbatch, scontrol, sinfo) typed on node 1
        return subprocess.run(self.command(1, *args), cwd=cwd, env={**self.env, **(env or {})}, capture_output=True,
                              text=True)

    def end(self):
        for space in self.spaces:
            subprocess.run(["ip", "netns", "del", space], capture_output=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # the cluster of this module's tests: munge (started if it is not), slurmctld on node 1, a slurmd on each node
    if subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode != 0:
        for path in ("/run/munge", "/var/log/munge", "/var/lib/munge", "/etc/munge"):
            os.makedirs(path, exist_ok=True)
            shutil.chown(path, "munge", "munge")
        subprocess.run(["runuser", "-u", "munge", "--", "munged"], check=True)
    cluster = Cluster(tmp_path_factory.mktemp("slurm"))
    conf, daemons = str(cluster.folder / "slurm.conf"), []
    try:
        for node, daemon in ((1, ["slurmctld"]), (1, ["slurmd", "-N", "node1"]), (2, ["slurmd", "-N", "node2"])):
            daemons.append(subprocess.Popen(cluster.command(node, *daemon, "-D", "-f", conf), env=cluster.env,
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        wait_for(lambda: cluster.run("sinfo", "-h", "-o", "%T %D").stdout.strip() == "idle 2", 60)
        yield cluster
    finally:
        cluster.run("scancel", "--full", "--user=root")
        for daemon in daemons:
            daemon.terminate()
            daemon.wait(timeout=30)
        cluster.end()


def script(folder, mistake=None):
    # config/slurm.sbatch as its comment tells a CPU cluster's user to make it: the --gpus-per-node line deleted
    text = "".join(line for line in (ROOT / "config" / "slurm.sbatch").read_text().splitlines(True)
                   if "--gpus-per-node" not in line)
    path = folder / "cpu.sbatch"
    path.write_text(text.replace(" --init_from=auto", "") if mistake == "no auto" else text)
    return path


def submit(cluster, script, nodes, log, *args):
    # sbatch SCRIPT ARGS as a user types it, on `nodes` nodes, two processes in all -> the job's id
    done = cluster.run("sbatch", "--parsable", f"--nodes={nodes}", f"--cpus-per-task={os.cpu_count()}", "--time=10",
                       f"--output={log}", str(script), *map(str, args), cwd=ROOT,
                       env={**CPU_ENV, "PROCS_PER_NODE": str(2 // nodes)})
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().split(";")[0]


def state(cluster, job):
    return re.search(r"JobState=(\w+)", cluster.run("scontrol", "show", "job", job).stdout)[1]


def wait_for(what, timeout=240):
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, f"waited {timeout} s"
        time.sleep(0.3)


def requeue_at_step_5(cluster, job, log):
    # the job's step 5 begun (PAUSE): requeued, as a preemption is (SIGTERM, then the job pending again), and
    # started again at once (a requeued job waits 2 minutes or so otherwise)
    wait_for(lambda: log.exists() and re.search(r"^step 4: ", log.read_text(), re.M))
    assert cluster.run("scontrol", "requeue", job).returncode == 0
    wait_for(lambda: state(cluster, job) == "PENDING")


def release(cluster, job):
    assert cluster.run("scontrol", "update", f"jobid={job}", "StartTime=now").returncode == 0
    wait_for(lambda: state(cluster, job) in ("COMPLETED", "FAILED"))


def job_args(tmp_path, data_dir, out_dir):
    (tmp_path / "pause.py").write_text(PAUSE.format(mark=str(tmp_path / "paused-")))
    return on_cpu([*STANDARD, f"--data_dir={data_dir}", f"--out_dir={out_dir}", tmp_path / "pause.py"])


@pytest.mark.parametrize("nodes", [1, 2], ids=["one node, two processes", "two nodes, one process each"])
def test_a_requeued_job_resumes_where_it_saved_and_ends_as_one_never_stopped(cluster, nodes, data_dir, tmp_path,
                                                                             shared):
    log, out = tmp_path / "job.out", tmp_path / "run"
    job = submit(cluster, script(tmp_path), nodes, log, *job_args(tmp_path, data_dir, out))
    requeue_at_step_5(cluster, job, log)
    release(cluster, job)
    said = log.read_text()
    assert state(cluster, job) == "COMPLETED", said
    assert re.findall(r"^SIGTERM: saved step (\d+) in ", said, re.M) == ["5"], said
    assert f"resuming {out}/ckpt.pt at step 5" in said and f"job {job}, start 2: {nodes} node(s)" in said, said
    assert said.count("torchrun: SIGTERM, its workers stopped") == nodes and "Traceback" not in said, said
    # the same run started by torchrun directly on 2 processes, never stopped (made once for the session)
    direct = standard_run(shared, data_dir, "ddp")
    assert losses(out) == losses(direct)
    assert_weights_close(weights(out), weights(direct), atol=0)


def test_a_users_mistakes_end_in_one_line_and_lose_nothing(cluster, data_dir, tmp_path):
    # a requeue onto other settings: the config file of the job's command changed while the job waited
    log, out, settings = tmp_path / "job.out", tmp_path / "run", tmp_path / "settings.py"
    settings.write_text("n_embd = 32\n")
    job = submit(cluster, script(tmp_path), 1, log, *job_args(tmp_path, data_dir, out), settings)
    requeue_at_step_5(cluster, job, log)
    saved = (out / "ckpt.pt").read_bytes()
    settings.write_text("n_embd = 64\n")
    release(cluster, job)
    said = log.read_text().split(f"job {job}, start 2")[1]
    refusals = [line for line in said.splitlines() if "n_embd" in line and "train.py: " in line]
    assert state(cluster, job) == "FAILED" and len(refusals) == 2, said  # one line from each process
    assert "Traceback" not in said and "torchrun: train.py's rank " in said, said
    assert (out / "ckpt.pt").read_bytes() == saved
    # the script without --init_from=auto: a start on the run that has a checkpoint is refused
    settings.write_text("n_embd = 32\n")
    job = submit(cluster, script(tmp_path, "no auto"), 1, tmp_path / "again.out", *job_args(tmp_path, data_dir, out),
                 settings)
    wait_for(lambda: state(cluster, job) in ("COMPLETED", "FAILED"))
    refusals = [line for line in (tmp_path / "again.out").read_text().splitlines() if "holds a run already" in line]
    assert state(cluster, job) == "FAILED" and len(refusals) == 2, refusals
    assert (out / "ckpt.pt").read_bytes() == saved
    # an out_dir that node 2 does not share (its own folder is mounted there): refused before a step
    own = cluster.unshared / "run"
    job = submit(cluster, script(tmp_path), 2, tmp_path / "unshared.out", *job_args(tmp_path, data_dir, own))
    wait_for(lambda: state(cluster, job) in ("COMPLETED", "FAILED"))
    said = (tmp_path / "unshared.out").read_text()
    assert state(cluster, job) == "FAILED" and f"out_dir={own} is not shared: " in said, said
    assert "Traceback" not in said and not re.search(r"^iter \d", said, re.M), said
