"""HOROVOD_AUTOTUNE against Horovod's documented behaviour (its docs/autotune.rst): the
variables and horovodrun's --autotune flags are accepted; warm-up samples are discarded,
then the configured number of samples is scored and logged with Horovod's columns,
then (ours, HOROVOD_AUTOTUNE_CONFIRM_ROUNDS) the best and the starting setting are
measured again in turn, and the last row is the setting kept, which every rank then
keeps; a setting given explicitly is held constant; and no result changes. ZeRO's
bucket size and prefetch depth are tuned too, changing at the same step on every rank.
The optimiser itself (Gaussian process, expected improvement) and the confirmation's
rule on scores it is given are tested in test/cpp/autotune_test.cc."""

import csv
import os
import statistics

import pytest
import torch

import horovod_zero.torch as hvd
from horovod_zero import settings
import autotune_job
from harness import launch
from launchers import HOROVODRUN, ROOT
from test_launch import _ranks, _run
from horovod_zero.torch.zero.config import ZeroConfig
from horovod_zero.torch.zero.core.tuning import ZeroTuning
from test_zero_stage3 import Net, adamw, full_params, reference, rel_errors, train, with_env

HOROVOD_COLUMNS = ["hierarchical_allreduce", "hierarchical_allgather", "torus_allreduce", "cache_enabled",
                   "cycle_time_ms", "tensor_fusion_threshold", "score"]
SAMPLES = 5
ROUNDS = 2
TINY = {"HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "1", "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "1",
        "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": str(SAMPLES), "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE": "0.5",
        "HOROVOD_AUTOTUNE_CONFIRM_ROUNDS": str(ROUNDS)}


def _log(path):
    """The header, and the rows: numbers, then the phase."""
    with open(path) as f:
        rows = list(csv.reader(f))
    return rows[0], [[float(x) for x in r[:-1]] + [r[-1]] for r in rows[1:]]


def _setting(row):
    return row[4], row[5], row[7], row[8]  # cycle time, fusion threshold, bucket, prefetch


def _check_log(path, samples, rounds):
    """Horovod's columns first, then ours; a "search" row per scored sample; unless the
    starting setting (the first) scored best, "confirm" rows of the best and the start in
    turn; then the setting kept. The search rows and the kept one."""
    header, rows = _log(path)
    assert header[:7] == HOROVOD_COLUMNS and header[7:] == ["zero_bucket_mb", "zero_prefetch", "phase"], header
    search, confirm, kept = rows[:samples], rows[samples:-1], rows[-1]
    best = max(search, key=lambda r: r[6])
    if rounds == 0 or _setting(best) == _setting(search[0]):
        assert confirm == [] and kept[:-1] == best[:-1], (rows, best)
    else:
        assert [_setting(r) for r in confirm] == [_setting(best), _setting(search[0])] * rounds, rows
        assert {r[-1] for r in confirm} == {"confirm"}, rows
        assert _setting(kept) in (_setting(best), _setting(search[0])), rows
        # Its score is its median over the rounds.
        assert kept[6] == pytest.approx(statistics.median(r[6] for r in confirm if _setting(r) == _setting(kept)),
                                        rel=1e-5), rows
    assert [r[-1] for r in search] == ["search"] * samples and kept[-1] == "kept", rows
    return search, kept


def test_variables_are_read_and_checked():
    s = settings.read({})
    assert (s.autotune, s.autotune_log, s.autotune_warmup_samples, s.autotune_steps_per_sample,
            s.autotune_max_samples, s.autotune_noise) == (False, "", 3, 10, 20, 0.8)  # Horovod's defaults
    assert s.autotune_confirm_rounds == 3
    s = settings.read({**TINY, "HOROVOD_AUTOTUNE_LOG": "/tmp/x.csv", "HOROVOD_FUSION_THRESHOLD": "0"})
    assert (s.autotune, s.autotune_log, s.autotune_max_samples, s.autotune_noise) == (True, "/tmp/x.csv", SAMPLES, 0.5)
    p = settings.core_params(s, hvd.basics._core.Params())
    assert p.autotune_confirm_rounds == ROUNDS
    # Set explicitly: held constant, as Horovod does; the rest is tuned.
    assert (p.fixed_fusion_threshold, p.fixed_cycle_time, p.fixed_zero_bucket, p.fixed_zero_prefetch) == \
        (True, False, False, False)
    assert (p.zero_bucket_bytes, p.zero_prefetch, p.autotune_steps_per_sample) == (32 << 20, 1, 1)
    bad = {"HOROVOD_AUTOTUNE": "yes", "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE": "1.5",
           "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "0", "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "-1",
           "HOROVOD_AUTOTUNE_CONFIRM_ROUNDS": "-1"}
    with pytest.raises(ValueError) as e:
        settings.read(bad)
    for name, value in bad.items():
        assert f"{name}={value!r}" in str(e.value)


