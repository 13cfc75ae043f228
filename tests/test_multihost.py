"""Tier (c): two hosts with their own addresses. Two Linux network namespaces joined by a veth pair
(10.77.0.1 = node 0: trainer + verifier, 10.77.0.2 = node 1: actor), `bash run.sh` in each with
NNODES=2 MASTER_ADDR=10.77.0.1: nothing is reachable on loopback across them, and each has its own
interface, so a socket bound to the wrong address or gloo advertising the wrong interface fails here
(on one machine's loopback it cannot). Also: node 1's link cut half-way (no RST reaches node 0, as with a
dead host) and restored: the actor comes back into the run; and scripts/slurm_node.sh's mapping of
SLURM's variables (called directly: there is no srun here). Without namespaces: a MASTER_ADDR that is not
node 0's own fails before any process starts; scripts/slurm.sbatch hands srun node 0's address and one run.dir
(stand-ins for scontrol and srun print what they are given).

The namespace tests need root and iproute2 (`ip netns`); skipped otherwise, with the reason.
Run: bash run.sh test tests/test_multihost.py      (about 2 minutes on 2 shared cores)
"""
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import REPO
from test_e2e import check_run_dir, short_config, trainer_steps

ADDRS = ("10.77.0.1", "10.77.0.2")  # only ever assigned inside the namespaces this module creates


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check).stdout


def _cannot_make_namespaces():
    if shutil.which("ip") is None:
        return "needs iproute2's `ip` to create network namespaces"
    if os.geteuid() != 0:
        return "needs root to create network namespaces (CI runs as root)"
    return None


def _kill_all(ns):
    """SIGKILL every process in namespace `ns`; -> their pids."""
    pids = [int(p) for p in _ip("netns", "pids", ns, check=False).split()]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


@pytest.fixture
def hosts():
    """Two namespaces joined by a veth pair: {"ns": (ns0, ns1), "dev": (veth0, veth1)}. Torn down (every
    process in them killed, namespaces deleted) even when the test fails."""
    reason = _cannot_make_namespaces()
    if reason:
        pytest.skip(reason)
    tag = f"prl{os.getpid()}"
    ns, dev = (f"{tag}n0", f"{tag}n1"), (f"{tag}v0", f"{tag}v1")
    try:
        try:
            _ip("netns", "add", ns[0])
        except subprocess.CalledProcessError as e:  # root without CAP_SYS_ADMIN (a default docker container)
            if "Operation not permitted" in e.stderr:
                pytest.skip(f"cannot create network namespaces here: {e.stderr.strip()}")
            raise
        _ip("netns", "add", ns[1])
        _ip("link", "add", dev[0], "type", "veth", "peer", "name", dev[1])
        for n, d, a in zip(ns, dev, ADDRS):
            _ip("link", "set", d, "netns", n)
            _ip("-n", n, "addr", "add", f"{a}/24", "dev", d)
            _ip("-n", n, "link", "set", "lo", "up")
            _ip("-n", n, "link", "set", d, "up")
        yield {"ns": ns, "dev": dev}
    finally:
        for n in ns:
            _kill_all(n)
        time.sleep(0.5)
        for n in ns:
            _ip("netns", "del", n, check=False)  # the veth pair goes with its namespace


def config(model_dir, run_dir, **extra):
    """test_e2e's few steps on a random tiny model, on free ports; one core for each node's roles."""
    return short_config(model_dir, run_dir, **{"trainer.cpu_cores": "1", "verifier.cpu_cores": "1",
                                                "actor.cpu_cores": "0", **extra})


def start_node(ns, args, env, cmd=("bash", "run.sh")):
    """`cmd args` on the host that namespace `ns` is, with `env` added to (or, where None, removed from) ours."""
    env = {k: v for k, v in {**os.environ, **env}.items() if v is not None}
    return subprocess.Popen(["ip", "netns", "exec", ns, *cmd, *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)


def plain_env(rank):
    return {"NNODES": "2", "NODE_RANK": str(rank), "MASTER_ADDR": ADDRS[0]}


def finish(proc, timeout):
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"run.sh did not finish in {timeout} s:\n" + out[-5000:])
    return proc.returncode, out


