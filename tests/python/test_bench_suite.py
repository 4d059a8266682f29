"""The benchmark suite's bookkeeping (bench/suite_rounds.py, bench/suite.py):
interleaving, the time budget, and how rounds become table rows. No timing
is asserted; the runs are fakes."""
import os
import sys
import time

import pytest

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench")
sys.path.insert(0, BENCH)

suite_rounds = pytest.importorskip("suite_rounds")
import suite  # noqa: E402


def fake_run(log: list, step_s: dict, sleep_s: float = 0.0):
    def run(kind, every):
        log.append((kind, every))
        if sleep_s:
            time.sleep(sleep_s)
        s = step_s[(kind, every)]
        saves = 0 if kind == "none" else 4
        return {"scheme": kind, "interval": every, "steps": 8, "step_s": s, "saves": saves,
                "cpu_per_step_s": 0.1, "stall_per_step_s": 0.01 * saves / 8,
                "stall_per_ckpt_s": 0.01 if saves else 0.0, "drain_s": 0.0}
    return run


def test_rounds_interleave_with_none_between_groups():
    log = []
    steps = {("none", 0): 1.0, ("a", 1): 2.0, ("b", 1): 1.25, ("a", 5): 1.1, ("b", 5): 1.0}
    res = suite_rounds.run_rounds([[("a", 1), ("b", 1)], [("a", 5), ("b", 5)]], 2,
                                  fake_run(log, steps), log=lambda m: None)
    one = [("none", 0), ("a", 1), ("b", 1), ("none", 0), ("a", 5), ("b", 5), ("none", 0)]
    assert log == one + one
    assert res["stopped"] == ""
    rows, drift, base = suite_rounds.summarize(res["runs"])
    by = {(r["scheme"], r["interval"]): r for r in rows}
    assert base == 1.0 and drift == 0.0
    assert by[("a", 1)]["relative"] == pytest.approx(0.5)
    assert by[("b", 1)]["relative"] == pytest.approx(0.8)
    assert by[("a", 1)]["runs"] == 2
    assert by[("a", 1)]["steps_measured"] == 16 and by[("a", 1)]["ckpts_measured"] == 8


def test_a_run_that_returns_none_is_left_out_and_the_rounds_go_on():
    # bench/gpu_overhead.py returns None for a peer scheme that crashed (DCP's
    # process mode on torch 2.11): the rounds go on and summarize the rest.
    log, msgs = [], []
    steps = {("none", 0): 1.0, ("a", 1): 2.0, ("b", 1): 1.25}
    run = fake_run(log, steps)
    res = suite_rounds.run_rounds([[("a", 1), ("b", 1)]], 2,
                                  lambda k, e: None if k == "a" else run(k, e), log=msgs.append)
    assert log == [("none", 0), ("b", 1), ("none", 0)] * 2
    assert [r["scheme"] for r in res["runs"]] == ["none", "b", "none"] * 2
    assert sum("not run" in m for m in msgs) == 2
    rows = suite_rounds.summarize(res["runs"])[0]
    assert {r["scheme"] for r in rows} == {"none", "b"}


