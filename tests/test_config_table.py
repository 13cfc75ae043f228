"""Tier (a): every configuration that passes the checks before launch runs. Each row of the table is
a configuration that would hang or fail at run time (all but actor.top_p=1.5 passed the checks
before): it must fail in the checks run.sh makes before any process starts (scripts/launch.py
shell: common.validate, then this node's checks), naming the key, and the row's fix must pass.

Run: bash run.sh test tests/test_config_table.py    (a few seconds)
"""
import pytest

import common
import tasks
from common import ConfigError
from scripts import launch

FINITE = "must be a finite number"
# (overrides, NNODES, what the message says, the override that fixes it)
TABLE = [
    # only 100 distinct problems: tasks.arithmetic_test drew forever for a test split of 300
    (["data.max_digits=1"], 1, "data.test_size=300", "data.test_size=50"),
    (["data.max_digits=1"], 1, "lower data.test_size to 50 or raise data.max_digits",
     "data.max_digits=2"),
    # no group of 8 ever fits in flight: nothing is admitted
    (["actor.max_inflight=4"], 1, "actor.max_inflight*actor.engines=4 < actor.group_size=8",
     "actor.max_inflight=8"),
    (["actor.max_inflight=3", "actor.engines=2"], 1, "raise actor.max_inflight to at least 4",
     "actor.max_inflight=4"),
    # numbers that are not finite, or out of range
    (["trainer.lr=nan"], 1, f"trainer.lr=nan: {FINITE}", "trainer.lr=1e-4"),
    (["trainer.lr=.inf"], 1, f"trainer.lr=inf: {FINITE}", "trainer.lr=1e-4"),
    (["trainer.lr=-1e-4"], 1, "trainer.lr=-0.0001: must be > 0", "trainer.lr=1e-4"),
    (["run.peer_timeout_s=-1"], 1, "run.peer_timeout_s=-1.0: must be > 0", "run.peer_timeout_s=600"),
    (["run.peer_timeout_s=.inf"], 1, f"run.peer_timeout_s=inf: {FINITE}",
     "run.peer_timeout_s=600"),
    (["verifier.reward_correct=nan"], 1, f"verifier.reward_correct=nan: {FINITE}",
     "verifier.reward_correct=1"),
    (["verifier.reward_no_answer=-.inf"], 1, f"verifier.reward_no_answer=-inf: {FINITE}",
     "verifier.reward_no_answer=-1"),
    (["verifier.timeout_s=0"], 1, "verifier.timeout_s=0.0: must be > 0", "verifier.timeout_s=5"),
    (["verifier.stale_group_s=-5"], 1, "verifier.stale_group_s=-5.0: must be > 0",
     "verifier.stale_group_s=60"),
    (["verifier.max_chars=0"], 1, "verifier.max_chars=0: must be >= 1", "verifier.max_chars=100"),
    (["verifier.overlong_penalty=-1"], 1, "verifier.overlong_penalty=-1.0: must be >= 0",
     "verifier.overlong_penalty=1"),
    (["trainer.grad_clip=nan"], 1, f"trainer.grad_clip=nan: {FINITE}",
     "trainer.grad_clip=1"),
    (["trainer.weight_decay=-0.1"], 1, "trainer.weight_decay=-0.1: must be >= 0",
     "trainer.weight_decay=0"),
    (["trainer.eps=0"], 1, "trainer.eps=0.0: must be > 0", "trainer.eps=1e-8"),
    (["trainer.is_clamp=nan"], 1, f"trainer.is_clamp=nan: {FINITE}",
     "trainer.is_clamp=5"),
    (["trainer.betas=[0.9,.nan]"], 1, f"trainer.betas=(0.9, nan): {FINITE}",
     "trainer.betas=[0.9,0.99]"),
    (["trainer.betas=[0.9,1.0]"], 1, "trainer.betas=[0.9, 1.0]: each must be in [0, 1)",
     "trainer.betas=[0.9,0.99]"),
    (["actor.temperature=nan"], 1, f"actor.temperature=nan: {FINITE}",
     "actor.temperature=1"),
    (["actor.top_p=1.5"], 1, "actor.top_p=1.5: must be in (0, 1]", "actor.top_p=0.9"),
    (["actor.eval_temperature=-1"], 1, "actor.eval_temperature=-1.0: must be >= 0",
     "actor.eval_temperature=0"),
    (["actor.kv_cache_gb=0"], 1, "actor.kv_cache_gb=0.0: must be > 0", "actor.kv_cache_gb=1"),
    (["actor.gpu_memory_utilization=2"], 1, "actor.gpu_memory_utilization=2.0: must be in (0, 1]",
     "actor.gpu_memory_utilization=0.8"),
    (["sync.bucket_mb=0"], 1, "sync.bucket_mb=0.0: must be > 0", "sync.bucket_mb=32"),
    (["sync.timeout_s=nan"], 1, f"sync.timeout_s=nan: {FINITE}", "sync.timeout_s=60"),
    (["run.seed=-1"], 1, "run.seed=-1: must be >= 0", "run.seed=1"),
    (["run.log_every=-1"], 1, "run.log_every=-1.0: must be >= 0", "run.log_every=1"),
    # ports that collide (run.sh's torchrun takes sync.port+1) or do not exist
    (["sync.port=29610"], 1, "sync.port+1 and ports.rollouts are both 29611", "sync.port=29600"),
    (["sync.port=29611"], 1, "sync.port and ports.rollouts are both 29611", "sync.port=29600"),
    (["ports.samples=29611"], 1, "ports.rollouts and ports.samples are both 29611",
     "ports.samples=29615"),
    (["ports.samples=29602"], 1, "sync.port+1 and ports.samples are both 29602",
     "ports.samples=29615"),
    (["ports.rollouts=70000"], 1, "ports.rollouts=70000: must be at most 65535",
     "ports.rollouts=29620"),
    (["sync.port=65535"], 1, "sync.port+1=65536: must be at most 65535", "sync.port=29600"),
    (["ports.samples=0"], 1, "ports.samples=0: must be >= 1", "ports.samples=29615"),
    (["ports.ledger=29612"], 1, "ports.samples and ports.ledger are both 29612",
     "ports.ledger=29615"),
    # timing settings that contradict each other: a hung role is killed after run.hang_timeout_s
    # and back after run.restart_s, which a waiting peer must outlast
    (["run.peer_timeout_s=100"], 1, "run.peer_timeout_s=100 must exceed run.hang_timeout_s + "
     "run.restart_s=150", "run.restart_s=60"),
    (["run.hang_timeout_s=2"], 1, "run.hang_timeout_s=2: must be at least 5 s",
     "run.hang_timeout_s=10"),
    (["run.heartbeat_timeout_s=0.5"], 1, "run.heartbeat_timeout_s=0.5: must be at least 1 s",
     "run.heartbeat_timeout_s=2"),
    # the nodes: torchrun waited for a trainer node that never came, or no node ran an actor
    (["trainer.nnodes=2"], 1, "trainer.nnodes=2 but NNODES=1", "trainer.nnodes=1"),
    (["trainer.nnodes=2"], 2, "trainer.nnodes=2 leaves none of the NNODES=2 nodes",
     "trainer.nnodes=1"),
    # on CPU the weight group waited for the tp-1 ranks of each engine that never start
    (["actor.tp=2"], 1, "actor.tp=2: tensor parallelism needs GPUs", "actor.tp=1"),
]


