"""Build a tiny base model: a ~1M-parameter Qwen2 with a character-level tokenizer, warm-started by
supervised training on a built-in task until its greedy test accuracy lands in a band that leaves RL
room to improve.

    python scripts/make_tiny_model.py [--task arithmetic|longtail|calc] [--out DIR] [--band LO HI]

arithmetic (the default demo): assets/tiny-model, band 38-45%. longtail (configs/longtail.yaml):
assets/tiny-longtail, band 35-45%, one thread, then 1,024 completions sampled at temperature 1 whose
length statistics go into the model's warmstart.json. calc (configs/calc.yaml): assets/tiny-calc,
band 5-25%: 30% of its worked solutions call the calculator (its answer carries no loss, as in an
episode), the rest answer at once; its evaluations are episodes (a turn ending at `=` gets the
calculator's answer), and warmstart.json records how often it calls the tool at temperature 1.
run.sh builds the model its config names when its COMPLETE file is missing; a build that ends outside the band (or, longtail, whose samples lack
the long tail: has_long_tail) writes no COMPLETE and exits with code 1. Deterministic from the seed on a given thread count. Tests import `make_tokenizer`,
`tiny_config` and `random_model_dir` from here to build models in seconds.

Why a byte-level BPE with no merges: with `model_type: qwen2`, AutoTokenizer builds a Qwen2Tokenizer
and ignores `tokenizer_class`, which silently breaks a plain WordLevel char tokenizer (spaces and
newlines vanish). A byte-level BPE whose vocab is GPT-2's byte-to-unicode alphabet and whose merge
list is empty is one token per byte, and round-trips identically in `tokenizers`, AutoTokenizer and
vLLM (docs/DESIGN.md, "The embedded default").
"""
import argparse
import asyncio
import copy
import itertools
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import envs  # noqa: E402
import tasks  # noqa: E402

EOS = "<|endoftext|>"
VOCAB_SIZE = 264  # 256 bytes + EOS, padded to a multiple of 8


