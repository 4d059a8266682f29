"""The C++ restore path (include/nonstop/restore.h) from Python: restore()
reads straight into the live tensors, falls back to an older checkpoint on a
checksum failure mid-read (into the same tensors), and says when no
checkpoint is left that the state was partly overwritten; stats() reports
the restore."""
import pytest
import torch
from conftest import needs_engine

import nonstop

pytestmark = needs_engine


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.big = torch.nn.Linear(2048, 2048)       # 16 MiB: read straight into it
        self.blocks = torch.nn.ModuleList(torch.nn.LayerNorm(16) for _ in range(40))
        self.head = torch.nn.Linear(64, 8)


def make(seed):
    torch.manual_seed(seed)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    return model, opt


def train_step(model, opt):
    loss = sum(p.float().pow(2).sum() for p in model.parameters())
    opt.zero_grad()
    loss.backward()
    opt.step()


def save_two(d):
    """Two checkpoints (steps 0 and 1) of the same state; returns each one's values."""
    model, opt = make(0)
    values = []
    with nonstop.Checkpointer(d, {"model": model, "optim": opt}, every=1) as ck:
        for s in range(2):
            train_step(model, opt)
            ck.step(s)
            ck.wait()
            values.append({k: v.clone() for k, v in model.state_dict().items()})
    return values


def flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def last_tensor_offset(loaded):
    """File offset of a byte in the middle of the tensor stored last."""
    t = max((t for t in loaded.info["tensors"] if t["nbytes"]), key=lambda t: t["data_offset"])
    return loaded.info["data_offset"] + t["data_offset"] + t["nbytes"] // 2


def test_restore_reads_into_the_live_tensors_and_reports_it(tmp_path, monkeypatch):
    # Buffered reads (O_DIRECT reads of a cold file land through an aligned
    # buffer when a tensor's address does not suit O_DIRECT; restore_test.cc).
    monkeypatch.setenv("NONSTOP_RESTORE_DIRECT", "0")
    d = str(tmp_path / "ck")
    values = save_two(d)
    model, opt = make(1)
    ptrs = {k: v.data_ptr() for k, v in model.state_dict().items()}
    with nonstop.Checkpointer(d, {"model": model, "optim": opt}) as ck:
        assert ck.restore() == 1
        st = ck.stats()
    for k, v in model.state_dict().items():
        assert torch.equal(v, values[1][k]), k
        assert v.data_ptr() == ptrs[k], k  # the same memory, written in place
    assert st["restore_step"] == 1 and st["restore_attempts"] == 1
    assert st["restore_bytes"] >= 2048 * 2048 * 4 and st["restore_s"] > 0
    assert st["restore_GBps"] > 0 and st["restore_total_s"] >= st["restore_s"]
    # load_state_dict's part (the H2D copies for CUDA tensors), after the read
    assert 0 <= st["restore_apply_s"] <= st["restore_total_s"] - st["restore_s"]
    # The 16 MiB weight went from the file into the model's own tensor.
    assert st["restore_direct_bytes"] >= 8 << 20
    # Host tensors: nothing went through host-to-device copies.
    assert st["restore_h2d_bytes"] == 0 and st["restore_h2d_wait_s"] == 0
    # The optimizer state came back too, and the next step works.
    assert len(opt.state) == len(list(model.parameters()))
    train_step(model, opt)


def test_checksum_failure_mid_read_falls_back_into_the_same_tensors(tmp_path, monkeypatch):
    monkeypatch.setenv("NONSTOP_RESTORE_THREADS", "1")  # in file order: the newest is partly written
    d = str(tmp_path / "ck")
    values = save_two(d)
    newest = nonstop.load(d)
    assert newest.step == 1
    flip(newest.path, last_tensor_offset(newest))
    model, opt = make(2)
    ptrs = {k: v.data_ptr() for k, v in model.state_dict().items()}
    with nonstop.Checkpointer(d, {"model": model, "optim": opt}) as ck:
        with pytest.warns(UserWarning, match="falling back"):
            assert ck.restore() == 0
        st = ck.stats()
    assert st["restore_attempts"] == 2 and st["restore_step"] == 0
    for k, v in model.state_dict().items():
        assert torch.equal(v, values[0][k]), k
        assert v.data_ptr() == ptrs[k], k


