"""`nonstop tune` end to end (a small, quick run on a scratch directory: the
JSON fields are sane and follow PCcheck's eq. 3) and the config file it
writes (nonstop/_options.py load_config)."""
import json
import math
import os
import shutil
import subprocess
import sys

import pytest

from nonstop import _options
from nonstop.errors import CheckpointMismatchError


def nonstop_cli():
    """The `nonstop` executable of this build, or None."""
    here = os.path.join(os.path.dirname(sys.executable), "nonstop")
    if os.access(here, os.X_OK):
        return here
    return shutil.which("nonstop")


needs_cli = pytest.mark.skipif(nonstop_cli() is None, reason="the nonstop CLI is not built")


def run_tune(tmp_path, *extra):
    cmd = [nonstop_cli(), "tune", "--dir", str(tmp_path / "dir"), "--state-bytes", "16MiB",
           "--step-ms", "20", "--quick", "--max-in-flight-cap", "2", "--medium", "buffered",
           "--json", *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@needs_cli
def test_tune_json_is_sane_and_follows_equation_3(tmp_path):
    cfg = tmp_path / "config.json"
    j = run_tune(tmp_path, "--max-overhead", "0.05", "--out", str(cfg))
    for key in ("max_in_flight", "writers", "chunk_bytes", "chunks", "interval", "measured",
                "inputs", "tw_s", "interval_reason"):
        assert key in j, key
    m = j["measured"]
    assert m["probe_bytes"] == 16 << 20
    assert all(c["GBps"] > 0 for c in m["copy"])
    assert [w["writers"] for w in m["write"]] == [1, 2, 4]
    assert all(w["GBps"] > 0 for w in m["write"])
    assert [p["max_in_flight"] for p in m["persist"]] == [1, 2]
    assert 1 <= j["max_in_flight"] <= 2
    assert j["writers"] in (1, 2, 4)
    assert j["chunk_bytes"] % 4096 == 0 and j["chunks"] >= j["writers"] + 2
    assert j["chunks"] * j["chunk_bytes"] == j["staging_bytes"]
    # T_w is the measured one at N* (16 MiB is the probe: not scaled).
    tw = {p["max_in_flight"]: p["tw_s"] for p in m["persist"]}[j["max_in_flight"]]
    assert j["tw_s"] == pytest.approx(tw)
    # N* minimises T_w / N (an N within 5 % with fewer in flight wins).
    best = min(p["tw_s"] / p["max_in_flight"] for p in m["persist"])
    assert tw / j["max_in_flight"] <= 1.05 * best + 1e-12
    # PCcheck eq. 3: f* = ceil(T_w / (N* q t)), q = 0.05, t = 0.02 s.
    f_star = math.ceil(j["tw_s"] / (j["max_in_flight"] * 0.05 * 0.02) - 1e-9)
    assert j["interval_overhead"] == max(1, f_star, math.ceil(j["stall_s"] / (0.05 * 0.02) - 1e-9))
    assert j["interval"] == j["interval_overhead"] and j["interval_rule"] == "overhead"
    assert j["young_daly_interval"] is None
    # The config file carries the same choices under Checkpointer's names.
    c = json.loads(cfg.read_text())
    assert c["format"] == "nonstop.config/1"
    assert (c["every"], c["max_in_flight"], c["writers"], c["chunk_bytes"]) == (
        j["interval"], j["max_in_flight"], j["writers"], j["chunk_bytes"])
    got = _options.load_config(str(cfg))
    assert got["every"] == j["interval"] and got["staging_bytes"] == j["staging_bytes"]
    assert not (tmp_path / "dir" / ".nonstop-tune").exists()


@needs_cli
def test_tune_with_mtbf_reports_young_daly_and_says_which(tmp_path):
    j = run_tune(tmp_path, "--mtbf", "5")
    assert j["young_daly_interval"] > 0
    assert j["interval_rule"] in ("overhead", "young-daly")
    assert j["interval"] >= j["interval_overhead"]
    assert 0 < j["goodput_at_interval"] <= 1
    assert "use" in j["interval_reason"]


@needs_cli
def test_tune_refuses_bad_input_in_one_line(tmp_path):
    out = subprocess.run([nonstop_cli(), "tune", "--dir", str(tmp_path), "--state-bytes", "1MiB",
                          "--step-ms", "10", "--max-overhead", "2"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "max-overhead" in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_config_reads_checkpointer_names(tmp_path):
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"format": "nonstop.config/1", "every": 7, "max_in_flight": 3,
                             "writers": 2, "chunk_bytes": 1 << 20, "medium": "buffered",
                             "tune": {"anything": 1}}))
    assert _options.load_config(str(p)) == {"every": 7, "max_in_flight": 3, "writers": 2,
                                    "chunk_bytes": 1 << 20, "medium": "buffered"}


