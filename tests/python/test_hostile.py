"""Hostile and damaged checkpoints through the Python front end.

Each checkpoint here is written by the real engine with valid checksums, but
with metadata or names a careless or hostile writer could produce. restore()
must check everything before it changes any object, answer with one line of
nonstop's own error classes, and fall back to the next older checkpoint
where the checkpoint itself is bad.
"""
import json
import warnings

import pytest

torch = pytest.importorskip("torch")
import nonstop  # noqa: E402
from nonstop import _checkpointer, _state  # noqa: E402
from nonstop.errors import (CheckpointError, CheckpointMismatchError,  # noqa: E402
                            CorruptCheckpointError)


class Holder:
    """A stateful object with plain data, as a scheduler is."""

    def __init__(self):
        self.data = {"lr": 0.5}

    def state_dict(self):
        return dict(self.data)

    def load_state_dict(self, sd):
        self.data = dict(sd)


def make(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    return model, opt


def train(model, opt, n=1):
    for _ in range(n):
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        opt.zero_grad()


def snapshot(model, opt, holder=None):
    out = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for i, st in opt.state.items():
        for k, v in st.items():
            out[f"opt{i}{k}"] = v.detach().clone() if isinstance(v, torch.Tensor) else v
    if holder is not None:
        out["holder"] = dict(holder.data)
    return out


def same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def write_good_then_hostile(d, mutate_meta=None, names=None):
    """Step 1: a good checkpoint. Step 2 (the newest): the same state with
    its metadata changed by mutate_meta(meta) and/or its tensor names
    replaced by names(old_name) -> str or bytes (registered with the real
    engine as they are). Returns the state as of step 1."""
    model, opt = make()
    holder = Holder()
    train(model, opt, 2)
    with nonstop.Checkpointer(d, {"model": model, "optim": opt, "sched": holder},
                              every=1000, on_preempt=False) as ck:
        ck.save(1)
        ck.wait()
        good = snapshot(model, opt, holder)
        meta = nonstop.load(d).meta
        meta["step"] = 2
        if mutate_meta is not None:
            mutate_meta(meta)
        engine = ck.session.live()
        if names is not None:
            refs = [(names(r[0]),) + tuple(r[1:]) for r in ck.session.registered]
            engine.register(refs)
        engine.checkpoint(2, json.dumps(meta))
        ck.wait()
    return good


def restore_into_fresh(d, step=None):
    model, opt = make(seed=7)
    holder = Holder()
    holder.data = {"lr": 9.0}
    train(model, opt, 1)
    before = snapshot(model, opt, holder)
    ck = nonstop.Checkpointer(d, {"model": model, "optim": opt, "sched": holder},
                              every=1000, on_preempt=False)
    try:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            got = ck.restore(step)
        return got, snapshot(model, opt, holder), before, [str(x.message) for x in w]
    finally:
        ck.close()


def one_line(e):
    assert "\n" not in str(e), str(e)


# ------------------------------------------------------------ fixed lists

def test_dtype_tags_are_decoded_from_a_fixed_list_only():
    assert _state.unflatten({"__dtype__": "float32"}, {}) is torch.float32
    assert _state.unflatten({"__device__": "cuda:1"}, {}) == torch.device("cuda:1")
    for bad in ({"__dtype__": "os"}, {"__dtype__": "load"}, {"__dtype__": "__builtins__"},
                {"__dtype__": 3}, {"__device__": "cpu;rm"}, {"__device__": ["cpu"]},
                {"__npscalar__": ["O", 1]}, {"__float__": "zz"}, {"__tensor__": "nope"},
                {"__tuple__": 5}, {"__dict__": [[{"__tuple__": [[1]]}, 2]]}):
        with pytest.raises(CorruptCheckpointError) as e:
            _state.unflatten(bad, {})
        one_line(e.value)


def test_the_metadata_document_is_checked_before_it_is_parsed(tmp_path):
    """_state.loads: C++ (check_meta_json) refuses a document nested too
    deep, not UTF-8, or not strict JSON with one line before json.loads
    sees it; what dumps writes reads back. A real checkpoint whose metadata
    nests too deep is damaged: restore() falls back to the older one."""
    tree = {"a": [1, 2.5, "\u00e9", None, True, 10 ** 80, -0.0], "b": {"c": [[]]}}
    assert _state.loads(_state.dumps(tree)) == tree
    assert _state.loads(_state.dumps(tree).encode()) == tree
    for bad, why in ((b"[" * 100000, "nested too deep"), (b'"\xff"', "not valid UTF-8"),
                     ("{'a': 1}", "not valid JSON"), ("[NaN]", "not valid JSON"),
                     ("[1]]", "trailing bytes"), ("[" * 201 + "]" * 201, "nested too deep")):
        with pytest.raises(CorruptCheckpointError, match=why) as e:
            _state.loads(bad)
        one_line(e.value)
    d = str(tmp_path / "ck")

    def hostile(meta):
        deep: list = []
        for _ in range(300):
            deep = [deep]
        meta["junk"] = deep

    good = write_good_then_hostile(d, hostile)
    with pytest.raises(CorruptCheckpointError, match="nested too deep") as e:
        nonstop.load(d, step=2).meta
    one_line(e.value)
    got, after, _, warned = restore_into_fresh(d)
    assert got == 1, "the newest checkpoint is bad: restore falls back to step 1"
    assert any("step 2" in w for w in warned), warned
    same(after, good)


def test_a_dtype_tag_naming_a_torch_attribute_never_reaches_the_state(tmp_path):
    d = str(tmp_path / "ck")

    def hostile(meta):
        meta["state"]["sched"]["lr"] = {"__dtype__": "os"}

    good = write_good_then_hostile(d, hostile)
    with pytest.raises(CorruptCheckpointError) as e:
        nonstop.load(d, step=2).state
    one_line(e.value)
    got, after, _, warned = restore_into_fresh(d)
    assert got == 1, "the newest checkpoint is bad: restore falls back to step 1"
    assert any("step 2" in w for w in warned), warned
    same(after, good)


# ---------------------------------------------- restore validates first

@pytest.mark.parametrize("rng", [
    {"torch": "00"},                                   # too short for torch's generator
    {"numpy": ["MT19937", [1, 2, 3], 0, 0, 0.0]},      # 3 keys instead of 624
    {"random": {"t": [3, {"t": [1, 2]}, None]}},       # a short Mersenne Twister state
    {"numpy": 7},
    "not a dict",
])
def test_a_bad_rng_record_changes_nothing_and_falls_back(tmp_path, rng):
    d = str(tmp_path / "ck")

    def hostile(meta):
        if isinstance(rng, dict):
            meta["rng"].update(rng)
        else:
            meta["rng"] = rng

    good = write_good_then_hostile(d, hostile)
    # Asked for explicitly: one line, and nothing changed.
    with pytest.raises(CorruptCheckpointError) as e:
        restore_into_fresh(d, step=2)
    one_line(e.value)
    model, opt = make(seed=7)
    holder = Holder()
    train(model, opt, 1)
    before = snapshot(model, opt, holder)
    with nonstop.Checkpointer(d, {"model": model, "optim": opt, "sched": holder},
                              every=1000, on_preempt=False) as ck:
        with pytest.raises(CorruptCheckpointError):
            ck.restore(2)
    same(snapshot(model, opt, holder), before)
    # The newest: restore falls back to the older good one.
    got, after, _, warned = restore_into_fresh(d)
    assert got == 1
    same(after, good)


def test_a_non_utf8_tensor_name_falls_back(tmp_path):
    d = str(tmp_path / "ck")
    try:
        good = write_good_then_hostile(
            d, names=lambda n: n.encode() + b"\xff" if n.endswith("weight") else n)
    except CheckpointMismatchError as e:
        # The engine refuses to write such a name at all (one line); the
        # store's own tests cover reading one from a crafted file.
        one_line(e)
        assert "UTF-8" in str(e)
        got, _, _, _ = restore_into_fresh(d)
        assert got == 1
        return
    loaded = nonstop.load(d)  # the newest readable
    assert loaded.step == 1
    got, after, _, warned = restore_into_fresh(d)
    assert got == 1
    same(after, good)
    with pytest.raises(CheckpointError) as e:
        restore_into_fresh(d, step=2)
    one_line(e.value)


def test_a_dangling_tensor_reference_falls_back(tmp_path):
    d = str(tmp_path / "ck")
    good = write_good_then_hostile(d, lambda meta: meta["state"]["model"].update(
        weight={"__tensor__": "missing/name"}))
    got, after, _, _ = restore_into_fresh(d)
    assert got == 1
    same(after, good)


@pytest.mark.parametrize("key, value, why", [
    ("model", [1, 2], "state 'model' is a list, not a state dict"),
    ("sched", {"__tuple__": []}, "state 'sched' is a tuple, not a state dict"),
    ("optim", {"state": {}, "param_groups": [{"lr": 1}]}, "'optim' is not an optimizer state"),
    ("optim", {"state": [], "param_groups": []}, "'optim' is not an optimizer state"),
])
def test_a_value_not_of_its_objects_kind_falls_back(tmp_path, key, value, why):
    """C++ CheckSavedState: a value load_state_dict would fail on only halfway
    through is a corrupt checkpoint, found before anything changes: asked
    for, one line naming the key; the newest, restore falls back to the older."""
    d = str(tmp_path / "ck")
    good = write_good_then_hostile(d, lambda meta: meta["state"].update({key: value}))
    with pytest.raises(CorruptCheckpointError, match=why) as e:
        restore_into_fresh(d, step=2)
    one_line(e.value)
    got, after, _, _ = restore_into_fresh(d)
    assert got == 1
    same(after, good)


def test_optimizer_that_does_not_fit_leaves_the_model_untouched(tmp_path):
    d = str(tmp_path / "ck")
    model, opt = make()
    train(model, opt, 2)
    with nonstop.Checkpointer(d, {"model": model, "optim": opt}, every=1000,
                              on_preempt=False) as ck:
        ck.save(1)
    model2, _ = make(seed=3)
    opt2 = torch.optim.AdamW([model2.weight], lr=0.1)  # one parameter, not two
    train(model2, opt2, 1)
    before = snapshot(model2, opt2)
    with nonstop.Checkpointer(d, {"model": model2, "optim": opt2}, every=1000,
                              on_preempt=False) as ck:
        with pytest.raises(CheckpointMismatchError) as e:
            ck.restore()
    one_line(e.value)
    same(snapshot(model2, opt2), before)



# ------------------------------------------------------------------ export

def test_export_never_follows_a_link_planted_at_its_temp_name(tmp_path):
    import os
    d = str(tmp_path / "ck")
    write_good_then_hostile(d)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    out = tmp_path / "model.safetensors"
    os.symlink(victim, str(out) + ".tmp")
    got = nonstop.export(d, str(out))
    assert victim.read_bytes() == b"precious"
    assert not os.path.islink(out) and not os.path.lexists(str(out) + ".tmp")
    raw = out.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    assert header["__metadata__"]["nonstop.step"] == str(got["step"]) == "2"
    assert "model/weight" in header


def test_export_errors_name_the_file_asked_for(tmp_path):
    d = str(tmp_path / "ck")
    write_good_then_hostile(d)
    out = tmp_path / "no-such-dir" / "model.safetensors"
    with pytest.raises(CheckpointError) as e:
        nonstop.export(d, str(out))
    one_line(e.value)
    assert str(out) in str(e.value) and ".tmp" not in str(e.value), str(e.value)


def test_dcp_gather_refuses_pieces_that_do_not_make_their_tensor(tmp_path):
    """The DCP export reassembles each global tensor from the ranks' pieces
    where C++ (dist_lay_out_shared) places them: metadata naming a shape
    the pieces leave a gap in (exported as zeros before) or one of 2^80
    elements (a raw torch error before) is one line, nothing allocated."""
    from nonstop import _dcp
    for shape, why in (([4, 16], "hold 128 of its 256 bytes"), ([1 << 40, 1 << 40], "range")):
        d = str(tmp_path / f"ck{shape[1]}")

        def hostile(meta):
            meta.setdefault("dist", {})["shared"] = {"model/weight": [shape, "float32"]}

        write_good_then_hostile(d, hostile)
        assert _dcp.gather(d, step=1)[0] == 1
        with pytest.raises(CorruptCheckpointError, match=why) as e:
            _dcp.gather(d, step=2)
        one_line(e.value)


def test_dcp_gather_decodes_dtypes_from_the_fixed_list(tmp_path):
    """Issue 24: _dcp built tensors with getattr(torch, name) from the
    checkpoint's metadata; a name outside the fixed list is a corrupt
    checkpoint, never an attribute lookup in torch (C++ DcpGatherLayout
    decodes it, before anything is allocated)."""
    from nonstop import _dcp
    for i, bad in enumerate(("Tensor", "nn", "__class__", "save", 7, None)):
        d = str(tmp_path / f"ck{i}")

        def hostile(meta):
            meta.setdefault("dist", {})["shared"] = {"model/weight": [[4, 4], bad]}

        write_good_then_hostile(d, hostile)
        assert _dcp.gather(d, step=1)[0] == 1
        with pytest.raises(CorruptCheckpointError, match="names dtype") as e:
            _dcp.gather(d, step=2)
        one_line(e.value)
