"""nonstop.export(dir, out, format="dcp"): a nonstop job directory as a
torch.distributed.checkpoint (DCP) checkpoint in get_state_dict's layout,
loadable under any world size (`python -m nonstop._dcp DIR OUT [--step N]`;
docs/DISTRIBUTED.md, "Interop with DCP"). One process reads every rank
file (gather), reassembles each global tensor and writes full tensors.
"""
from __future__ import annotations

import argparse
import inspect
import os
import sys
from typing import Optional

import torch

from . import _ext, _progress, _read, _state
from ._cli import cli_run
from ._distributed import consolidate
from ._objects import CONSOLIDATED
from .errors import CorruptCheckpointError

def gather(path: str, step: Optional[int] = None,
           progress=None) -> tuple[int, list, list, set]:
    """(step, [per rank: {name: tensor}], [per rank: metadata], names of the
    global tensors) of the newest checkpoint committed on every rank of
    `path` (or of `step`). A global tensor (replicated, or an FSDP2
    parameter or optimizer state) is reassembled whole from the ranks'
    pieces, and every rank's dict holds that one full tensor. Each rank's
    checkpoint is read through the one verified read path (read_into:
    every crc chunk read and verified once, each piece of a global tensor
    straight into its place); `progress(done, total)` is
    told the bytes read after each rank."""
    readers = _read.readers(path)
    # The planner chooses (through the job directory's common selection): the
    # newest step every rank committed, of one run, that no rollback abandoned.
    sel = _ext.core().JobDir.open_for_read(path).select_common(len(readers), step=step)
    found = []  # per rank: (index, metadata)
    for r, sel_r in enumerate(sel["ranks"]):
        readers[r], idx = _read.chosen(path, sel_r, r, readers[r])
        meta = _state.loads(readers[r].checkpoints[idx]["meta_json"])
        _read.refuse_replayed(meta, f"checkpoint step {sel['step']} in {path}")
        found.append((idx, meta))
    doc = found[0][1].get("dist", {})
    shared = dict(doc.get("shared", {}))
    # FSDP2 Shard(0) DTensors: each rank wrote its rows with the same global
    # layout as a replicated share (_fsdp.py), so they reassemble the same way.
    for name, (shape, dtype, _) in doc.get("dtensor", {}).items():
        shared.setdefault(name, [shape, dtype])
    dtypes = {name: _meta_dtype(dtype, name, path) for name, (_, dtype) in shared.items()}
    specs = [reader.checkpoints[idx]["tensors"] for reader, (idx, _) in zip(readers, found)]
    # Where each rank's pieces go (C++, dist_lay_out_shared): a piece outside
    # its tensor, pieces that overlap or leave a gap, a size out of range are
    # one line before anything is allocated; each piece is read into its place.
    layout, _, copies = _ext.core().dist_lay_out_shared(
        [(n, s, d) for n, (s, d) in shared.items()],
        [(r, i, sp["name"], int(sp.get("global_offset", 0)), int(sp["nbytes"]))
         for r, table in enumerate(specs) for i, sp in enumerate(table)], True, path, sel["step"])
    whole = {name: torch.empty(shared[name][0], dtype=dtypes[name]) for name, _, _ in layout}
    base = {name: off for name, off, _ in layout}
    total = sum(sp["nbytes"] for table in specs for sp in table)
    done = 0
    tensors, metas = [], []
    for r, (reader, (idx, meta)) in enumerate(zip(readers, found)):
        got, dests = _read.destinations(
            [None if sp["name"] in shared else sp for sp in specs[r]], False, None)
        for _, i, off, n in (c for c in copies if c[0] == r):
            name = specs[r][i]["name"]
            dests[i] = (whole[name].data_ptr() + off - base[name], n)
        _read.read_into(reader, idx, dests)
        done += sum(sp["nbytes"] for sp in specs[r])
        if progress is not None:
            progress(done, total)
        tensors.append({**whole, **got})
        metas.append(meta)
    return _read.step_key(found[0][1])[0], tensors, metas, set(shared)


def collect(path: str, step: Optional[int] = None) -> tuple[int, dict]:
    """(step, {name: full tensor}) of the newest checkpoint committed on
    every rank of `path` (or of `step`), by nonstop's tensor names; a
    rank-local tensor of a multi-rank job as `rank-R/NAME`."""
    got, tensors, _, shared = gather(path, step)
    out = {n: tensors[0][n] for n in shared}
    for r, mine in enumerate(tensors):
        for name, t in mine.items():
            if name not in shared:
                out[f"rank-{r}/{name}" if len(tensors) > 1 else name] = t
    return got, out


