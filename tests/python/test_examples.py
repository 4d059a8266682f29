"""The Python examples in examples/ run as they are (#16: progress and
checkpoint stats). Run in this process (its main(argv)), twice, to show
the resume, without paying a Python and torch start per run."""
import json
import os
import runpy

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_progress_example_logs_every_checkpoint_and_resumes(tmp_path, capsys):
    main = runpy.run_path(os.path.join(ROOT, "examples", "progress_tensorboard.py"),
                          run_name="example")["main"]
    d, log = str(tmp_path / "ck"), str(tmp_path / "stats.jsonl")
    args = ["--dir", d, "--every", "10", "--log", log]
    main(args + ["--steps", "40"])
    out = capsys.readouterr()
    assert "trained steps 0..39; newest checkpoint: step 39" in out.out, out.out
    assert "train" in out.err and "40/40" in out.err  # the tqdm bar
    with open(log) as f:
        rows = [json.loads(line) for line in f]
    assert [x["step"] for x in rows] == [9, 19, 29, 39]
    assert all(x["committed"] and not x["error"] and x["bytes"] > 0 for x in rows), rows
    # Again with the same directory: it resumes after step 39.
    main(args + ["--steps", "60"])
    out = capsys.readouterr()
    assert "trained steps 40..59; newest checkpoint: step 59" in out.out, out.out
    with open(log) as f:
        assert [json.loads(line)["step"] for line in f] == [9, 19, 29, 39, 49, 59]


def test_tensorboard_path_writes_the_committed_checkpoint_scalars(tmp_path, capsys):
    """--tensorboard DIR: on_commit's stats of every committed checkpoint as
    scalars, read back from the event file by TensorBoard's own reader.
    (`make build` installs tensorboard, pinned.)"""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    main = runpy.run_path(os.path.join(ROOT, "examples", "progress_tensorboard.py"),
                          run_name="example")["main"]
    d, tb, log = str(tmp_path / "ck"), str(tmp_path / "tb"), str(tmp_path / "stats.jsonl")
    main(["--dir", d, "--every", "10", "--steps", "30", "--tensorboard", tb, "--log", log])
    capsys.readouterr()
    with open(log) as f:
        rows = {x["step"]: x for x in map(json.loads, f)}
    acc = EventAccumulator(tb)
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"checkpoint/bytes", "checkpoint/stall_s", "checkpoint/persist_s"} <= tags, tags
    got = {e.step: e.value for e in acc.Scalars("checkpoint/bytes")}
    assert sorted(got) == [9, 19, 29] == sorted(rows)
    for step, value in got.items():  # float32 in the event file
        assert value == pytest.approx(rows[step]["bytes"], rel=1e-6) and value > 0
    assert [e.step for e in acc.Scalars("checkpoint/stall_s")] == [9, 19, 29]