def pre_launch(overrides, visible=()):
    """What run.sh runs before any process starts (launch.py shell), on a node with these GPUs."""
    return launch.shell(overrides, visible=list(visible))


@pytest.mark.parametrize("overrides,nnodes,needle,fix", TABLE, ids=[" ".join(r[0]) for r in TABLE])
def test_a_config_that_would_not_run_fails_before_launch(overrides, nnodes, needle, fix, tmp_path,
                                                         monkeypatch):
    monkeypatch.setenv("NNODES", str(nnodes))
    monkeypatch.setenv("NODE_RANK", "0")
    run_dir = f"run.dir={tmp_path}/run"  # a multi-node run names its run.dir
    with pytest.raises(ConfigError) as e:
        pre_launch([run_dir, *overrides])
    assert needle in str(e.value)
    assert fix.split("=")[0] in str(e.value), f"the message names the key to change: {e.value}"
    pre_launch([run_dir, *overrides, fix])


def test_node_rank_outside_the_nodes(monkeypatch):
    monkeypatch.setenv("NNODES", "2")
    monkeypatch.setenv("NODE_RANK", "2")
    with pytest.raises(ConfigError, match=r"NODE_RANK=2: must be in 0..NNODES-1=1"):
        pre_launch(["run.dir=/tmp/x"])


def test_tensor_parallel_on_gpus_passes():
    pre_launch(["actor.tp=2"], visible=[str(i) for i in range(3)])


def test_the_arithmetic_bound_is_the_tasks_own():
    """1-digit operands make 100 distinct problems (tasks.arithmetic_test draws all of them); half
    may be test problems, and the training stream still finds problems outside the test split."""
    assert len({p.prompt for p in tasks.arithmetic_test(100, 1, 1)}) == 100
    stream, test = tasks.load_tasks(common.load_config(["data.max_digits=1", "data.test_size=50"]))
    held_out = {p.prompt for p in test}
    assert len(held_out) == 50
    assert all(stream.get(i).prompt not in held_out for i in range(200))
    with pytest.raises(ConfigError, match="data.test_size=51"):
        common.load_config(["data.max_digits=1", "data.test_size=51"])


@pytest.mark.parametrize("overlay", [[], ["configs/longtail.yaml", "configs/conventional.yaml"]])
@pytest.mark.parametrize("inflight", [256, 2048, 4096])
def test_vllm_accepts_the_engine_settings_of_any_max_inflight(overlay, inflight, tiny_model_dir):
    """vLLM checks its own settings when it builds an engine's config (create_engine_config, no model
    loaded). Its CPU default token budget of a step (2048) is below the slots of conventional RL's
    whole-batch H for G = 16 (2,048 + 512 for evaluation): a run of that setting passed every check
    and then died as its engine started, until engine_setup.engine_args sized the budget to the slots."""
    from scripts import engine_setup
    cfg = common.load_config([*overlay, f"model.path={tiny_model_dir}",
                              f"actor.max_inflight={inflight}"])
    config = engine_setup.engine_args(cfg).create_engine_config()
    assert config.scheduler_config.max_num_seqs == inflight + engine_setup.eval_slots(cfg) + 1  # + the probe
    assert config.scheduler_config.max_num_batched_tokens >= config.scheduler_config.max_num_seqs
