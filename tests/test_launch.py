"""Tier (a)/(b): what run.sh checks and resolves before any process starts (scripts/launch.py: check, shell):
GPU device sets on fake device counts, model checks on tiny model directories, the HF-datasets loader,
progress and summary lines. No GPU, no network.

Run: bash run.sh test tests/test_launch.py      (about 1 minute on 2 cores)
"""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

import common
import tasks
from common import ConfigError
from conftest import REPO
from scripts import engine_setup, launch, rundir

BOTH = ("verifier", "trainer", "actor")


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """check_model remembers the models that passed under XDG_CACHE_HOME: with the real ~/.cache, a
    warm machine would skip the very checks these tests are about."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


# --- GPU device sets ------------------------------------------------------------------------------------

def gpus(overrides, roles=BOTH, n=8, visible=None):
    cfg = common.load_config(overrides)
    return launch.device_sets(cfg, roles, visible or [str(i) for i in range(n)])


def test_device_sets_defaults_follow_the_documented_layout():
    recipe = ["configs/qwen2.5-1.5b-gsm8k.yaml"]  # 4 engines, 4 trainer ranks
    assert gpus(recipe) == {"actor": "0,1,2,3", "trainer": "4,5,6,7"}
    assert gpus(recipe, visible=[str(i) for i in range(8, 16)]) == {"actor": "8,9,10,11", "trainer": "12,13,14,15"}
    assert gpus([], n=2) == {"actor": "0", "trainer": "1"}
    assert gpus(["actor.engines=2", "actor.tp=2", "trainer.nproc=2", "trainer.batch_size=16"], n=6) == \
        {"actor": "0,1,2,3", "trainer": "4,5"}
    # a trainer-only node (node 0 of a multi-node run) and an actor-only node: the first GPUs are theirs
    assert gpus(["trainer.nproc=4"], roles=("verifier", "trainer"), n=4) == {"actor": "", "trainer": "0,1,2,3"}
    assert gpus(["actor.engines=2", "actor.tp=2"], roles=("actor",), n=4) == {"actor": "0,1,2,3", "trainer": ""}
    # a listed set is kept; the other role's default takes the GPUs left free
    assert gpus(["trainer.gpus=0"], n=2) == {"actor": "1", "trainer": "0"}
    # CUDA_VISIBLE_DEVICES ids are handed out as they are named
    assert gpus([], visible=["4", "6"]) == {"actor": "4", "trainer": "6"}


def test_device_sets_on_a_cpu_machine_are_the_config_values():
    assert launch.device_sets(common.load_config([]), BOTH, []) == {"actor": "", "trainer": ""}
    cfg = common.load_config(["actor.gpus=0"])
    assert launch.device_sets(cfg, BOTH, []) == {"actor": "0", "trainer": ""}


@pytest.mark.parametrize("overrides,n,needle", [
    ([], 1, "config error: trainer.gpus: trainer.nproc=1 needs 1 GPUs but 0 of this node's 1 are free"),
    (["actor.engines=4"], 2, "actor.gpus: actor.engines*actor.tp=4 needs 4 GPUs but 2"),
    (["actor.gpus=0,1", "actor.engines=2", "trainer.gpus=1"], 4, "actor.gpus/trainer.gpus: GPU 1 is given twice"),
    (["actor.gpus=0,0", "actor.engines=2"], 4, "GPU 0 is given twice"),
    (["actor.gpus=5"], 4, "actor.gpus: GPU 5 is not visible on this node (visible: 0,1,2,3)"),
    (["trainer.gpus=1,2,3"], 4, "trainer.gpus: lists 3 GPUs but trainer.nproc=1; list 1 or change trainer.nproc"),
])
def test_device_sets_reject_naming_the_keys(overrides, n, needle):
    with pytest.raises(ConfigError) as e:
        gpus(overrides, n=n)
    assert needle in f"config error: {e.value}" and "; " in str(e.value)


@pytest.mark.parametrize("overrides,visible,needle", [
    (["actor.engines=2"], ["0"], "actor.gpus: actor.engines*actor.tp=2 needs 2 GPUs but 1"),
    (["actor.gpus=0", "actor.engines=2"], ["0", "1"], "actor.gpus: lists 1 GPUs but actor.engines*actor.tp=2"),
    (["actor.gpus=7"], ["0", "1"], "actor.gpus: GPU 7 is not visible on this node (visible: 0,1)"),
])
def test_an_actor_started_alone_checks_its_gpus(overrides, visible, needle):
    """actor.py started without run.sh runs run.sh's check of its GPUs (common.gpu_set): too few gave vLLM
    an empty device list for an engine (read as "no choice": device 0), an unknown id a bare ValueError."""
    with pytest.raises(ConfigError, match=re.escape(needle)):
        engine_setup.engine_devices(common.load_config(overrides), visible)


def test_an_actor_started_alone_maps_its_engines_to_their_gpus():
    cfg = common.load_config(["actor.engines=2", "actor.tp=2", "actor.gpus=6,7,4,5"])
    assert engine_setup.engine_devices(cfg, ["4", "5", "6", "7"]) == [[2, 3], [0, 1]]
    assert engine_setup.engine_devices(common.load_config(["actor.engines=2"]), ["3", "1", "2"]) == [[0], [1]]


def test_visible_gpus(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 3")
    assert launch.visible_gpus() == ["2", "3"]
    # empty or unset: count the devices nvidia-smi lists (here a script printing its real output format)
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-a)'\n"
                    "echo 'GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-b)'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert launch.visible_gpus() == ["0", "1"]
    monkeypatch.setenv("PATH", "/nonexistent")
    assert launch.visible_gpus() == []  # no nvidia-smi: a CPU machine


def shell_values(text):
    echo = 'echo "$ACTOR_GPUS|$TRAINER_GPUS|${ROLES[*]}|${GPU_OVERRIDES[*]}"'
    out = subprocess.run(["bash", "-c", f"{text}\n{echo}"], capture_output=True, text=True, check=True).stdout
    return out.strip().split("|")


def test_shell_hands_every_role_its_resolved_gpus(tmp_path):
    """What run.sh evals: on a GPU node the actor and trainer get non-empty sets, also as overrides (so that
    actor.py splits the same ids among its engines); on a CPU machine nothing changes."""
    run = f"run.dir={tmp_path}/run"
    assert shell_values(launch.shell([run], visible=["0", "1"])) == \
        ["0", "1", "store verifier trainer actor", "actor.gpus=0 trainer.gpus=1"]
    assert shell_values(launch.shell([run], visible=[])) == ["", "", "store verifier trainer actor", ""]
    threads = subprocess.run(["bash", "-c", launch.shell([run, "trainer.cpu_cores=0-1,3"], visible=[])
                              + '\necho "${THREADS[verifier]} ${THREADS[trainer]} ${THREADS[actor]}"'],
                             capture_output=True, text=True, check=True).stdout.split()
    assert threads == ["1", "3", "1"]  # run.sh's OMP_NUM_THREADS per role: one per core of its list
    # through the command line, as run.sh calls it, with CUDA_VISIBLE_DEVICES naming the node's
    # GPUs: the values go to the file named first, nothing to stdout
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "4,5,6,7", "NNODES": "2", "NODE_RANK": "1"}
    out = tmp_path / "values.sh"
    r = subprocess.run([sys.executable, "scripts/launch.py", "shell", out, run, "actor.engines=2",
                        "actor.tp=2"], cwd=REPO, env=env, capture_output=True, text=True)
    assert r.returncode == 0 and not r.stdout, r.stderr
    assert shell_values(out.read_text()) == ["4,5,6,7", "", "watch actor", "actor.gpus=4,5,6,7"]
    env["CUDA_VISIBLE_DEVICES"] = "0"
    out.unlink()
    r = subprocess.run([sys.executable, "scripts/launch.py", "shell", out, run], cwd=REPO,
                       env=env | {"NNODES": "1", "NODE_RANK": "0"}, capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.startswith("config error: trainer.gpus:") and not r.stdout
    assert not out.exists()


def test_run_sh_evaluates_only_what_launch_py_hands_over(tmp_path):
    """run.sh evals the assignments `launch.py shell` writes to fd 3, never its stdout, where any
    import may print (vLLM logs to stdout): here every Python start prints a shell command on stdout
    (sitecustomize), and it must not run. The run then stops at its first step after the eval: the
    run directory lies under a regular file, so mkdir fails on the RUN_DIR that came over fd 3."""
    marker = tmp_path / "executed"
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(f"print('touch {marker}')\n")
    (tmp_path / "file").write_text("")
    run_dir = tmp_path / "file" / "run"
    # two GPU ids named: the device checks pass on any machine (no role starts)
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site"), "NNODES": "1", "NODE_RANK": "0",
           "CUDA_VISIBLE_DEVICES": "0,1"}
    r = subprocess.run(["bash", "run.sh", f"run.dir={run_dir}"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=600)
    assert not marker.exists()
    assert f"touch {marker}" in r.stderr  # shown to the user
    assert r.returncode == 1, r.stderr
    assert f"{tmp_path / 'file'}" in r.stderr and "Not a directory" in r.stderr  # mkdir's message


# --- model checks -----------------------------------------------------------------------------------------

def config_only_dir(path, config):
    """A model directory holding only config.json: the checks read no weights."""
    config.save_pretrained(path)
    return str(path)


def check_model(path):
    launch.check_model(common.load_config([f"model.path={path}"]))


def test_check_model_accepts_the_tiny_model_and_one_in_the_hf_cache(tiny_model_dir, tmp_path, monkeypatch):
    assert not launch.checked_models().exists()  # nothing remembered: the check runs in full
    check_model(tiny_model_dir)
    # the local HF cache's layout: models--org--name/{refs/main, snapshots/<commit>/...}
    import huggingface_hub
    repo = tmp_path / "hub" / "models--someone--tiny-qwen2"
    shutil.copytree(tiny_model_dir, repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    check_model("someone/tiny-qwen2")
    with pytest.raises(ConfigError, match="someone/other.* is neither a local model directory nor a model in the local"):
        check_model("someone/other")


def test_check_model_rejects_what_the_trainer_or_vllm_cannot_run(tmp_path):
    from transformers import GPT2Config, XGLMConfig
    # GPT-2: vLLM loads it, but its blocks are transformer.h, not model.model.layers
    gpt2 = config_only_dir(tmp_path / "gpt2", GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=264,
                                                         architectures=["GPT2LMHeadModel"]))
    with pytest.raises(ConfigError) as e:
        check_model(gpt2)
    assert str(e.value).startswith("model.path: ") and "(GPT2LMHeadModel)" in str(e.value)
    assert "model.model.layers" in str(e.value)
    # XGLM: the trainer could shard it (model.model.layers), but vLLM 0.32 has no implementation of it
    xglm = config_only_dir(tmp_path / "xglm", XGLMConfig(num_layers=2, d_model=64, attention_heads=2,
                                                         ffn_dim=128, vocab_size=264,
                                                         architectures=["XGLMForCausalLM"]))
    with pytest.raises(ConfigError) as e:
        check_model(xglm)
    assert str(e.value).startswith("model.path: ") and "(XGLMForCausalLM): vLLM cannot load" in str(e.value)
    with pytest.raises(ConfigError, match="model.path: '/nonexistent' is neither a local model directory"):
        check_model("/nonexistent")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="model.path: transformers cannot build a causal LM"):
        check_model(tmp_path / "empty")


def test_check_model_remembers_a_model_that_passed(tiny_model_dir, tmp_path, monkeypatch):
    """A launch pays the ~8 s of imports once per model config and library versions: a config that passed is
    not checked again, one that differs (or is new) is."""
    import transformers
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    copy = shutil.copytree(tiny_model_dir, tmp_path / "copy")
    check_model(copy)
    assert launch.checked_models().read_text().split() == [launch.model_check_key(copy)]

    def broken(*args, **kwargs):
        raise OSError("the check ran again")
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", broken)
    check_model(copy)  # remembered: transformers is not asked
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    with pytest.raises(ConfigError, match="the check ran again"):
        check_model(copy)


# --- the GPU recipe's dependencies: HF datasets ------------------------------------------------------------

def test_hf_datasets_loader_reads_a_local_dataset_folder(tmp_path):
    """datasets.load_dataset on a folder of JSONL files: the HF-dataset branch of tasks.math_problems, offline."""
    folder = tmp_path / "gsm8k"
    folder.mkdir()
    for split, n in (("train", 5), ("test", 3)):
        (folder / f"{split}.jsonl").write_text("".join(
            json.dumps({"question": f"{split} {i}+1?", "answer": f"so\n#### {i + 1}"}) + "\n" for i in range(n)))
    train = tasks.math_problems(str(folder), "train")
    test = tasks.math_problems(str(folder), "test")
    assert [p.answer for p in train] == ["1", "2", "3", "4", "5"] and len(test) == 3
    assert test[0].prompt == "test 0+1?"
    cfg = common.load_config(["data.task=math", f"data.train_path={folder}", f"data.test_path={folder}"])
    stream, test = tasks.load_tasks(cfg)
    assert len(test) == 3 and stream.get(0).prompt.startswith("train ")


# --- progress and summary (run.sh's lines) -------------------------------------------------------------------

def test_progress_reads_only_appended_complete_lines(tmp_path):
    path = tmp_path / "metrics_trainer.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"ste')  # the writer is mid-line
    recs, off = rundir.read_appended(path, 0)
    assert [r["step"] for r in recs] == [1, 2]
    with open(path, "a") as f:
        f.write('p": 3}\n')
    recs, off2 = rundir.read_appended(path, off)
    assert [r["step"] for r in recs] == [3] and off2 == path.stat().st_size
    assert rundir.read_appended(tmp_path / "missing.jsonl", 5) == ([], 5)
    # a writer killed mid-line, then resumed: the torn record joins the next one; both are lost
    with open(path, "a") as f:
        f.write('{"step": 4, "ti' + '{"step": 5}\n7\n{"step": 6}\n')
    recs, _ = rundir.read_appended(path, off2)
    assert [r["step"] for r in recs] == [6]
    (tmp_path / "eval.jsonl").write_text('{"version": 0, "test_reward": 0.4}\n{"version": 10, "test_reward": 0.5}\n')
    path.write_text('{"step": 7, "trainer/lag_max": 2}\n{"step": 7, "trainer/done": 1}\n')
    assert launch.summary(str(tmp_path)) == ("[run.sh] summary: 7 steps | test reward 0.400 (v0) -> 0.500 (v10), "
                                             "mean of last 2 evals 0.450 | max lag 2")


# --- run.sh's set-up check ----------------------------------------------------------------------------

def test_setup_checks_imports_once_per_state_of_the_venv(tmp_path):
    """The import check (~8 s of a real .venv) runs on the first launch, not on the next ones, and again once
    pip changed site-packages or a requirements file changed. A stand-in .venv python logs each check."""
    for f in ["run.sh", *(p.name for p in REPO.glob("requirements-*.txt"))]:
        shutil.copy(REPO / f, tmp_path / f)
    site = tmp_path / ".venv/lib/python3.11/site-packages"
    site.mkdir(parents=True)
    (tmp_path / ".venv/bin").mkdir()
    py = tmp_path / ".venv/bin/python"
    py.write_text(f"#!/bin/sh\ncat >/dev/null\necho check >> {tmp_path}/checks.log\n")
    py.chmod(0o755)

    def checks_after_setup():
        r = subprocess.run(["bash", str(tmp_path / "run.sh"), "setup"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        return (tmp_path / "checks.log").read_text().count("check")
    assert checks_after_setup() == 1
    assert checks_after_setup() == 1  # the stamp stands for the check
    os.utime(site, (1, 1))  # pip installed or removed something
    assert checks_after_setup() == 2
    assert checks_after_setup() == 2
    with open(tmp_path / "requirements-common.txt", "a") as f:
        f.write("\n# changed\n")
    assert checks_after_setup() == 3


def test_driver_too_old_for_the_cuda_build_fails_naming_the_version():
    from common import ConfigError
    launch.check_driver("580.65.06", "13.0")
    launch.check_driver("550.54.15", "12.8")
    with pytest.raises(ConfigError, match="driver 550.54.15 is too old for torch built with CUDA 13.0: "
                                          "it needs driver >= 580"):
        launch.check_driver("550.54.15", "13.0")
