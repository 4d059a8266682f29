"""One rank of a Hugging Face Trainer job for test_hf_dist.py, under
torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT: the Trainer
initialises the gloo process group itself and wraps the model in DDP):

    python hf_dist_train.py DIR OUT STEPS EVERY [--kill-at S] [--eval-steps E]
                            [--save-total-limit N] [--best MODE] [--load-best]

The job checkpoints through nonstop.hf.NonstopCallback into DIR and resumes
from it through resume_from (the same command is the first run and the
restart). --kill-at S: rank 1 SIGKILLs itself at the end of optimizer step S
(the checkpoint of that step is in flight). --best MODE: metric_for_best_model
"loss" with greater_is_better (MODE max) or not (min), evaluated every E
steps. Prints JSON lines ({"event": "start", "global_step"} at
on_train_begin, after the restore) and writes OUT.rank-R.json: digests of
the final weights, optimizer and scheduler state, the final RNG state, the
global step and the eval losses the Trainer logged.
"""
import argparse
import json
import os
import signal
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from dist_launch import end_rank  # noqa: E402
from dist_train import digest, emit  # noqa: E402

from nonstop.hf import NonstopCallback, resume_from  # noqa: E402


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.drop = torch.nn.Dropout(0.2)  # the global RNG, per rank
        self.fc2 = torch.nn.Linear(16, 1)

    def forward(self, x, y):
        out = self.fc2(self.drop(torch.relu(self.fc1(x)))).squeeze(-1)
        return {"loss": torch.nn.functional.mse_loss(out, y)}


class Data(torch.utils.data.Dataset):
    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x.sum(1) + 0.5 * torch.randn(n, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i]}


class Probe(TrainerCallback):
    def __init__(self, kill_at):
        self.kill_at = kill_at

    def on_train_begin(self, args, state, control, **kw):
        emit(event="start", rank=args.process_index, global_step=state.global_step)

    def on_step_end(self, args, state, control, **kw):
        if state.global_step - 1 == self.kill_at and args.process_index == 1:
            os.kill(os.getpid(), signal.SIGKILL)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("dir")
    p.add_argument("out")
    p.add_argument("steps", type=int)
    p.add_argument("every", type=int)
    p.add_argument("--kill-at", type=int, default=-1)
    p.add_argument("--eval-steps", type=int, default=0)
    p.add_argument("--save-total-limit", type=int, default=None)
    p.add_argument("--best", choices=["min", "max"], default=None)
    p.add_argument("--load-best", action="store_true")
    p.add_argument("--auto", action="store_true",
                   help="train(resume_from_checkpoint=True), not resume_from(cb)")
    a = p.parse_args()
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    kw = {}
    if a.eval_steps:
        kw.update(eval_strategy="steps", eval_steps=a.eval_steps)
    if a.best:
        kw.update(metric_for_best_model="loss", greater_is_better=a.best == "max")
    if a.load_best:  # the Trainer asks for its save strategy to match (nonstop takes the saves)
        kw.update(load_best_model_at_end=True, save_strategy="steps", save_steps=a.eval_steps)
    else:
        kw.update(save_strategy="no")
    args = TrainingArguments(output_dir=a.dir + "-out", max_steps=a.steps,
                             per_device_train_batch_size=4, per_device_eval_batch_size=4,
                             learning_rate=0.05, lr_scheduler_type="linear", warmup_steps=2,
                             logging_strategy="no", report_to=[], use_cpu=True, seed=0,
                             data_seed=7, disable_tqdm=True, remove_unused_columns=False,
                             label_names=["y"], ddp_backend="gloo",
                             save_total_limit=a.save_total_limit, **kw)
    torch.manual_seed(0)
    model = Model()
    cb = NonstopCallback(a.dir, every=a.every)
    trainer = Trainer(model=model, args=args, train_dataset=Data(64, 0),
                      eval_dataset=Data(16, 1) if a.eval_steps else None,
                      callbacks=[cb, Probe(a.kill_at)])
    trainer.train(resume_from_checkpoint=True if a.auto else resume_from(cb))
    rank = args.process_index
    opt = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") \
        else trainer.optimizer
    osd = opt.state_dict()
    res = {"rank": rank, "params": digest(model.parameters()),
           "optim": digest(v for _, st in sorted(osd["state"].items())
                           for _, v in sorted(st.items()) if isinstance(v, torch.Tensor)),
           "sched": trainer.lr_scheduler.state_dict()["last_epoch"],
           "rng": digest([torch.get_rng_state()]), "global_step": trainer.state.global_step,
           "evals": [(h["step"], h["eval_loss"]) for h in trainer.state.log_history
                     if "eval_loss" in h],
           "weights": {k: v.tolist() for k, v in model.state_dict().items()}}
    with open(f"{a.out}.rank-{rank}.json", "w") as f:
        json.dump(res, f)
    emit(event="done", rank=rank)
    end_rank()


if __name__ == "__main__":
    main()
