"""Tiers (a) + (b): the wire format is total. A seeded fuzzer mutates valid rollouts and samples
(bytes flipped, fields retyped or deleted, shapes huge, negative or float, frames truncated,
dropped, added or swapped): common.decode must return arrays that match the schema or raise
WireError, nothing else. Then verifier.py, a real process between real ZMQ sockets, takes a burst
of such messages and keeps serving.

Run: bash run.sh test tests/test_wire_fuzz.py    (about 30 s on 2 cores, most of it the verifier's)
"""
import json
import math
import random

import numpy as np
import pytest
import zmq

import common
import conftest
from common import WireError
from test_verifier import (receive, rollout, start_verifier, stdout, stop_verifier,  # noqa: F401
                           tokenizer_dir, wait_metrics)  # tokenizer_dir: a fixture

# Values a mutation puts where a field, an array entry or a shape entry belongs.
ODD = [None, True, False, 0, 1, -1, 2.0, 1.5, float("nan"), float("inf"), -float("inf"), 10**30,
       1e300, -2**63, 2**62, 2**31, "", "4", "x" * 300, [], [1], [[[]]], {}, {"a": 1}, "int32",
       "float32"]
SHAPES = [[10**30], [1e300], [-1], [-4], [2**62, 4], [2**64], [], [0], [4.0], ["4"], [True], [None],
          [1, 1], [float("nan")], 4, None]
FIELDS = [*common.SCHEMAS["sample"][0], "arrays"]


def valid(rng: random.Random, kind: str):
    """A random well-formed message of `kind` -> (header, arrays)."""
    n = rng.randrange(0, 6)
    size = rng.randrange(1, 9)
    header = {"group_id": rng.randrange(10**5), "sample_idx": rng.randrange(size),
              "group_size": size, "task": rng.choice(["arithmetic", "math"]),
              "answer": str(rng.randrange(100)),
              "finish_reason": "stop", "t_start": 1.0, "t_end": 2.5, "ticket": rng.randrange(100, 103),
              "epoch": 1, "eval": rng.random() < 0.2, "turns": 1, "env_reward": 0.0}
    if kind == "sample":
        header.update(reward=float(rng.choice([0, 1])), status="correct",
                      advantage=rng.uniform(-1, 1), verifier=1, order=n)  # no draw: the stream stays
    arrays = {"prompt_ids": np.arange(rng.randrange(1, 5), dtype=np.int32),
              "completion_ids": np.array([rng.randrange(40) for _ in range(n)], np.int32),
              "logprobs": -np.array([rng.random() for _ in range(n)], np.float32),
              "versions": np.full(n, rng.randrange(3), np.int32)}
    return header, arrays


def edit_header(frames, edit):
    """Frame 0 parsed, edited and dumped again; as it was if no JSON object is left of it."""
    try:
        header = json.loads(frames[0])
    except (ValueError, RecursionError):
        return frames
    if not isinstance(header, dict):
        return frames
    edit(header)
    return [json.dumps(header).encode()] + frames[1:]


def entries(header) -> list:
    """The header's array entries that an earlier mutation left editable."""
    listed = header.get("arrays")
    return [m for m in listed if isinstance(m, dict)] if isinstance(listed, list) else []


def edit_entry(rng, frames, key, values):
    def edit(header):
        if entries(header):
            rng.choice(entries(header))[key] = rng.choice(values)
    return edit_header(frames, edit)


def set_field(rng, frames):
    return edit_header(frames, lambda h: h.__setitem__(rng.choice(FIELDS), rng.choice(ODD)))


def delete_field(rng, frames):
    return edit_header(frames, lambda h: h.pop(rng.choice(FIELDS), None))


def flip_bytes(rng, frames):
    i = rng.randrange(len(frames))
    frame = bytearray(frames[i])
    for _ in range(rng.randrange(1, 4)):
        if frame:
            frame[rng.randrange(len(frame))] = rng.randrange(256)
    return frames[:i] + [bytes(frame)] + frames[i + 1:]


def truncate(rng, frames):
    i = rng.randrange(len(frames))
    return frames[:i] + [frames[i][:rng.randrange(len(frames[i]) + 1)]] + frames[i + 1:]