def test_config_accepts_tune_json_output(tmp_path):
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"max_in_flight": 2, "writers": 4, "chunk_bytes": 4096, "chunks": 9,
                             "interval": 12, "tw_s": 0.3, "measured": {}, "inputs": {}}))
    assert _options.load_config(str(p)) == {"max_in_flight": 2, "writers": 4, "chunk_bytes": 4096,
                                    "every": 12}


def test_explicit_arguments_override_the_file(tmp_path):
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"every": "auto", "max_in_flight": 3, "max_overhead": 0.05}))
    s = _options.config_settings(str(p), every=5, max_in_flight=None, medium=None)
    assert s["every"] == 5 and s["max_in_flight"] == 3 and s["max_overhead"] == 0.05
    assert s["medium"] == "auto"  # the default
    assert _options.config_settings(None)["every"] == 10


@pytest.mark.parametrize("doc,msg", [
    ({"every": 0}, "every must be"),
    ({"every": "often"}, "every must be"),
    ({"writers": -1}, "writers must be"),
    ({"max_overhead": 3}, "max_overhead must be"),
    ({"wrtiers": 4}, "unknown setting 'wrtiers'"),
    ({"format": "other/2"}, "format"),
    ([1, 2], "JSON object"),
])
def test_config_errors_are_one_line(tmp_path, doc, msg):
    p = tmp_path / "c.json"
    p.write_text(json.dumps(doc))
    with pytest.raises(CheckpointMismatchError, match=msg) as e:
        _options.load_config(str(p))
    assert "\n" not in str(e.value) and str(p) in str(e.value)


def test_config_missing_or_not_json(tmp_path):
    with pytest.raises(CheckpointMismatchError, match="cannot read"):
        _options.load_config(str(tmp_path / "nope.json"))
    p = tmp_path / "bad.json"
    p.write_text("{")
    with pytest.raises(CheckpointMismatchError, match="not JSON"):
        _options.load_config(str(p))


def test_checkpointer_takes_the_config_and_explicit_arguments_win(spy_engine, tmp_path):
    import nonstop
    import tiny
    seen = {}

    class Seen:  # the keyword arguments of the newest engine
        def __getitem__(self, k):
            return spy_engine.instances[-1].kwargs[k]

    seen = Seen()
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"format": "nonstop.config/1", "every": 7, "max_in_flight": 3,
                             "writers": 2, "chunk_bytes": 1 << 20, "staging_bytes": 8 << 20,
                             "medium": "buffered"}))
    model, opt, _ = tiny.make()
    with nonstop.Checkpointer(str(tmp_path / "a"), {"model": model, "optim": opt},
                              config=str(p)) as ck:
        assert ck.every == 7
    assert (seen["max_in_flight"], seen["writers"], seen["chunk_bytes"], seen["staging_bytes"],
            seen["medium"]) == (3, 2, 1 << 20, 8 << 20, "buffered")
    with nonstop.Checkpointer(str(tmp_path / "b"), {"model": model, "optim": opt},
                              config=str(p), every=4, max_in_flight=1) as ck:
        assert ck.every == 4
    assert seen["max_in_flight"] == 1 and seen["writers"] == 2
    with nonstop.Checkpointer(str(tmp_path / "c"), {"model": model}) as ck:
        assert ck.every == 10
    assert seen["max_in_flight"] == 2 and seen["medium"] == "auto"


@needs_cli
def test_tuned_config_runs_a_real_checkpointer(tmp_path):
    """What tune writes, the real engine accepts."""
    import conftest
    if not conftest.real_engine_available():
        pytest.skip("the C++ engine is not built")
    import nonstop
    import tiny
    cfg = tmp_path / "config.json"
    run_tune(tmp_path, "--out", str(cfg))
    model, opt, sched = tiny.make()
    with nonstop.Checkpointer(str(tmp_path / "ck"), {"model": model, "optim": opt},
                              config=str(cfg), every=2) as ck:
        for s in range(4):
            tiny.train_step(model, opt, sched, s)
            ck.step(s)
        ck.wait()
        st = ck.stats()
        assert ck.latest() == 3
    tuned = json.loads(cfg.read_text())
    assert st["max_in_flight"] == tuned["max_in_flight"]
    assert st["chunk_bytes"] == tuned["chunk_bytes"]