def _byte_alphabet():
    """GPT-2's reversible byte -> printable unicode map (the ByteLevel pre-tokenizer's alphabet)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def make_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {ch: i for i, ch in enumerate(_byte_alphabet())}
    vocab[EOS] = 256
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS,
                                   model_max_length=1024)


def tiny_config(vocab_size=VOCAB_SIZE, hidden=128, layers=4, heads=4, kv_heads=2, intermediate=512,
                max_pos=256):
    from transformers import Qwen2Config
    return Qwen2Config(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads,
                       intermediate_size=intermediate, max_position_embeddings=max_pos,
                       # as assets/tiny-model was built; tied works too (test_models.py)
                       tie_word_embeddings=False,
                       bos_token_id=256, eos_token_id=256, pad_token_id=256, torch_dtype="float32",
                       rope_theta=10000.0, use_sliding_window=False)


def save(model, tokenizer, out_dir):
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    model.generation_config.save_pretrained(out_dir)
    return str(out_dir)


def random_model_dir(out_dir, seed=0, **config_kw) -> str:
    """A random-init tiny model + tokenizer saved in `out_dir` (seconds; for tests)."""
    from transformers import Qwen2ForCausalLM
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(tiny_config(**config_kw)).float()
    return save(model, make_tokenizer(), out_dir)


# --- supervised warm start ----------------------------------------------------------------------

# What the build needs of each task:
# - max_new_tokens: the longest completion an evaluation decodes (longtail: actor.max_tokens);
#   max_pos: room for prompt + completion.
# - threads: None = up to 4 cores (run.sh builds it alone); 1 = the same model on any core count
#   (configs/longtail.yaml quotes the lengths measured on it).
# - length_samples: completions sampled at temperature 1 after a build inside the band; their length
#   statistics go into warmstart.json (0 = none).
# - eval_every: steps between evaluations within 10 points of the band, and far below it. An
#   arithmetic evaluation costs as much as ~3 steps; a longtail one 20-30 (it decodes up to 384
#   tokens), and accuracy rose ~2.5 points per 25 steps there (measured): safe for a 10-point band.
# - max_steps: the budget, in steps rather than seconds, so that the model does not depend on the
#   machine's load (a 600 s budget once ended an arithmetic build at step 170 and 0.3% on a busy
#   machine, and marked it complete).
BUILDS = {
    "arithmetic": dict(out="assets/tiny-model", band=(0.38, 0.45), max_new_tokens=48, max_pos=256,
                       threads=None, length_samples=0, lr=2e-3, batch_size=64, eval_every=(5, 25),
                       max_steps=3000),
    "longtail": dict(out="assets/tiny-longtail", band=(0.35, 0.45), max_new_tokens=384, max_pos=512,
                     threads=1, length_samples=1024, lr=2e-3, batch_size=32, eval_every=(25, 100),
                     max_steps=2500),
    # calc (configs/calc.yaml): multiplication of 1-3-digit numbers with the calculator (envs.py).
    # tool_share of the worked solutions call it, the rest answer at once (a product the model
    # mostly cannot compute): greedy decoding answers at once, and RL has the calls to find. No
    # evaluation before min_steps: greedy accuracy is in the band from step ~40, but a call's
    # copies (the operands, then the tool's value) come right in 0.04 of samples at step 200 and
    # ~0.6 at 1,000 (at temperature 1; measured, seed 0).
    "calc": dict(out="assets/tiny-calc", band=(0.05, 0.25), max_new_tokens=32, max_pos=256,
                 threads=None, length_samples=0, lr=2e-3, batch_size=64, eval_every=(25, 25),
                 max_steps=1600, min_steps=1000, digits=(1, 3), tool_share=0.3),
}


def _segments(p) -> list:
    """(text, trained) pieces of a worked solution: calc's tool answer (after the `=` to the
    newline) is the environment's, as in an RL episode: no loss on it."""
    if p.task == "calc" and "=" in p.target:
        call, rest = p.target.split("=", 1)
        answer, final = rest.split("\n", 1)
        return [(call + "=", True), (answer + "\n", False), (final, True)]
    return [(p.target, True)]


def _batch(tokenizer, problems):
    """Right-padded prompt+target+EOS; labels only on the target (the completion RL will grade)."""
    ids, labels = [], []
    for p in problems:
        prompt = tokenizer(p.prompt, add_special_tokens=False)["input_ids"]
        target, label = [], []
        for text, trained in _segments(p):
            piece = tokenizer(text, add_special_tokens=False)["input_ids"]
            target, label = target + piece, label + (piece if trained else [-100] * len(piece))
        ids.append(prompt + target + [tokenizer.eos_token_id])
        labels.append([-100] * len(prompt) + label + [tokenizer.eos_token_id])
    T = max(map(len, ids))
    pad = tokenizer.eos_token_id
    lengths = torch.tensor([len(x) for x in ids])                                    # [B]
    input_ids = torch.tensor([x + [pad] * (T - len(x)) for x in ids])                # [B,T]
    label_ids = torch.tensor([y + [-100] * (T - len(y)) for y in labels])            # [B,T]
    attention_mask = (torch.arange(T)[None, :] < lengths[:, None]).long()            # [B,T]
    return input_ids, label_ids, attention_mask


