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
    # the restart resumed from a bridge folder, which is gone once the
    # Trainer read it (no full copy of the model left behind per restart)
    if ran[0] > 0:
        assert not (tmp_path / "ckpt" / "nonstop-resume" / f"checkpoint-{ran[0]}").exists()
        assert not any((tmp_path / "ckpt" / "nonstop-resume").iterdir())


def test_resume_from_writes_the_trainer_folder_and_the_callback_removes_it(tmp_path):
    """What the Trainer reads from the bridge (trainer_state.json, the
    weights, the RNG states; the optimizer comes from nonstop in place), and
    its removal: the weights at on_train_begin (the Trainer has loaded them),
    the folder at the first on_step_begin (the RNG states were read)."""
    import torch

    import nonstop
    from nonstop.hf import NonstopCallback, resume_from
    d = str(tmp_path / "nonstop")
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    with nonstop.Checkpointer(d, {"model": model, "optim": opt,
                                  "trainer_state": {"global_step": 3}}, every=1) as ck:
        ck.save(2).wait()
    saved = {k: v.clone() for k, v in opt.state_dict()["state"][0].items()}
    model = torch.nn.Linear(4, 4)  # the resumed run's, before its first step
    opt = torch.optim.AdamW(model.parameters())
    cb = NonstopCallback(d)
    folder = resume_from(cb)
    assert folder.endswith(os.path.join("nonstop-resume", "checkpoint-3"))
    with open(os.path.join(folder, "trainer_state.json")) as f:
        assert json.load(f)["global_step"] == 3
    assert {"model.safetensors", "rng_state.pth", "trainer_state.json"} <= set(os.listdir(folder))
    assert not os.path.exists(os.path.join(folder, "optimizer.pt"))
    cb.on_train_begin(None, None, None, model=model, optimizer=opt)
    got = opt.state_dict()["state"][0]  # restored in place from nonstop
    assert all(torch.equal(got[k], v) for k, v in saved.items())
    cb.close()
    assert not os.path.exists(os.path.join(folder, "model.safetensors"))
    assert os.path.exists(os.path.join(folder, "rng_state.pth"))
    cb.on_step_begin(None, None, None)
    assert not os.path.exists(folder)


def test_resume_from_an_empty_directory_is_a_fresh_start(tmp_path):
    from nonstop.errors import CheckpointNotFoundError
    from nonstop.hf import NonstopCallback, resume_from
    assert resume_from(NonstopCallback(str(tmp_path / "none"))) is None
    with pytest.raises(CheckpointNotFoundError):  # a step asked for is not there
        resume_from(NonstopCallback(str(tmp_path / "none")), step=3)


def test_resume_from_a_job_killed_before_its_first_commit_is_a_fresh_start(tmp_path):
    """The slot file exists (the first save registered the state) but holds
    no committed checkpoint, as when the job was killed during its first
    commit: resume_from() says fresh start (None), as restore() does, and a
    step asked for is still not found. (The Trainer job of
    test_hf_kill_and_resume_is_exact reached this state once under load.)"""
    import torch

    import nonstop
    from nonstop.errors import CheckpointNotFoundError
    from nonstop.hf import NonstopCallback, resume_from
    d = str(tmp_path / "ck")
    w = torch.ones(64)
    ck = nonstop.Checkpointer(d, {"w": w}, every=1000)
    ck.session.engine.register(ck.session.refs({"w": w}, set()))  # the first save's registration, no commit
    ck.close()
    assert os.path.exists(os.path.join(d, nonstop._core.slot_file_name(0)))
    with nonstop.Checkpointer(d, {"w": w}) as again:
        assert again.restore() is None
    assert resume_from(NonstopCallback(d)) is None
    with pytest.raises(CheckpointNotFoundError):
        resume_from(NonstopCallback(d), step=0)



def test_bridge_folder_goes_through_the_seam_and_never_follows_links(tmp_path):
    """resume_from writes its folder through _core.Directory: a link planted
    at FOLDER.tmp (a folder elsewhere) or inside an old FOLDER is removed as
    a link, never followed, and the folder holds exactly the bridge files.
    (The old shutil.rmtree/os.makedirs path raised FileExistsError on the
    link at FOLDER.tmp.)"""
    import torch
    from safetensors.torch import load_file

    import nonstop
    from nonstop.hf import NonstopCallback, resume_from
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    d = str(tmp_path / "ck")
    with nonstop.Checkpointer(d, {"model": model, "optim": opt,
                                  "trainer_state": {"global_step": 4, "epoch": 1.0}},
                              every=1, on_preempt=False) as ck:
        ck.save(3)
        ck.wait()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_bytes(b"precious bytes")
    folder = tmp_path / "bridge" / "checkpoint-4"
    folder.mkdir(parents=True)
    os.symlink(outside, str(folder) + ".tmp")
    os.symlink(outside / "precious", folder / "model.safetensors")
    os.symlink(outside, folder / "sub")
    got = resume_from(NonstopCallback(d), folder=str(folder))
    assert got == str(folder)
    assert sorted(os.listdir(outside)) == ["precious"]
    assert (outside / "precious").read_bytes() == b"precious bytes"
    assert sorted(os.listdir(folder)) == ["model.safetensors", "rng_state.pth",
                                          "trainer_state.json"]
    assert not os.path.lexists(str(folder) + ".tmp")
    with open(folder / "trainer_state.json") as f:
        assert json.load(f)["global_step"] == 4
    sd = load_file(str(folder / "model.safetensors"))
    assert torch.equal(sd["weight"], model.weight.detach())
    assert (folder / "rng_state.pth").stat().st_size > 0  # the Trainer reads it itself


