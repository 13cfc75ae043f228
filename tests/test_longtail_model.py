"""bench/longtail_model.py's U(h) estimate on a synthetic run directory whose engine speed is known: the
bins read the true tokens/s, and the buckets the estimate must leave out (weight loads, training steps on
a shared core, buckets cut short at an idle gap) would move it if they were kept. Pure Python, no run.

Run: .venv/bin/python -m pytest tests/test_longtail_model.py -q      (~2 s)
"""
import sys

import numpy as np
import pytest
import yaml

from conftest import REPO

sys.path.insert(0, str(REPO / "bench"))
import longtail_model  # noqa: E402
from scripts import telemetry  # noqa: E402
from scripts.throughput_model import MeasuredU  # noqa: E402


def true_tps(h):
    """The engine the synthetic run describes: a decode step costs 10 ms + 0.15 ms per sequence."""
    return h / (0.010 + 0.00015 * h)


class Engine:
    """Writes an engine's counter buckets back to back, as weights_sync.WeightUpdateExtension does."""

    def __init__(self, run):
        self.ev, self.t = telemetry.Events(run, "engine1"), 1000.0

    def bucket(self, h, tps, seconds=0.27, busy=0.75):
        self.ev.counter("engine", self.t, busy=busy, inflight=float(h), tokens_per_s=float(tps))
        self.t += seconds

    def idle(self, seconds=2.0):
        """An idle gap: its zero record at the end of the last step, the next bucket after the gap."""
        self.ev.counter("engine", self.t, busy=0.0, inflight=0.0, tokens_per_s=0.0)
        self.t += seconds


def synthetic_run(tmp_path, shared_cores=True):
    run = tmp_path / "run"
    run.mkdir()
    cores = "0-1" if shared_cores else "0"
    (run / "config.yaml").write_text(yaml.safe_dump({"actor": {"cpu_cores": cores},
                                                     "trainer": {"cpu_cores": cores if shared_cores else "1"}}))
    eng, trainer = Engine(run), telemetry.Events(run, "trainer0")
    noise = (0.97, 1.0, 1.03)  # the median of each bin is the true value
    for h in (4, 24, 100, 200, 300):
        for i in range(30):
            eng.bucket(h, true_tps(h) * noise[i % 3])
        eng.idle()
    # h = 200: 40 buckets during weight loads, at a third of the speed (more than the good ones)
    for i in range(40):
        start = eng.t
        eng.bucket(200, true_tps(200) / 3)
        eng.ev.span("receive", start + 0.05, end=start + 0.15, version=i)
    eng.idle()
    # h = 100: 40 buckets while the trainer trains on the same cores, at half speed
    for i in range(40):
        trainer.span("step/forward_backward", eng.t + 0.1, end=eng.t + 0.2)
        eng.bucket(100, true_tps(100) / 2)
    eng.idle()
    # h = 300: 40 buckets cut short at an idle gap, three times too fast (a step or two over 0.05 s)
    for i in range(40):
        eng.bucket(300, 3 * true_tps(300), seconds=0.05)
        eng.idle()
    # h = 300: 10 slow buckets with busy 0.95 (prefill-heavy): fewer than the 30 good ones, kept
    for i in range(10):
        eng.bucket(300, true_tps(300) / 4, busy=0.95)
    # h = 600: 5 buckets, fewer than a bin needs
    for i in range(5):
        eng.bucket(600, true_tps(600))
    eng.idle()
    eng.ev.flush()
    trainer.flush()
    return run


def test_estimate_u_reads_the_true_speed_and_leaves_out_what_it_must(tmp_path):
    run = synthetic_run(tmp_path)
    points = longtail_model.estimate_u(run)
    by_h = {round(h): (tps, n) for h, tps, n in points}
    assert sorted(by_h) == [4, 24, 100, 200, 300], points  # no h = 0 bin, no 5-bucket h = 600 bin
    for h, (tps, n) in by_h.items():  # h = 300: its 10 slow kept buckets move the median one noise step
        assert tps == pytest.approx(true_tps(h), rel=0.02 if h == 300 else 0.005), (h, tps, true_tps(h))
    # what was kept: the 30 good buckets, and at h = 300 also the 10 slow busy ones
    assert {h: n for h, (_, n) in by_h.items()} == {4: 30, 24: 30, 100: 30, 200: 30, 300: 40}
    U = MeasuredU([p[0] for p in points], [p[1] for p in points])
    assert U(200) * U.peak_tokens_per_s == pytest.approx(true_tps(200), rel=0.005)


def test_the_left_out_buckets_would_have_moved_the_estimate(tmp_path):
    """The contamination is strong enough that an estimate keeping it is wrong: the test above can fail."""
    run = synthetic_run(tmp_path)
    b = longtail_model.engine_buckets(run)
    for h in (100, 200, 300):  # every bucket kept: each of these bins reads more than 20% off
        every = np.median(b["tokens_per_s"][b["h"] == h])
        assert abs(every / true_tps(h) - 1) > 0.2, (h, every, true_tps(h))
    # without the shared-core filter h = 100 reads low
    no_trainer = {round(h): tps for h, tps, _ in longtail_model.estimate_u(run, exclude_trainer=False)}
    assert no_trainer[100] < 0.8 * true_tps(100)
    # a busy > 0.9 filter would read h = 300 at the slow buckets' speed
    busy = (b["h"] == 300) & (b["busy"] > 0.9)
    assert np.median(b["tokens_per_s"][busy]) < 0.5 * true_tps(300)


def test_trainer_steps_are_not_excluded_when_the_cores_differ(tmp_path):
    """PipelineRL: the engine and the trainer on different cores, the trainer always training: its steps
    do not make buckets unusable."""
    run = synthetic_run(tmp_path, shared_cores=False)
    by_h = {round(h): n for h, _, n in longtail_model.estimate_u(run)}
    assert by_h[100] == 70  # the 40 half-speed buckets now count: this engine had no trainer beside it