def train_batches(task, seed, batch_size, test_prompts):
    """Endless seeded training batches that never touch the test split."""
    if task == "calc":
        spec, rng = BUILDS["calc"], np.random.default_rng([seed, 1])
        while True:
            problems = []
            while len(problems) < batch_size:
                p = tasks._draw_calc(rng, *spec["digits"])
                if p.prompt in test_prompts:
                    continue
                if rng.random() >= spec["tool_share"]:  # answered at once
                    p = tasks.Problem(p.prompt, p.answer, p.task, f"{tasks.ANSWER_MARK}{p.answer}")
                problems.append(p)
            yield problems
    if task == "arithmetic":
        gen = torch.Generator().manual_seed(seed)
        while True:
            problems = []
            while len(problems) < batch_size:
                a, b = (int(torch.randint(0, 10 ** int(torch.randint(1, 5, (1,), generator=gen)),
                                          (1,), generator=gen)) for _ in range(2))
                p = tasks.arithmetic_problem(a, b)
                if p.prompt not in test_prompts:
                    problems.append(p)
            yield problems
    # Longtail: a batch pads to its longest sequence, and with a long tail most random batches hold
    # a long one: 4.5x the real tokens in batches of 32, 1.15x when batches are cut from a pool of
    # 512 sorted by length (measured), served in a seeded random order. Not run.seed's stream: RL
    # starts on problems the warm start never saw.
    test = [tasks.Problem(prompt=p, answer="", task=task) for p in test_prompts]
    stream = tasks.TrainStream(SimpleNamespace(task=task), 10_000 + seed, test)
    pool = 16 * batch_size
    for r in itertools.count():
        items = sorted((stream.get(r * pool + i) for i in range(pool)),
                       key=lambda p: len(p.prompt) + len(p.target))
        for k in np.random.default_rng([seed, r]).permutation(pool // batch_size):
            yield items[k * batch_size:(k + 1) * batch_size]


def _generate(model, tokenizer, prompts, max_new_tokens, sample, stop=None):
    """Completions of `prompts` (left-padded batch): their token ids, cut after the first EOS (or
    the first `stop`, a one-token string)."""
    tokenizer.padding_side = "left"
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    # top_k=0: generate's default keeps the 50 likeliest tokens; the actor samples the full softmax.
    kw = dict(temperature=1.0, top_k=0, top_p=1.0) if sample else {}
    eos = tokenizer.eos_token_id
    ends = [eos] + ([tokenizer.convert_tokens_to_ids(stop)] if stop else [])
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=sample, **kw,
                             pad_token_id=eos, eos_token_id=ends)
    out = out[:, enc["input_ids"].shape[1]:].tolist()
    return [ids[:min(ids.index(e) + 1 for e in ends if e in ids)] if set(ends) & set(ids) else ids
            for ids in out]


def _correct(completion, problem) -> bool:
    return tasks.score(completion, problem.answer, problem.task)[1] == "correct"


def _completions(model, tokenizer, problems, max_new_tokens, sample) -> list:
    """Texts of one completion per problem; calc's are episodes of up to two turns: a turn that
    ends at `=` gets the calculator's answer (envs.Calculator) and goes on."""
    prompts = [p.prompt for p in problems]
    if problems[0].task != "calc":
        out = _generate(model, tokenizer, prompts, max_new_tokens, sample)
        return tokenizer.batch_decode(out, skip_special_tokens=True)
    first = tokenizer.batch_decode(_generate(model, tokenizer, prompts, max_new_tokens, sample,
                                             stop="="), skip_special_tokens=True)
    calls = [i for i, t in enumerate(first) if t.endswith("=")]
    if calls:
        for i in calls:  # the calculator's answer, as the actor's episode gets it
            first[i] += asyncio.run(envs.Calculator().step(first[i])).observation
        second = _generate(model, tokenizer, [prompts[i] + first[i] for i in calls],
                           max_new_tokens, sample)
        for i, t in zip(calls, tokenizer.batch_decode(second, skip_special_tokens=True)):
            first[i] += t
    return first


def greedy_accuracy(model, tokenizer, problems, max_new_tokens=48, batch=150) -> float:
    """Greedy decoding, graded as the verifier grades (tasks.score). Batches of similar prompt
    length: a longtail batch decodes until its longest completion ends."""
    model.eval()
    correct = 0
    problems = sorted(problems, key=lambda p: len(p.prompt))
    for i in range(0, len(problems), batch):
        chunk = problems[i:i + batch]
        texts = _completions(model, tokenizer, chunk, max_new_tokens, False)
        correct += sum(_correct(t, p) for t, p in zip(texts, chunk))
    model.train()
    return correct / len(problems)


