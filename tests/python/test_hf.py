"""nonstop.hf: a Trainer job killed at a random step resumes exactly through
resume_from() (the bridge the Trainer's own resume logic reads), and the
bridge reflects the newest committed checkpoint."""
import json
import os

import pytest

from conftest import needs_engine

pytest.importorskip("transformers")
pytestmark = needs_engine


def test_hf_kill_and_resume_is_exact(tmp_path):
    from integration_harness import kill_resume_compare
    kill_after, ran = kill_resume_compare("hf", tmp_path)
    # the restart resumed from the bridge folder of the step it began after
    folder = tmp_path / "ckpt" / "nonstop-resume" / f"checkpoint-{ran[0]}"
    if ran[0] > 0:
        with open(folder / "trainer_state.json") as f:
            assert json.load(f)["global_step"] == ran[0]
        assert os.path.exists(folder / "model.safetensors")
        assert not os.path.exists(folder / "optimizer.pt")  # loaded from nonstop in place


def test_resume_from_an_empty_directory_is_a_fresh_start(tmp_path):
    from nonstop.hf import NonstopCallback, resume_from
    assert resume_from(NonstopCallback(str(tmp_path / "none"))) is None


def test_docs_example_runs_and_resumes(tmp_path):
    import nonstop
    from integration_harness import run_doc_example
    run_doc_example("HF.md", tmp_path, runs=2)  # the second run resumes through the bridge
    assert nonstop.load(str(tmp_path / "runs/hf/nonstop")).step == 11
    assert (tmp_path / "runs/hf/nonstop-resume/checkpoint-12/trainer_state.json").exists()