def extra_frame(rng, frames):
    """A frame the header does not list, or lists under a name of its own or a schema's again."""
    frame = bytes(rng.randrange(256) for _ in range(rng.choice([0, 4, 8, 13])))
    name = rng.choice(["extra", "advantage", "logprobs", None])
    entry = {"name": name, "dtype": "float32", "shape": [len(frame) // 4]}

    def add(header):
        if isinstance(header.get("arrays"), list):
            header["arrays"].append(entry)
    return (frames if name is None else edit_header(frames, add)) + [frame]


def nan_logprob(rng, frames):
    """A NaN or an infinity among the logprobs (frame 3 of a valid message)."""
    if len(frames) < 4 or len(frames[3]) % 4:
        return frames
    values = np.frombuffer(frames[3], np.float32).copy()
    if len(values):
        values[rng.randrange(len(values))] = rng.choice([np.nan, np.inf, -np.inf])
    return frames[:3] + [values.tobytes()] + frames[4:]


def new_header(rng, frames):
    """Frame 0 replaced by something that is not a header: nested past the recursion limit, over
    the size cap, not UTF-8, not an object, an integer of 5000 digits."""
    header = rng.choice([b"[" * 100_000, b"[" * 30_000, b"{" * 30_000,
                         b" " * (common.MAX_HEADER_BYTES + 1), b"\xff\xfe{}", b"[]", b"null", b"1",
                         b'{"arrays": ' + b"7" * 5000 + b"}", b'{"arrays": []}', b""])
    return [header] + frames[1:]


MUTATIONS = {
    "flip bytes": flip_bytes,
    "retype field": set_field,
    "delete field": delete_field,
    "retype name": lambda rng, f: edit_entry(rng, f, "name", ODD + ["extra", "logprobs"]),
    "retype dtype": lambda rng, f: edit_entry(rng, f, "dtype", ODD + ["int64", "float64", "<f4"]),
    "odd shape": lambda rng, f: edit_entry(rng, f, "shape", SHAPES),
    "truncate frame": truncate,
    "drop frame": lambda rng, f: [x for i, x in enumerate(f) if i != rng.randrange(len(f))],
    "extra frame": extra_frame,
    "swap frames": lambda rng, f: [f[0]] + rng.sample(f[1:], len(f) - 1),
    "non-finite logprob": nan_logprob,
    "new header": new_header,
    "empty message": lambda rng, f: [],
}


def assert_matches_schema(header, arrays, kind):
    """What a decoded message promises the roles, restated independently of common.decode."""
    fields, dtypes = common.SCHEMAS[kind]
    for key, typ in fields.items():
        value = header[key]
        if typ is bool:
            assert isinstance(value, bool), key
        elif typ is int:
            assert type(value) is int and 0 <= value < 2**31, key
        elif typ is float:
            assert type(value) in (int, float) and math.isfinite(float(value)), key
        else:
            assert isinstance(value, str), key
    assert set(arrays) == set(dtypes)
    for name, dtype in dtypes.items():
        assert arrays[name].dtype == np.dtype(dtype) and arrays[name].ndim == 1, name
        assert np.isfinite(arrays[name]).all(), name
    n = len(arrays["completion_ids"])
    assert len(arrays["logprobs"]) == n and len(arrays["versions"]) == n
    assert header["sample_idx"] < header["group_size"]


def fuzzed(rng):
    """-> (frames, the mutations applied)."""
    kind = rng.choice(["rollout", "sample"])
    frames = common.encode(*valid(rng, kind))
    names = rng.choices(list(MUTATIONS), k=rng.randrange(1, 4))
    for name in names:
        if frames:
            frames = MUTATIONS[name](rng, frames)
    return frames, names


def test_decode_raises_wire_error_and_nothing_else_on_fuzzed_messages():
    rng = random.Random(0)
    outcomes = {"decoded": 0, "WireError": 0}
    applied = set()
    for case in range(4000):
        frames, names = fuzzed(rng)
        applied.update(names)
        for kind in ("rollout", "sample"):
            try:
                header, arrays = common.decode(frames, kind)
            except WireError:
                outcomes["WireError"] += 1
                continue
            except Exception as e:  # noqa: BLE001 - what this test is about
                pytest.fail(f"case {case} ({', '.join(names)}) as a {kind}: "
                            f"{type(e).__name__}: {e}")
            assert_matches_schema(header, arrays, kind)
            outcomes["decoded"] += 1
        # peek_header (who sent a malformed message) never raises and keeps only well-typed fields
        peeked = common.peek_header(frames)
        types = common.SCHEMAS["sample"][0]
        assert all(k in types for k in peeked)
        assert all(type(peeked[k]) is int and 0 <= peeked[k] < 2**31
                   for k in ("group_id", "group_size", "ticket", "epoch") if k in peeked)
    assert applied == set(MUTATIONS)
    assert outcomes["decoded"] > 100 and outcomes["WireError"] > 4000, outcomes


@pytest.mark.parametrize("name,edit,frame", [
    ("a list as dtype", lambda m: m.update(dtype=["int32"]), None),
    ("a list as name", lambda m: m.update(name=["prompt_ids"]), None),
    ("shape 10**30", lambda m: m.update(shape=[10**30]), None),
    ("shape 1e300", lambda m: m.update(shape=[1e300]), None),
    ("shape [2**62, 4]: its int64 product wraps to 0", lambda m: m.update(shape=[2**62, 4]), b""),
])
def test_decode_cases_that_escaped_as_other_errors(name, edit, frame):
    """The reproductions that stopped a role with TypeError, OverflowError or ValueError."""
    header, arrays = valid(random.Random(1), "rollout")
    frames = common.encode(header, arrays)
    meta = json.loads(frames[0])
    edit(meta["arrays"][0])
    frames = [json.dumps(meta).encode(), frames[1] if frame is None else frame, *frames[2:]]
    with pytest.raises(WireError):
        common.decode(frames, "rollout")
    deep = [b"[" * 100_000] + frames[1:]  # RecursionError in json, or the header cap
    with pytest.raises(WireError):
        common.decode(deep, "rollout")
    assert common.peek_header(deep) == {}


def test_pull_socket_refuses_frames_over_the_cap():
    """common.pull_socket: ZMQ drops a frame over MAX_FRAME_BYTES (and the connection that
    sent it) instead of allocating it; the next message, over a new connection, arrives."""
    ctx = zmq.Context()
    pull = common.pull_socket(ctx)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{port}")
    try:
        push.send_multipart([b"{}", b"x" * (common.MAX_FRAME_BYTES + 1)])
        push.send_multipart([b"small"])
        assert pull.poll(30_000)
        assert pull.recv_multipart() == [b"small"]
    finally:
        ctx.destroy(linger=0)


def test_verifier_keeps_serving_through_a_burst_of_fuzzed_rollouts(tmp_path, tokenizer_dir):
    """A burst of fuzzed rollouts, then a valid group: it comes out as samples, and the verifier
    counted the malformed ones. (A fuzzed rollout that still decodes may complete a group of its
    own: filtered out.)"""
    model_dir, tok = tokenizer_dir
    run_dir = str(tmp_path)
    proc, push, pull, ctx, owner = start_verifier(run_dir, model_dir)
    rng = random.Random(2)
    try:
        owner.open_epoch()
        (ticket, _), = owner.tickets(1)
        for _ in range(1000):
            frames, _ = fuzzed(rng)
            if frames:  # ZMQ has no message of zero frames
                push.send_multipart(frames)
        # A malformed rollout's group is dropped, and the ledger told, whatever its numbers say.
        header, arrays = rollout(tok, 10**5, 0, 2, "arithmetic", "5", "#5")
        push.send_multipart(common.encode({**header, "group_size": 10**30, "ticket": 10**30}, arrays))
        group_id = 10**6  # no fuzzed message has it: their ids are below 10**5
        conftest.send(push, *rollout(tok, group_id, 0, 2, "arithmetic", "5", "#5", ticket=ticket))
        conftest.send(push, *rollout(tok, group_id, 1, 2, "arithmetic", "5", "#6", ticket=ticket))
        ours = []
        for _ in range(200):
            ours += [h for h, _ in receive(pull, 1, timeout_s=1) if h["group_id"] == group_id]
            if len(ours) == 2 or proc.poll() is not None:
                break
        assert proc.poll() is None, stdout(run_dir)[-3000:]
        assert sorted((h["sample_idx"], h["advantage"]) for h in ours) == [(0, 0.5), (1, -0.5)]
        wait_metrics(run_dir, lambda r: r["verifier/malformed"] > 500)  # most of the burst
    finally:
        stop_verifier(proc, ctx, run_dir, owner)