def tool_use(model, tokenizer, problems, max_new_tokens, seed=0) -> dict:
    """calc at temperature 1, as the actor samples: the share of episodes that call the
    calculator, and the reward of those that do and of those that do not."""
    torch.manual_seed(seed)
    model.eval()
    texts = _completions(model, tokenizer, problems, max_new_tokens, True)
    model.train()
    called = ["=" in t for t in texts]
    right = [_correct(t, p) for t, p in zip(texts, problems)]

    def mean(xs):
        return round(float(np.mean(xs)), 3) if xs else None
    return {"samples": len(texts), "call_share": mean(called), "reward": mean(right),
            "reward_with_call": mean([r for r, c in zip(right, called) if c]),
            "reward_without": mean([r for r, c in zip(right, called) if not c])}


def sample_lengths(model, tokenizer, problems, max_new_tokens, seed=0, batch=128) -> dict:
    """One completion per problem at temperature 1, as the actor samples: length statistics in
    tokens (EOS included, as the engine counts it; a truncated completion counts max_new_tokens)."""
    torch.manual_seed(seed)
    model.eval()
    lengths, correct = [], 0
    for i in range(0, len(problems), batch):
        chunk = problems[i:i + batch]
        completions = _generate(model, tokenizer, [p.prompt for p in chunk], max_new_tokens, True)
        texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
        lengths += [len(c) for c in completions]
        correct += sum(_correct(t, p) for t, p in zip(texts, chunk))
    model.train()
    lengths = np.array(lengths)
    finished = lengths[lengths < max_new_tokens]
    p50, p90, p99 = np.percentile(lengths, [50, 90, 99])
    return {"samples": len(lengths), "max_new_tokens": max_new_tokens, "p50": float(p50),
            "p90": float(p90), "p99": float(p99), "max": int(lengths.max()),
            "mean": round(float(lengths.mean()), 1), "p90_over_p50": round(float(p90 / p50), 2),
            "max_over_p50": round(float(lengths.max() / p50), 2),
            "truncated": int((lengths >= max_new_tokens).sum()),
            "max_finished": int(finished.max(initial=0)),
            "accuracy": correct / len(lengths)}


def has_long_tail(lengths) -> bool:
    """The length statistics of sample_lengths show the long tail the longtail task exists for: the
    p90 at least 3x the median, the longest at least 8x. A build without it is not marked COMPLETE."""
    return lengths["p90"] >= 3 * lengths["p50"] and lengths["max"] >= 8 * lengths["p50"]


def band_step(acc, band) -> str:
    """What the build does after an evaluation: "stop" inside the band; "rewind" above it (back to
    the last state evaluated below it, then evaluate every step at half the lr: the band is narrower
    than one stretch between evaluations can gain); "save" below it (the state to rewind to)."""
    if band[0] <= acc <= band[1]:
        return "stop"
    return "rewind" if acc > band[1] else "save"


