"""Build the embedded base model: a ~1M-parameter Qwen2 with a character-level tokenizer, warm-started
by supervised training on the arithmetic task until its greedy test accuracy lands in a band that
leaves RL room to improve (default 35-45%).

    python scripts/make_tiny_model.py [--out assets/tiny-model] [--seed 0] [--band 0.35 0.45]

run.sh calls it when `assets/tiny-model/COMPLETE` is missing. Deterministic from the seed on a given core count.
Tests import `make_tokenizer`, `tiny_config` and `random_model_dir` from here to build models in seconds.

Why a byte-level BPE with no merges: with `model_type: qwen2`, AutoTokenizer builds a Qwen2Tokenizer
and ignores `tokenizer_class`, which silently breaks a plain WordLevel char tokenizer (spaces and
newlines vanish). A byte-level BPE whose vocab is GPT-2's byte-to-unicode alphabet and whose merge
list is empty is one token per byte, and round-trips identically in `tokenizers`, AutoTokenizer and
vLLM (DESIGN.md, Known traps).
"""
import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
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
                       tie_word_embeddings=False,  # as assets/tiny-model was built; tied works too (test_models.py)
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


# --- supervised warm start ---------------------------------------------------------------------------

def _batch(tokenizer, problems):
    """Right-padded prompt+target+EOS; labels only on the target (the completion the RL will grade)."""
    ids, labels = [], []
    for p in problems:
        prompt = tokenizer(p.prompt, add_special_tokens=False)["input_ids"]
        target = tokenizer(p.target, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids.append(prompt + target)
        labels.append([-100] * len(prompt) + target)
    T = max(map(len, ids))
    pad = tokenizer.eos_token_id
    input_ids = torch.tensor([x + [pad] * (T - len(x)) for x in ids])                    # [B,T]
    label_ids = torch.tensor([y + [-100] * (T - len(y)) for y in labels])              # [B,T]
    attention_mask = (torch.arange(T)[None, :] < torch.tensor([len(x) for x in ids])[:, None]).long()  # [B,T]
    return input_ids, label_ids, attention_mask


def greedy_accuracy(model, tokenizer, problems, max_new_tokens=48, batch=150) -> float:
    """Greedy decoding with left padding; graded like the verifier grades the arithmetic task."""
    model.eval()
    correct = 0
    tokenizer.padding_side = "left"
    for i in range(0, len(problems), batch):
        chunk = problems[i:i + batch]
        enc = tokenizer([p.prompt for p in chunk], return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id)
        texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        correct += sum(tasks.arithmetic_final_answer(t) == p.answer for t, p in zip(texts, chunk))
    model.train()
    return correct / len(problems)


def warm_start(out_dir, seed=0, band=(0.35, 0.45), max_seconds=600, lr=2e-3, batch_size=64,
               eval_every=5, test_size=300, log=print):
    """Supervised training on the arithmetic task; stop at the first evaluation inside `band`."""
    from transformers import Qwen2ForCausalLM
    torch.set_num_threads(min(4, len(os.sched_getaffinity(0))))  # run.sh builds it alone: all cores
    torch.manual_seed(seed)
    tokenizer = make_tokenizer()
    model = Qwen2ForCausalLM(tiny_config()).float()
    n_params = sum(p.numel() for p in model.parameters())
    test = tasks.arithmetic_test(test_size)
    test_prompts = {p.prompt for p in test}
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    t0, step, acc, prev = time.time(), 0, 0.0, None
    while True:
        # A fresh seeded batch of training problems that never touches the test split.
        problems = []
        while len(problems) < batch_size:
            a, b = (int(torch.randint(0, 10 ** int(torch.randint(1, 5, (1,), generator=gen)), (1,),
                                      generator=gen)) for _ in range(2))
            p = tasks.arithmetic_problem(a, b)
            if p.prompt not in test_prompts:
                problems.append(p)
        input_ids, labels, attn = _batch(tokenizer, problems)
        loss = model(input_ids=input_ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        # Evaluating costs as much as ~3 steps: sparsely far below the band, every few steps near it.
        if step % (eval_every if acc >= band[0] - 0.1 else 25) == 0:
            acc = greedy_accuracy(model, tokenizer, test)
            log(f"[make_tiny_model] step {step} loss {loss.item():.3f} greedy test accuracy {acc:.1%} "
                f"({time.time() - t0:.0f} s)")
            if band[0] <= acc <= band[1]:
                break
            if acc > band[1] and prev is not None:
                # Overshot the band between two evaluations: go back and evaluate every step.
                model.load_state_dict(prev[0])
                opt.load_state_dict(prev[1])
                eval_every, lr = 1, lr / 2
                for g in opt.param_groups:
                    g["lr"] = lr
            elif acc < band[0]:
                prev = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
        if time.time() - t0 > max_seconds:
            log(f"[make_tiny_model] time limit: stopping at accuracy {acc:.1%}")
            break
    save(model, tokenizer, out_dir)
    info = {"params": n_params, "steps": step, "seconds": round(time.time() - t0, 1),
            "greedy_test_accuracy": acc, "test_size": test_size, "seed": seed, "band": list(band)}
    (Path(out_dir) / "warmstart.json").write_text(json.dumps(info, indent=1))
    (Path(out_dir) / "COMPLETE").write_text("ok\n")
    return info


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="assets/tiny-model")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--band", type=float, nargs=2, default=(0.38, 0.45))
    ap.add_argument("--max-seconds", type=float, default=600)
    args = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    info = warm_start(args.out, seed=args.seed, band=tuple(args.band), max_seconds=args.max_seconds)
    print(f"[make_tiny_model] built {args.out}: {info['params'] / 1e6:.2f}M parameters, greedy test "
          f"accuracy {info['greedy_test_accuracy']:.1%} after {info['steps']} steps, {info['seconds']} s")