def test_rounds_stop_before_a_run_predicted_to_overrun(monkeypatch):
    # A virtual clock (each run takes exactly 0.1 s of it): with the real
    # clock a loaded machine stretched a 0.1 s sleep enough to stop one run
    # early, a failure of the machine, not of the rule.
    import types
    clock = [100.0]
    monkeypatch.setattr(suite_rounds, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    log = []
    steps = {("none", 0): 1.0, ("a", 1): 2.0}
    run = fake_run(log, steps)

    def timed_run(kind, every):
        clock[0] += 0.1
        return run(kind, every)

    deadline = clock[0] + 0.25
    res = suite_rounds.run_rounds([[("a", 1)]], 5, timed_run, log=lambda m: None,
                                  deadline=deadline)
    # Each run takes 0.1 s: two fit, a third would end past the deadline.
    assert len(log) == 2
    assert "time budget" in res["stopped"]
    assert clock[0] <= deadline


def test_combine_rounds_takes_median_and_spread_of_per_round_ratios():
    def one(rel, stall):
        return {"none_drift": [0.0], "rows": [
            {"scheme": "none", "interval": 0, "max_in_flight": 0, "relative": 1.0,
             "steps_per_s": 20.0, "stall_ms_mean": 0.0},
            {"scheme": "concurrent", "interval": 5, "max_in_flight": 2, "relative": rel,
             "steps_per_s": 20.0 * rel, "stall_ms_mean": stall}]}
    rows = suite.combine_rounds([one(0.9, 3.0), one(0.7, 9.0), one(0.8, 5.0)])
    assert len(rows) == 1
    r = rows[0]
    assert r["relative"] == pytest.approx(0.8)
    assert r["relative_spread"] == pytest.approx(0.2)
    assert r["stall_ms_mean"] == pytest.approx(5.0)
    assert r["rounds"] == 3


def _cli():
    """$NONSTOP_CLI, else the `nonstop` next to this Python, else None."""
    for c in (os.environ.get("NONSTOP_CLI", ""),
              os.path.join(os.path.dirname(sys.executable), "nonstop")):
        if c and os.access(c, os.X_OK):
            return c
    return None


def _cli_runs_the_suite(cli) -> bool:
    import subprocess
    out = subprocess.run([cli, "bench", "--help"], capture_output=True, text=True, timeout=30)
    return "--quick" in out.stdout


def test_nonstop_bench_without_subcommand_runs_the_suite(tmp_path):
    """`nonstop bench --quick ...` execs `PY SUITE --quick ...`, PY and SUITE
    from $NONSTOP_PYTHON and $NONSTOP_SOURCE (here: a stub suite that
    records its arguments)."""
    import subprocess
    cli = _cli()
    if cli is None or not _cli_runs_the_suite(cli):
        pytest.skip("this nonstop CLI predates `nonstop bench --quick` (set NONSTOP_CLI)")
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "suite.py").write_text(
        "import json, sys\nprint(json.dumps(sys.argv[1:]))\nsys.exit(3)\n")
    env = dict(os.environ, NONSTOP_SOURCE=str(tmp_path), NONSTOP_PYTHON=sys.executable)
    out = subprocess.run([cli, "bench", "--quick", "--only", "tune,report"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 3, out.stderr
    assert out.stdout.strip() == '["--quick", "--only", "tune,report"]'
    # No suite there: a clear one-line error, not a crash.
    env["NONSTOP_SOURCE"] = str(tmp_path / "nowhere")
    out = subprocess.run([cli, "bench"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "bench/suite.py not found" in out.stderr
    # A subcommand still refuses options it does not know.
    out = subprocess.run([cli, "bench", "storage", "--dir", str(tmp_path), "--size", "1048576",
                          "--repeat", "1", "--bogus"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0


def test_a_scheme_that_fails_mid_run_releases_its_checkpointer(tmp_path):
    # bench/gpu_overhead.py records any scheme's crash as a row and goes on;
    # run_one must let go of the scheme's engine (pinned staging, threads)
    # when its run raises, and leave no checkpoint directory behind.
    import torch
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = []

    def step(s):
        calls.append(s)
        if len(calls) == 3:
            raise RuntimeError("boom")
        opt.zero_grad()
        model(torch.ones(2, 8)).sum().backward()
        opt.step()
    closed = []
    real = suite_rounds.Saver.abandon

    def abandon(self):
        closed.append(self.ckpt is not None)
        real(self)
        assert self.ckpt is None
    suite_rounds.Saver.abandon = abandon
    try:
        with pytest.raises(RuntimeError, match="boom"):
            suite_rounds.run_one("nonstop", 2, 4, step, {"model": model, "optim": opt},
                                 str(tmp_path), 0, warmup=3)
    finally:
        suite_rounds.Saver.abandon = real
    assert closed == [True]
    assert not os.path.exists(tmp_path / "nonstop" / "2")


def test_gpu_targets_name_every_target_with_its_figure_and_status(tmp_path):
    # bench/gpu_targets.py over gpu_run.sh's $OUT: made-up results (not
    # measurements) that pass some targets, fail others, and miss the rest.
    import json
    import gpu_targets

    def bench(rows, restore=None):
        return {"rows": rows, "restore": restore, "refused": {}, "crashed": {}}

    def row(scheme, ovh, stall_ms=5.0):
        return {"scheme": scheme, "step_s": 0.1 * (1 + ovh), "throughput_overhead": ovh,
                "stall_per_ckpt_s": stall_ms / 1e3, "runs": 1, "ckpts_measured": 2,
                "none_drift": 0.01}
    small = bench([row("none", 0.0), row("nonstop-tiered/10", 0.004), row("nonstop-tiered/1", 0.2),
                   row("nonstop-auto/10", 0.006),
                   row("dcp/10", 1.5),
                   {"scheme": "dcp-process/10", "interval": 10, "crashed": True,
                    "error": "KeyError: <class 'type'>"}],
                  {"nonstop_vs_dcp": 1.3, "nonstop_GBps": 2.6, "dcp_GBps": 2.0,
                   "cold": [True, True], "memory": {"GBps": 12.0, "from": ["memory"]}})
    big = bench([row("none", 0.0), row("nonstop-tiered/10", 0.009, 12.0),
                 row("nonstop-direct/50", 0.02, 440.0), row("nonstop-multistep/50", 0.01, 60.0)])
    (tmp_path / "gpu_overhead_125m.json").write_text(json.dumps(small))
    (tmp_path / "gpu_overhead_1.4b.json").write_text(json.dumps(big))
    (tmp_path / "test-gpu.log").write_text(
        "100% tests passed, 0 tests failed out of 7\n"
        "PASS GPU training resume (multistep): killed ...\n== tests/gpu/test_gpu_torch.py: exit 0\n")
    res = {r["id"]: r for r in gpu_targets.evaluate(str(tmp_path), "125m", "1.4b", 500.0)}
    got = {k: r["status"] for k, r in res.items()}
    assert got == {"tests": "PASS", "big-10": "PASS", "big-10-stall": "PASS", "big-50": "MISSING",
                   "small-10": "PASS", "small-1": "FAIL", "small-auto-10": "PASS",
                   "big-multistep": "PASS",
                   "restore-125m": "PASS", "restore-memory-125m": "PASS", "dcp-rows": "PASS",
                   "dcp-process-rows": "PASS", "wall": "PASS"}, got
    assert res["big-multistep"]["figure"] == "0.136x"
    assert "crashed: KeyError" in res["dcp-process-rows"]["figure"]
    assert res["small-1"]["figure"] == "+20.00 %"
    # A failing torch test, and no results at all: FAIL, then MISSING everywhere else.
    (tmp_path / "test-gpu.log").write_text("FAIL layerwise copy=host: ...\n== x: exit 1\n")
    for f in ("gpu_overhead_125m.json", "gpu_overhead_1.4b.json"):
        os.unlink(tmp_path / f)
    res = gpu_targets.evaluate(str(tmp_path), "125m", "1.4b", None)
    assert res[0]["status"] == "FAIL" and "FAIL layerwise" in res[0]["note"]
    assert all(r["status"] == "MISSING" for r in res[1:]), res


def test_gpu_overhead_run_plan():
    import gpu_overhead
    assert gpu_overhead.run_plan(["nonstop-tiered/10", "dcp/10", "nonstop-tiered/1"], [], []) == [
        [("nonstop-tiered", 10), ("dcp", 10)], [("nonstop-tiered", 1)]]
    assert gpu_overhead.run_plan(None, ["a", "b"], [1, 5]) == [[("a", 1), ("b", 1)],
                                                                [("a", 5), ("b", 5)]]
    with pytest.raises(SystemExit):
        gpu_overhead.run_plan(["nonsense/10"], [], [])