def _refs(tree) -> set:
    """Names of the tensors a state tree refers to."""
    out, stack = set(), [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            ref = node.get("__tensor__", node.get("__ndarray__"))
            if isinstance(ref, str) and len(node) == 1:
                out.add(ref)
            else:
                stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return out


def _checked_names(names) -> dict:
    """The metadata's "names" (_fqn.describe) when well formed, else a
    one-line CorruptCheckpointError: it comes from the file, so a crafted one
    must not surface as a raw AttributeError/IndexError from the export."""
    def bad(why: str):
        return CorruptCheckpointError(f"checkpoint metadata 'names' is malformed: {why}")
    if names is None:
        return {}
    if not isinstance(names, dict):
        raise bad("not an object")
    mods, opts = names.get("modules", {}), names.get("optimizers", {})
    if not isinstance(mods, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in mods.items()):
        raise bad("'modules' is not a map of names to prefixes")
    if not isinstance(opts, dict):
        raise bad("'optimizers' is not an object")
    for k, o in opts.items():
        if (not isinstance(o, dict) or not isinstance(o.get("module"), str)
                or not isinstance(o.get("params"), list)
                or not all(isinstance(n, str) for n in o["params"])):
            raise bad(f"optimizer {k!r} has no module name and list of parameter names")
    return {"modules": mods, "optimizers": opts}


def _rename(key: str, value, names: dict):
    """`value` (state `key`, rebuilt) under get_state_dict's names: a
    module's keys without the wrapper prefix, an optimizer's state and
    param_groups by parameter FQN."""
    prefix = names.get("modules", {}).get(key)
    if prefix is not None and isinstance(value, dict):
        return {k[len(prefix):] if prefix and k.startswith(prefix) else k: v
                for k, v in value.items()}
    opt = names.get("optimizers", {}).get(key)
    if (opt is not None and isinstance(value, dict) and isinstance(value.get("state"), dict)
            and isinstance(value.get("param_groups"), list)):
        fqn = opt["params"]
        ids = [i for g in value["param_groups"] if isinstance(g, dict)
               for i in g.get("params", [])]
        if (not all(isinstance(i, int) for i in ids) or sorted(ids) != list(range(len(fqn)))
                or not all(isinstance(i, int) and 0 <= i < len(fqn) for i in value["state"])):
            return value  # not the optimizer the names were taken from
        out = dict(value)
        out["state"] = {fqn[i]: v for i, v in value["state"].items()}
        out["param_groups"] = [{**g, "params": [fqn[i] for i in g["params"]]}
                               for g in value["param_groups"]]
        return out
    return value


def layout(tensors: list, metas: list, shared: set) -> dict:
    """The state in get_state_dict's layout: {state key: value}, a module
    by its own names (a tied weight under every name), an optimizer's state
    and param_groups by parameter FQN, everything else (schedulers, plain
    values) as saved; a ZeroRedundancyOptimizer consolidated from its
    shards. Other rank-local tensors of a multi-rank job (local= state,
    FSDP2's BatchNorm buffers) go under "rank-R": a module's
    local entries as {"rank-R": {key: {name: tensor}}}, any other value
    holding one whole as {"rank-R": {key: value}}."""
    world = len(metas)
    names = _checked_names(metas[0].get("names"))
    zero = metas[0].get("dist", {}).get("zero", {}) if world > 1 else {}
    out: dict = {}
    for key, tree in metas[0].get("state", {}).items():
        if isinstance(zero, dict) and key in zero:
            # A ZeroRedundancyOptimizer: each rank's shard, consolidated into
            # its global parameter order, then named by FQN like any optimizer.
            out[key] = _rename(key, _zero_consolidated(key, tensors, metas), names)
            continue
        local = {n for n in _refs(tree) if n not in shared} if world > 1 else set()
        if not local:
            out[key] = _rename(key, _state.unflatten(tree, tensors[0]), names)
            continue
        if key in names.get("modules", {}) and isinstance(tree, dict):
            # a state_dict: split entry by entry
            glob = {k: v for k, v in tree.items() if not (_refs(v) & local)}
            if glob:
                out[key] = _rename(key, _state.unflatten(glob, tensors[0]), names)
            for r in range(world):
                theirs = metas[r].get("state", {}).get(key, {})
                part = {k: v for k, v in theirs.items() if k not in glob}
                if part:
                    out.setdefault(f"rank-{r}", {})[key] = _rename(
                        key, _state.unflatten(part, tensors[r]), names)
            continue
        for r in range(world):
            theirs = metas[r].get("state", {}).get(key)
            out.setdefault(f"rank-{r}", {})[key] = _rename(
                key, _state.unflatten(theirs, tensors[r]), names)
    return out


def _zero_consolidated(key: str, tensors: list, metas: list) -> dict:
    """The consolidated state_dict (global parameter indices, as ZeRO's own
    consolidate_state_dict gives) of the ZeroRedundancyOptimizer saved under
    `key`, from every rank's shard (the resharding code's _consolidate). A
    malformed record is a one-line CorruptCheckpointError."""
    scratch: dict = {}
    try:
        tree = consolidate(key, metas, tensors, scratch)
        value = _state.unflatten(tree, scratch)
    except (KeyError, TypeError, IndexError, ValueError, AttributeError) as e:
        raise CorruptCheckpointError(
            f"the ZeRO optimizer state {key!r} cannot be consolidated from the ranks' records "
            f"({type(e).__name__}: {e})") from None
    value.pop(CONSOLIDATED, None)
    return value


def named(state) -> list:
    """(name, tensor) for every tensor of a state in get_state_dict's layout
    (layout()), named by its path ('model/fc.weight'), a tied one under each."""
    out: list = []

    def walk(node, name, depth):
        if depth > _state.MAX_DEPTH:
            return
        if isinstance(node, torch.Tensor):
            out.append((name, node))
        elif isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{name}/{k}" if name else str(k), depth + 1)
        elif isinstance(node, (list, tuple)):
            for i, v in enumerate(node):
                walk(v, f"{name}/{i}", depth + 1)

    walk(state, "", 0)
    return out


def export_dcp(dir: str, out: str, step: Optional[int] = None,
               progress: Optional[bool] = None) -> dict:
    """Writes the globally committed checkpoint (or `step`) of `dir` as a DCP
    checkpoint directory `out`, in get_state_dict's layout (see layout()).
    progress: the bar of the read (_progress.py: None on a terminal for
    256 MiB or more, True always, False never).
    Returns {'step', 'tensors', 'bytes', 'path'}."""
    import torch.distributed.checkpoint as dcp
    bar = _progress.Progress("nonstop export", progress)
    try:
        got_step, tensors, metas, shared = gather(os.fspath(dir), step, progress=bar)
    finally:
        bar.close()
    state = layout(tensors, metas, shared)
    distinct = {id(t): t for _, t in named(state)}  # each tensor object once
    count, nbytes = len(distinct), sum(t.numel() * t.element_size() for t in distinct.values())
    state["nonstop.step"] = torch.tensor(got_step, dtype=torch.int64)
    # The folder through the Env seam (made when missing, a symlink as its last
    # component refused); the files in it are written by torch's FileSystemWriter.
    _ext.core().Directory(os.path.abspath(out), create=True)
    kw = {}
    if "no_dist" in inspect.signature(dcp.save).parameters and not (
            torch.distributed.is_available() and torch.distributed.is_initialized()):
        kw["no_dist"] = True  # one process writes every tensor whole
    dcp.save(state, storage_writer=dcp.FileSystemWriter(out), **kw)
    return {"step": got_step, "tensors": count, "bytes": nbytes, "path": out}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m nonstop._dcp",
                                description="export a nonstop checkpoint as a DCP checkpoint")
    p.add_argument("dir")
    p.add_argument("out")
    p.add_argument("--step", type=int, default=None)
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="a progress bar on stderr (default: on a terminal, for big exports)")
    a = p.parse_args(argv)
    return cli_run(lambda: export_dcp(a.dir, a.out, a.step, progress=a.progress))


if __name__ == "__main__":
    sys.exit(main())


def _meta_dtype(name, tensor: str, path: str):
    """The torch dtype a checkpoint's metadata names, from the fixed list
    restore decodes with (_state.torch_dtype_by_name), never looked up in
    torch by the name: anything else is a corrupt checkpoint."""
    dt = _state.torch_dtype_by_name(name)
    if dt is None:
        raise CorruptCheckpointError(
            f"{path}: the metadata of tensor {tensor!r} names dtype {str(name)[:40]!r}, which "
            f"is not one nonstop writes")
    return dt