def test_every_checkpoint_failing_mid_read_says_the_state_was_overwritten(tmp_path):
    d = str(tmp_path / "ck")
    save_two(d)
    for step in (0, 1):
        c = nonstop.load(d, step=step)
        flip(c.path, last_tensor_offset(c))
    model, opt = make(3)
    with nonstop.Checkpointer(d, {"model": model, "optim": opt}) as ck:
        with pytest.raises(nonstop.CorruptCheckpointError, match="partly overwritten") as e:
            with pytest.warns(UserWarning):
                ck.restore()
    assert "\n" not in str(e.value)


def test_tied_weights_get_one_destination_each(tmp_path):
    d = str(tmp_path / "ck")
    torch.manual_seed(0)
    emb = torch.nn.Embedding(100, 32)
    head = torch.nn.Linear(32, 100, bias=False)
    head.weight = emb.weight
    model = torch.nn.Sequential(emb, head)
    with nonstop.Checkpointer(d, {"model": model}, every=1) as ck:
        ck.step(0)
        ck.wait()
    want = emb.weight.detach().clone()
    torch.manual_seed(1)
    emb2 = torch.nn.Embedding(100, 32)
    head2 = torch.nn.Linear(32, 100, bias=False)
    head2.weight = emb2.weight
    model2 = torch.nn.Sequential(emb2, head2)
    with nonstop.Checkpointer(d, {"model": model2}) as ck:
        assert ck.restore() == 0
    assert head2.weight is emb2.weight and torch.equal(emb2.weight, want)


def test_load_without_a_model(tmp_path):
    d = str(tmp_path / "ck")
    values = save_two(d)
    got = nonstop.load(d, step=0)
    for k, v in values[0].items():
        assert torch.equal(got.tensors[f"model/{k}"], v), k
    arr = nonstop.load(d, as_numpy=True)
    assert (arr.tensors["model/big.weight"] == values[1]["big.weight"].numpy()).all()


def test_load_hooks_still_run_when_tensors_are_read_in_place(tmp_path):
    """restore() skips load_state_dict only for plain modules whose every
    tensor was read in place; a module with a load hook still gets it."""
    import nonstop
    d = str(tmp_path / "job")
    ref = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    with nonstop.Checkpointer(d, {"model": ref}, every=1, tier="disk") as ck:
        ck.save(4)
        ck.wait()
    plain = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    hooked = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    calls = []
    hooked[1].register_load_state_dict_post_hook(lambda m, keys: calls.append(m))
    for model in (plain, hooked):
        with nonstop.Checkpointer(d, {"model": model}, every=1, tier="disk") as ck:
            assert ck.restore() == 4
        for a, b in zip(model.state_dict().values(), ref.state_dict().values()):
            assert torch.equal(a, b)
    assert calls == [hooked[1]]


def test_a_cuda_destination_without_a_usable_device_is_refused_before_any_read(tmp_path):
    # (pointer, nbytes, device, stream): a destination in CUDA memory, written
    # only through the CUDA copy engine (docs/CUDA.md "Restore into CUDA
    # tensors"). Here no device is usable: one line saying so, and the
    # destinations are untouched (the refusal comes before the read).
    d = str(tmp_path / "ck")
    save_two(d)
    r = nonstop._core.Reader(d, rank=0, verify_data=False)
    idx = next(i for i, c in enumerate(r.checkpoints) if c["committed"])
    specs = r.checkpoints[idx]["tensors"]
    bufs = [torch.full((max(1, s["nbytes"]),), 7, dtype=torch.uint8) for s in specs]
    dests = [(b.data_ptr(), s["nbytes"], 0, 0) for b, s in zip(bufs, specs)]
    with pytest.raises(nonstop.CheckpointError) as e:
        r.read_into(idx, dests)
    msg = str(e.value)
    assert "\n" not in msg and "CUDA memory" in msg and "cannot copy into it" in msg, msg
    assert all(bool((b == 7).all()) for b in bufs)
    # A malformed destination is refused too.
    with pytest.raises(nonstop.CheckpointError, match="pointer, nbytes"):
        r.read_into(idx, [(0, 0, 0)] * len(specs))


def test_a_plain_module_is_read_in_place_and_load_state_dict_is_skipped(tmp_path, load_state_dict_calls):
    """The checked checkpoint's tensors are read straight into the live
    module's own tensors, so applying it is nothing: load_state_dict (which
    would copy each tensor onto itself) is not called for a plain module."""
    d = str(tmp_path / "ck")
    values = save_two(d)
    calls = load_state_dict_calls
    model, opt = make(1)
    with nonstop.Checkpointer(d, {"model": model, "optim": opt}) as ck:
        assert ck.restore() == 1
    assert calls == []
    assert all(torch.equal(v, values[1][k]) for k, v in model.state_dict().items())