def logs(run_dir):
    """The tail of each role's log, for failure messages."""
    paths = sorted((Path(run_dir) / "logs").glob("*.log"))
    return "".join(f"\n--- {p.name} ---\n" + p.read_text()[-3000:] for p in paths)


def test_master_addr_must_be_node0s_own(tmp_path):
    """Node 0 binds MASTER_ADDR: an address it does not hold fails at once (else: the verifier's bind fails
    after the trainer has started, or node 1 waits run.peer_timeout_s)."""
    env = {**os.environ, "NNODES": "2", "NODE_RANK": "0", "MASTER_ADDR": ADDRS[0]}  # not this host's address
    r = subprocess.run(["bash", "run.sh", f"run.dir={tmp_path}/run"], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"config error: MASTER_ADDR={ADDRS[0]}: {ADDRS[0]} is not an address of node 0 (this node)" in r.stderr
    assert "started" not in r.stdout and not (tmp_path / "run").exists()


def test_two_hosts(tiny_model_dir, tmp_path, hosts):
    run_dir = tmp_path / "run"
    args = config(tiny_model_dir, run_dir)
    node0 = start_node(hosts["ns"][0], args, plain_env(0))
    node1 = start_node(hosts["ns"][1], args, plain_env(1))
    rc0, out0 = finish(node0, 400)
    rc1, out1 = finish(node1, 120)
    assert rc0 == 0, out0[-5000:] + logs(run_dir)
    assert rc1 == 0, out1[-5000:] + logs(run_dir)
    assert "node 0/2 runs: store verifier trainer" in out0 and "node 1/2 runs: watch actor" in out1
    assert f"GLOO_SOCKET_IFNAME={hosts['dev'][0]}" in out0 and f"GLOO_SOCKET_IFNAME={hosts['dev'][1]}" in out1
    assert trainer_steps(run_dir)[-1] == 4
    check_run_dir(run_dir)  # as test_e2e's loopback test: per-token versions over the veth, lag bound, checkpoint
    time.sleep(1)
    left = {n: _ip("netns", "pids", n).split() for n in hosts["ns"]}
    assert not any(left.values()), f"orphans: {left}"


def slurm_env(rank):
    """What srun gives task `rank` of a 2-node job (one task per node), plus NNODES/NODE_RANK inherited from the
    submitting shell, which slurm_node.sh must override. MASTER_ADDR is given: there is no scontrol here."""
    return {"SLURM_NNODES": "2", "SLURM_NODEID": str(rank), "SLURM_PROCID": str(rank), "SLURM_JOB_ID": "77",
            "SLURM_JOB_NODELIST": "node[001-002]", "MASTER_ADDR": ADDRS[0], "NNODES": "1", "NODE_RANK": "0"}


def test_sbatch_hands_srun_master_addr_and_one_run_dir(tmp_path):
    """scripts/slurm.sbatch's batch step, with stand-ins for scontrol and srun (neither exists here) that print
    what they were given: node 0 = the first host of the allocation, one run.dir for every node."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text('#!/bin/sh\n[ "$*" = "show hostnames gpu[07-08]" ] && printf "gpu07\\ngpu08\\n"\n')
    (bin_dir / "srun").write_text('#!/bin/sh\necho "MASTER_ADDR=$MASTER_ADDR srun $*"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_SUBMIT_DIR": str(REPO),
           "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_NNODES": "2", "SLURM_JOB_ID": "42"}
    env.pop("MASTER_ADDR", None)

    def run(*args):
        return subprocess.run(["bash", str(REPO / "scripts/slurm.sbatch"), *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=60)
    r = run("trainer.lr=1e-6")
    assert r.stdout.strip() == ("MASTER_ADDR=gpu07 srun --nodes=2 --ntasks-per-node=1 --kill-on-bad-exit=1 bash "
                                "scripts/slurm_node.sh trainer.lr=1e-6 run.dir=runs/slurm-42"), r.stdout + r.stderr
    env["MASTER_ADDR"] = "10.0.0.7"  # given: kept
    r = run("run.dir=/shared/exp1")
    assert r.stdout.strip().endswith("slurm_node.sh run.dir=/shared/exp1") and "MASTER_ADDR=10.0.0.7 " in r.stdout


def test_slurm_nodes_then_the_actor_hosts_link_cut_and_restored(tiny_model_dir, tmp_path, hosts):
    """Both nodes started as srun would start scripts/slurm.sbatch's tasks (scripts/slurm_node.sh, called
    directly) and run across the veth; then node 1's link goes down (no RST or FIN reaches node 0, as with a
    dead host) for longer than run.heartbeat_timeout_s, and comes back. Node 0's trainer counts the actor
    lost, its ledger gives its groups back, the trainer's roster is formed again without it; once the link is back, the actor
    (still running: its engine was never restarted) finds itself out of the roster, comes back as a new
    incarnation, is taken in, and the run goes to its last step on both nodes."""
    run_dir = tmp_path / "run"
    args = config(tiny_model_dir, run_dir, **{"trainer.max_steps": 12, "run.peer_timeout_s": 120,
                                              "run.heartbeat_timeout_s": 3, "sync.timeout_s": 120})
    slurm_node = ("bash", "scripts/slurm_node.sh")
    node0 = start_node(hosts["ns"][0], args, slurm_env(0), slurm_node)
    node1 = start_node(hosts["ns"][1], args, slurm_env(1), slurm_node)
    deadline = time.time() + 400
    while len(trainer_steps(run_dir)) < 2:
        assert node0.poll() is None and node1.poll() is None and time.time() < deadline, \
            node0.communicate()[0][-3000:] if node0.poll() is not None else logs(run_dir)
        time.sleep(0.5)
    ledger_log = run_dir / "logs" / "store.log"  # the ledger's lines
    _ip("-n", hosts["ns"][1], "link", "set", hosts["dev"][1], "down")
    while "actor incarnation 1 lost" not in ledger_log.read_text():
        assert node0.poll() is None and time.time() < deadline, logs(run_dir)
        time.sleep(0.5)
    steps_while_cut = len(trainer_steps(run_dir))
    _ip("-n", hosts["ns"][1], "link", "set", hosts["dev"][1], "up")
    rc0, out0 = finish(node0, 300)
    rc1, out1 = finish(node1, 120)
    assert rc0 == 0, out0[-5000:] + logs(run_dir)
    assert rc1 == 0, out1[-5000:] + logs(run_dir)
    assert "node 0/2 runs: store verifier trainer" in out0 and "node 1/2 runs: watch actor" in out1
    log = ledger_log.read_text()
    # silent for 3 s, or (the broadcast to it failed first) absent from the roster formed next
    assert re.search(r"actor incarnation 1 lost: (silent for 3 s|not in weight roster \d+)", log), log[-3000:]
    assert trainer_steps(run_dir)[-1] == 12 > steps_while_cut
    actor_log = (run_dir / "logs" / "actor.log").read_text()
    assert "incarnation 2, waiting for a weight roster" in actor_log, actor_log[-3000:]
    # the same engines
    assert actor_log.count("engine 0: up in") == 1 and "starting it again" not in out1, \
        actor_log[-6000:] + "\n--- node 1:\n" + out1[-3000:] + logs(run_dir)
    time.sleep(1)
    left = _ip("netns", "pids", hosts["ns"][0]).split()
    assert not left, f"orphans on node 0: {left}"