def test_without_autotune_there_is_no_tuner(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_AUTOTUNE"):
        monkeypatch.delenv(k, raising=False)
    hvd.init()
    try:
        assert hvd.runtime_info()["autotune"] is None
        assert hvd.runtime_info()["fusion_threshold"] == 128 << 20
    finally:
        hvd.shutdown()


def test_allreduces_tune_to_the_end_keep_the_best_and_stay_exact(tmp_path):
    log = tmp_path / "autotune.csv"
    out = launch(autotune_job.launched, 2, env={**TINY, "HOROVOD_AUTOTUNE_LOG": str(log)}, timeout=120)
    assert sorted(out) == [0, 1] and all(s == "ok" for s, _ in out.values()), out
    rows, kept = _check_log(log, SAMPLES, ROUNDS)
    # The first scored sample is the setting the job started with (the warm-up's is dropped).
    assert (rows[0][4], rows[0][5]) == (1.0, 128.0)
    assert len({(r[4], r[5]) for r in rows}) == SAMPLES  # each sample tried another setting
    for _, r in out.values():
        # Every rank keeps the logged setting; the tuning ended at the same step everywhere.
        assert r["fusion_threshold"] == int(kept[5]) << 20 and r["cycle_time_ms"] == pytest.approx(kept[4], rel=1e-5)
        assert r["autotune"]["tuning"] is False and r["steps"] == out[0][1]["steps"]


def test_horovodrun_autotune_flags_hold_an_explicit_setting(tmp_path):
    log = tmp_path / "horovodrun.csv"
    out = _run([HOROVODRUN, "-np", "2", "--autotune", "--autotune-log-file", str(log),
                "--autotune-warmup-samples", "0", "--autotune-steps-per-sample", "1",
                "--autotune-bayes-opt-max-samples", "3", "--autotune-gaussian-process-noise", "0.5",
                "--fusion-threshold-mb", "8", "python", os.path.join(ROOT, "test", "python", "autotune_job.py")],
               HOROVOD_AUTOTUNE_CONFIRM_ROUNDS="0")  # no flag: the variable reaches the ranks as it is
    ranks = _ranks(out)
    assert [int(r["rank"]) for r in ranks] == [0, 1]
    rows, kept = _check_log(log, 3, 0)  # the best-scoring sample kept, as by Horovod
    assert {r[5] for r in rows + [kept]} == {8.0}  # --fusion-threshold-mb given: held constant
    assert len({r[4] for r in rows}) == 3  # the cycle time was tuned
    assert all(int(r["fusion_threshold"]) == 8 << 20 for r in ranks)


class _History:
    """A runtime's record of announced settings (generation g: bucket g MiB, prefetch g % 3),
    of which this rank has reached the first `reached`."""

    def __init__(self, reached, final):
        self.reached, self.final, self.zero_knobs = reached, final, None

    def tuned(self, generation=-1):
        g = self.reached - 1 if generation < 0 else generation
        if g >= self.reached:
            return None
        return dict(generation=g, tuning=g != self.final, zero_bucket_bytes=g << 20, zero_prefetch=g % 3)

    def use_zero_knobs(self, bucket, prefetch):
        self.zero_knobs = (bucket, prefetch)


def test_ranks_at_different_generations_take_the_oldest_at_a_step():
    """The step's agreement takes each element's maximum over the ranks (core/reduce.py):
    here done by hand for three ranks that have reached different generations."""
    runtimes = [_History(5, 6), _History(3, 6), _History(4, 6)]
    tunings = [ZeroTuning(ZeroConfig.from_env({}), 3, rt) for rt in runtimes]
    assert all(rt.zero_knobs == (True, True) for rt in runtimes)  # both knobs join the search

    def step():
        rows = [t.rows() for t in tunings]
        agreed = [[max(r[0][0] for r in rows)]]
        for t in tunings:
            t.adopt(agreed)
    step()
    assert {(t.bucket_bytes, t.prefetch) for t in tunings} == {(2 << 20, 2)}  # generation 2, which all have
    for rt in runtimes:
        rt.reached = 7  # every rank has the final generation (6)
    step()
    assert {(t.bucket_bytes, t.prefetch) for t in tunings} == {(6 << 20, 0)}
    assert all(t.settled and t.rows() == [] for t in tunings)  # the agreement carries nothing more
    untuned = ZeroTuning(ZeroConfig.from_env({}), 1, _History(1, 6))  # stage 1: no bucket, no prefetch
    assert untuned.settled and untuned.rows() == []


def _zero_stage3_tuned(log_path):
    """Stage 3 trained until the tuning ends; each step's bucket size and prefetch depth,
    the parameters against single-process torch and against the same training with the
    settings held constant."""
    hvd.init()
    try:
        model = Net()
        opt = hvd.DistributedZeroOptimizer(adamw(model), model=model, stage=3)
        tuning = opt._reducer._tuning
        seen = []
        for step in range(200):
            train(model, opt, steps=1, start=step)
            seen.append((opt._reducer._bucket_limit, tuning.prefetch))
            if tuning.settled:  # the final settings agreed at this step, alike on every rank
                break
        steps = step + 1
        params = full_params(model, opt)
        fixed_model = Net()
        fixed = with_env({"HOROVOD_ZERO_BUCKET_BYTES": str(32 << 20), "HOROVOD_ZERO_PREFETCH": "1"},
                         lambda: hvd.DistributedZeroOptimizer(adamw(fixed_model), model=fixed_model, stage=3))
        train(fixed_model, fixed, steps=steps)
        same = all(torch.equal(params[n], p) for n, p in full_params(fixed_model, fixed).items())
        final = hvd.runtime_info()["autotune"]
        return dict(seen=seen, errors=rel_errors(params, reference(steps=steps)), same=same, final=final,
                    held=(fixed._reducer._bucket_limit, fixed._params._tuning.prefetch))
    finally:
        hvd.shutdown()


def test_zero_stage3_bucket_and_prefetch_change_at_steps_alike_and_results_do_not(tmp_path):
    log = tmp_path / "zero.csv"
    samples = 7  # the starting setting, five spread over the 4 knobs, one the optimiser proposes
    env = {**TINY, "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": str(samples), "HOROVOD_AUTOTUNE_LOG": str(log)}
    out = launch(_zero_stage3_tuned, 2, str(log), env=env, timeout=150)
    assert sorted(out) == [0, 1] and all(s == "ok" for s, _ in out.values()), out
    r0, r1 = out[0][1], out[1][1]
    rows, kept = _check_log(log, samples, ROUNDS)
    assert len({r[7] for r in rows}) > 1 and len({r[8] for r in rows}) > 1  # both ZeRO knobs were tuned
    # Each step's settings are the same on both ranks, and end at the kept ones.
    assert r0["seen"] == r1["seen"] and len(set(r0["seen"])) > 1
    assert r0["seen"][-1] == (int(kept[7]) << 20, int(kept[8]))
    assert (r0["final"]["zero_bucket_bytes"], r0["final"]["zero_prefetch"]) == r0["seen"][-1]
    for r in (r0, r1):
        assert max(r["errors"].values()) < 1e-6, r["errors"]
        assert r["same"], "the tuned run's parameters differ from those of the same run with fixed settings"
        assert r["held"] == (32 << 20, 1)  # set explicitly when that optimizer was built: not tuned
