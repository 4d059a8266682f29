"""State trees <-> named tensors + JSON: exact round trips, no pickle."""
import math
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nonstop import _objects, _rng, _state


def roundtrip(obj):
    tensors = {}
    tree = _state.flatten(obj, "s", tensors)
    return _state.unflatten(_state.loads(_state.dumps(tree)), tensors), tensors


def same(a, b):
    if isinstance(a, float) and isinstance(b, float):
        return math.copysign(1, a) == math.copysign(1, b) and (a == b or (a != a and b != b))
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return a == b


plain = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda kids: st.lists(kids, max_size=4) | st.tuples(kids, kids)
    | st.dictionaries(st.text(max_size=5), kids, max_size=4)
    | st.dictionaries(st.integers() | st.tuples(st.integers()), kids, max_size=4),
    max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(plain)
def test_plain_data_round_trips_exactly(obj):
    back, tensors = roundtrip(obj)
    assert not tensors
    assert same(obj, back)


def test_floats_round_trip_bitwise():
    for x in [0.1, -0.0, 1e-310, 5e-324, 1.7976931348623157e308, math.pi, float("inf"),
              float("-inf")]:
        back, _ = roundtrip(x)
        assert np.float64(back).tobytes() == np.float64(x).tobytes()
    back, _ = roundtrip(float("nan"))
    assert math.isnan(back)


def test_reserved_keys_and_numpy_and_torch_types():
    obj = {"__tensor__": 1, "dt": torch.bfloat16, "dev": torch.device("cpu"),
           "np": np.float32(1.5), "i": np.int64(7), "arr": np.arange(5, dtype=np.int16)}
    back, tensors = roundtrip(obj)
    assert back["__tensor__"] == 1 and back["dt"] is torch.bfloat16
    assert back["dev"] == torch.device("cpu")
    assert type(back["np"]) is np.float32 and back["np"] == np.float32(1.5)
    assert type(back["i"]) is np.int64
    assert back["arr"].dtype == np.int16 and list(back["arr"]) == list(range(5))


def test_tensors_are_referenced_not_copied_and_tied_ones_stored_once():
    w = torch.randn(4, 3)
    obj = {"a": w, "b": w, "c": [w[1:]], "step": torch.tensor(3.0)}
    tensors = {}
    tree = _state.flatten(obj, "m", tensors)
    assert list(tensors) == ["m/a", "m/c/0", "m/step"]
    assert tensors["m/a"].data_ptr() == w.data_ptr()
    assert tree["b"] == {"__tensor__": "m/a"}


def test_optimizer_state_dict_round_trips():
    m = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(m.parameters(), lr=0.1, betas=(0.8, 0.9))
    m(torch.randn(4, 3)).sum().backward()
    opt.step()
    back, _ = roundtrip(opt.state_dict())
    assert back["param_groups"][0]["betas"] == (0.8, 0.9)
    assert set(back["state"]) == {0, 1}
    assert torch.equal(back["state"][0]["exp_avg"], opt.state[m.weight]["exp_avg"])


def test_unsupported_value_names_its_place():
    with pytest.raises(TypeError, match=r"state\['x'\]\[0\]: object is neither"):
        _state.flatten({"x": [object()]}, "s", {}, "state")


def test_rng_states_round_trip():
    state = _state.loads(_state.dumps(_rng.capture()))
    a = (random.random(), np.random.rand(), torch.rand(3))
    random.random(), np.random.rand(), torch.rand(7)
    _rng.restore(state)
    b = (random.random(), np.random.rand(), torch.rand(3))
    assert a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2])


def test_flatten_state_indexes_tied_tensors_across_keys_once():
    """Issue 24: one walk over many top-level keys (_objects.flatten_state) stores a
    tensor shared between keys once, like per-key flatten calls did, and
    the same names."""
    shared = torch.arange(6.0)
    state = {f"k{i}": {"w": torch.full((2,), float(i)), "tied": shared} for i in range(50)}
    out: dict = {}
    tree = _objects.flatten_state(state, out)
    old: dict = {}
    old_tree = {k: _state.flatten(v, k, old, f"state[{k!r}]") for k, v in state.items()}
    assert tree == old_tree and list(out) == list(old)
    assert len(out) == 51 and all(tree[k]["tied"] == {"__tensor__": "k0/tied"} for k in state)
    back = _state.unflatten(tree, out)
    assert all(torch.equal(back[k]["w"], state[k]["w"]) for k in state)