def warm_start(out_dir, task="arithmetic", seed=0, band=None, max_seconds=None, max_steps=None,
               eval_every=None, test_size=300, threads=None, log=print):
    """Supervised training on `task` until the first evaluation inside `band`, or the budget
    (max_steps, default the task's; max_seconds when given). The model is saved either way; only a
    model inside the band is marked COMPLETE (the file run.sh looks for)."""
    from transformers import Qwen2ForCausalLM
    spec = BUILDS[task]
    band = tuple(band or spec["band"])
    max_steps = max_steps or spec["max_steps"]
    lr = spec["lr"]
    batch_size = spec["batch_size"]
    near, far = spec["eval_every"]
    near = eval_every or near
    threads = threads or spec["threads"] or min(4, len(os.sched_getaffinity(0)))
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    tokenizer = make_tokenizer()
    model = Qwen2ForCausalLM(tiny_config(max_pos=spec["max_pos"])).float()
    n_params = sum(p.numel() for p in model.parameters())
    if task == "arithmetic":
        test = tasks.arithmetic_test(test_size)
    elif task == "calc":
        test = tasks._fixed_split(lambda rng: tasks._draw_calc(rng, *spec["digits"]), test_size)
    else:
        test = tasks.longtail_test(test_size)
    batches = train_batches(task, seed, batch_size, {p.prompt for p in test})
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    # The random model scores 0, below any band: it is the first state to rewind to.
    saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()), 0.0)
    t0, step, acc, rewinds = time.time(), 0, 0.0, 0
    while True:
        input_ids, labels, attn = _batch(tokenizer, next(batches))
        loss = model(input_ids=input_ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step >= spec.get("min_steps", 0) and \
                step % (near if rewinds or acc >= band[0] - 0.1 else far) == 0:
            acc = greedy_accuracy(model, tokenizer, test, spec["max_new_tokens"])
            log(f"[make_tiny_model] step {step} loss {loss.item():.3f} "
                f"greedy test accuracy {acc:.1%} ({time.time() - t0:.0f} s)")
            action = band_step(acc, band)
            if action == "stop":
                break
            if action == "rewind":
                model.load_state_dict(saved[0])
                opt.load_state_dict(saved[1])
                acc = saved[2]
                rewinds += 1
                near = 1
                lr = lr / 2
                for g in opt.param_groups:
                    g["lr"] = lr
            else:
                saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()), acc)
        if step >= max_steps or (max_seconds is not None and time.time() - t0 > max_seconds):
            log(f"[make_tiny_model] budget spent: stopping outside the band {band}")
            break
    seconds = round(time.time() - t0, 1)
    save(model, tokenizer, out_dir)
    info = {"task": task, "params": n_params, "steps": step, "seconds": seconds,
            "greedy_test_accuracy": acc, "in_band": band[0] <= acc <= band[1], "rewinds": rewinds,
            "test_size": test_size, "seed": seed, "band": list(band), "threads": threads}
    if spec["length_samples"] and info["in_band"]:
        # The first problems of the RL training stream (run.seed=0), as the actor would sample them.
        stream = tasks.TrainStream(SimpleNamespace(task=task), 0, test)
        problems = [stream.get(i) for i in range(spec["length_samples"])]
        lengths = sample_lengths(model, tokenizer, problems, spec["max_new_tokens"], seed)
        info["samples_T1"] = lengths
        info["long_tail"] = has_long_tail(lengths)
    if task == "calc":
        info["samples_T1"] = tool_use(model, tokenizer, test, spec["max_new_tokens"], seed)
    (Path(out_dir) / "warmstart.json").write_text(json.dumps(info, indent=1))
    if info["in_band"] and info.get("long_tail", True):
        (Path(out_dir) / "COMPLETE").write_text("ok\n")
    return info


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--task", choices=sorted(BUILDS), default="arithmetic")
    ap.add_argument("--out", help="default: the task's (assets/tiny-model, assets/tiny-longtail)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--band", type=float, nargs=2, help="default: the task's")
    ap.add_argument("--max-steps", type=int, help="training budget; default: the task's")
    ap.add_argument("--max-seconds", type=float, help="a time limit too (default: none)")
    args = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    out = args.out or BUILDS[args.task]["out"]
    info = warm_start(out, task=args.task, seed=args.seed, band=args.band, max_steps=args.max_steps,
                      max_seconds=args.max_seconds)
    print(f"[make_tiny_model] built {out}: {info['params'] / 1e6:.2f}M parameters, greedy test "
          f"accuracy {info['greedy_test_accuracy']:.1%} after {info['steps']} steps, "
          f"{info['seconds']} s")
    if "samples_T1" in info:
        print(f"[make_tiny_model] sampled at temperature 1: {info['samples_T1']}")
    if not info.get("long_tail", True):
        sys.exit(f"[make_tiny_model] the samples have no long tail (p90 >= 3x and max >= 8x the "
                 f"median): {info['samples_T1']}; {out} is not marked COMPLETE")
    if not info["in_band"]:
        sys.exit(f"[make_tiny_model] greedy test accuracy {info['greedy_test_accuracy']:.1%} is "
                 f"outside the band {info['band']}: {out} is not marked COMPLETE (run.sh builds "
                 f"it again); raise --max-steps")