def _train_hf(tmp_path, callback, max_steps=8, resume=None, stop_at=None, **args_kw):
    """A real Trainer on a small regression, evaluated every 2 steps;
    `stop_at`: the run stops after that step (as a killed job would, the
    schedule still planned for max_steps)."""
    import torch
    import transformers
    from transformers import Trainer, TrainingArguments
    transformers.logging.set_verbosity_error()

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def forward(self, x, y):
            return {"loss": torch.nn.functional.mse_loss(self.lin(x).squeeze(-1), y)}

    class Data(torch.utils.data.Dataset):
        def __init__(self, n, seed):
            g = torch.Generator().manual_seed(seed)
            self.x = torch.randn(n, 4, generator=g)
            self.y = self.x.sum(1) + 0.5 * torch.randn(n, generator=g)

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            return {"x": self.x[i], "y": self.y[i]}

    torch.manual_seed(0)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=max_steps,
                             per_device_train_batch_size=4, learning_rate=0.05,
                             eval_strategy="steps", eval_steps=2,
                             save_strategy=args_kw.pop("save_strategy", "no"),
                             logging_strategy="no", report_to=[], use_cpu=True,
                             disable_tqdm=True, remove_unused_columns=False, label_names=["y"],
                             **args_kw)
    class Stop(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == stop_at:
                control.should_training_stop = True

    trainer = Trainer(model=Model(), args=args, train_dataset=Data(64, 0),
                      eval_dataset=Data(16, 1), callbacks=[callback, Stop()])
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def _kept(d):
    import nonstop
    return sorted((r["step"], r["metrics"].get("eval_loss")) for r in nonstop.list(d)
                  if r["where"] == "keep" and r["state"] == "committed")


@pytest.mark.parametrize("greater", [False, True])
def test_metric_for_best_model_keeps_the_best_evaluated_checkpoint(tmp_path, greater):
    """TrainingArguments(metric_for_best_model="loss", greater_is_better=...)
    reach nonstop's best=("eval_loss", "min"|"max", 1): each evaluated step's
    checkpoint carries the Trainer's eval metrics and the best one is kept
    (greater_is_better=True keeps the worst loss: the direction is honoured,
    not the newest)."""
    from nonstop.hf import NonstopCallback
    d = str(tmp_path / "nonstop")
    trainer = _train_hf(tmp_path, NonstopCallback(d, every=100),
                        metric_for_best_model="loss", greater_is_better=greater)
    evals = [(h["step"], h["eval_loss"]) for h in trainer.state.log_history if "eval_loss" in h]
    assert len(evals) == 4
    step, loss = (max if greater else min)(evals, key=lambda e: e[1])
    assert _kept(d) == [(step - 1, pytest.approx(loss))]
    import nonstop
    best = nonstop.load(d, step=step - 1)  # the kept copy, as docs/HF.md says
    assert best.step == step - 1 and "lin.weight" in best.state["model"]


def test_save_total_limit_keeps_the_newest_checkpoints(tmp_path):
    """TrainingArguments(save_total_limit=2): the newest 2 checkpoints stay
    as kept copies (keep=1, max_to_keep=2); given twice it is refused."""
    from nonstop.errors import CheckpointMismatchError
    from nonstop.hf import NonstopCallback
    d = str(tmp_path / "nonstop")
    _train_hf(tmp_path, NonstopCallback(d, every=1), max_steps=6, save_total_limit=2)
    assert [s for s, _ in _kept(d)] == [4, 5]
    with pytest.raises(CheckpointMismatchError, match="save_total_limit"):
        _train_hf(tmp_path, NonstopCallback(str(tmp_path / "x"), every=1, keep=2,
                                            max_to_keep=3), save_total_limit=2)


def test_load_best_model_at_end_loads_the_best_nonstop_checkpoint(tmp_path):
    """TrainingArguments(load_best_model_at_end=True) (the Trainer asks for
    save_strategy == eval_strategy): the Trainer writes none of its own
    checkpoints (nonstop takes those saves) and at the end the model holds
    the weights of the best evaluated step (greater_is_better=True: the
    worst loss, not the newest); state.best_model_checkpoint names the kept
    copy. (On main the model kept the last step's weights.)"""
    import torch

    import nonstop
    from nonstop.hf import NonstopCallback
    d = str(tmp_path / "nonstop")
    trainer = _train_hf(tmp_path, NonstopCallback(d, every=100), metric_for_best_model="loss",
                        greater_is_better=True, load_best_model_at_end=True,
                        save_strategy="steps", save_steps=2)
    evals = [(h["step"], h["eval_loss"]) for h in trainer.state.log_history if "eval_loss" in h]
    step = max(evals, key=lambda e: e[1])[0] - 1
    assert step != 7  # the test means something only when the best is not the newest
    best = nonstop.load(d, step=step).state["model"]
    live = trainer.model.state_dict()
    assert all(torch.equal(live[k], best[k]) for k in live)
    assert not [n for n in os.listdir(tmp_path / "out") if n.startswith("checkpoint-")]
    assert os.path.isdir(trainer.state.best_model_checkpoint)
    assert trainer.state.best_model_checkpoint.startswith(os.path.join(d, "keep"))


def _same_run(a, b):
    import torch
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    oa, ob = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    assert all(torch.equal(oa[i][k], ob[i][k]) for i in oa for k in oa[i])
    assert a.state.global_step == b.state.global_step


def test_resume_from_checkpoint_true_finds_the_newest_nonstop_checkpoint(tmp_path):
    """trainer.train(resume_from_checkpoint=True) with only nonstop
    checkpoints: the callback prepared output_dir/checkpoint-<global_step> at
    Trainer construction, the Trainer's own lookup finds it, and the resumed
    run equals an uninterrupted one bitwise (weights, optimizer state); the
    folder is gone afterwards. (On main: ValueError, no valid checkpoint.)"""
    from nonstop.hf import NonstopCallback
    whole = _train_hf(tmp_path / "whole", NonstopCallback(str(tmp_path / "whole" / "ck")))
    d = str(tmp_path / "ck")
    _train_hf(tmp_path, NonstopCallback(d, every=1), stop_at=5)
    out = tmp_path / "out"
    assert not [n for n in os.listdir(out) if n.startswith("checkpoint-")]
    resumed = _train_hf(tmp_path, NonstopCallback(d, every=1), resume=True)
    assert resumed.state.log_history[-1]["step"] == 8
    _same_run(whole, resumed)
    assert not [n for n in os.listdir(out) if n.startswith("checkpoint-")]


def test_prepared_folder_unused_is_removed_and_a_newer_trainer_checkpoint_wins(tmp_path):
    """The folder prepared at construction goes at on_train_begin when the
    run starts fresh (train() without resume), and a newer checkpoint-N the
    Trainer saved itself wins its lookup (nonstop's folder is unused and
    removed; the Trainer's own folder stays); one of the same step is left
    alone (the Trainer resumes from its own); a prepared folder left by a
    killed run goes at the next construction."""
    from nonstop.hf import NonstopCallback
    d = str(tmp_path / "ck")
    _train_hf(tmp_path, NonstopCallback(d, every=2), stop_at=3)  # nonstop: global step 2
    out = tmp_path / "out"
    fresh = _train_hf(tmp_path, NonstopCallback(str(tmp_path / "ck2"), every=100), stop_at=4,
                      save_strategy="steps", save_steps=4, seed=1)  # the Trainer's checkpoint-4
    assert sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")) == ["checkpoint-4"]
    cb = NonstopCallback(d, every=2)
    resumed = _train_hf(tmp_path, cb, resume=True)
    assert resumed.state.global_step == 8
    # it resumed from the Trainer's checkpoint-4 (its history is the seed-1
    # run's), nonstop's checkpoint-2 is gone
    at4 = [h["eval_loss"] for h in fresh.state.log_history
           if h.get("step") == 4 and "eval_loss" in h]
    assert at4 == [h["eval_loss"] for h in resumed.state.log_history
                   if h.get("step") == 4 and "eval_loss" in h]
    assert sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")) == ["checkpoint-4"]
    # a Trainer folder of nonstop's own step is left as it is
    import shutil
    shutil.rmtree(out / "checkpoint-4")
    (out / "checkpoint-8").mkdir()
    (out / "checkpoint-8" / "trainer_state.json").write_text("{}")
    cb = NonstopCallback(d, every=2)  # nonstop's newest: global step 8
    cb.on_init_end(resumed.args, None, None, model=resumed.model)
    assert cb._auto is None
    assert os.listdir(out / "checkpoint-8") == ["trainer_state.json"]
    # a folder prepared by a run killed before its first step goes at the next construction
    shutil.rmtree(out / "checkpoint-8")
    cb.on_init_end(resumed.args, None, None, model=resumed.model)
    assert (out / "checkpoint-8" / "nonstop-resume.json").exists()
    NonstopCallback(str(tmp_path / "ck3")).on_init_end(resumed.args, None, None,
                                                        model=resumed.model)
    assert not (out / "checkpoint-8").exists()
