"""The native pointer pass (weightbus.packing.native.data_ptrs, packing/pointers.cpp): the
same pointers as ``Tensor.data_ptr`` for every kind of tensor a source follows, the same
errors, and the Python pass where the extension is off."""

import numpy as np
import pytest
import torch

from weightbus.packing import native


@pytest.fixture(scope="module")
def built():
    lib = native.pointer_library(wait=True)
    if lib is None:
        pytest.skip("no C++ compiler or torch headers here: the Python pass is used")
    return lib


def _tensors(n: int) -> list[torch.Tensor]:
    base = torch.arange(4096, dtype=torch.float32)
    out: list[torch.Tensor] = []
    for i in range(n):
        kind = i % 6
        if kind == 0:
            out.append(torch.nn.Parameter(torch.randn(3)))
        elif kind == 1:
            out.append(base[i % 97:])  # a view at an offset
        elif kind == 2:
            out.append(base.view(64, 64).t())  # not contiguous
        elif kind == 3:
            out.append(torch.empty(0))  # no bytes
        elif kind == 4:
            out.append(torch.zeros((), dtype=torch.int64))
        else:
            out.append(base.to(torch.bfloat16)[i % 31::3])
    return out


def test_the_pointers_are_data_ptr_s(built):
    ts = _tensors(3 * native.NATIVE_POINTERS_MIN)
    got = native.data_ptrs(ts)
    assert got.dtype == np.int64
    assert got.tolist() == [t.data_ptr() for t in ts]
    assert native.data_ptrs(tuple(ts)).tolist() == got.tolist()


@pytest.mark.parametrize("extension", [True, False])
def test_same_items_is_identity_in_order(built, extension, monkeypatch):
    """What a copy table asks before it copies from sources it tabled: the very same
    objects, in the same order (an equal tensor elsewhere is not the same)."""
    if not extension:
        monkeypatch.setattr(native._extension, "module", None)
    ts = _tensors(2 * native.NATIVE_POINTERS_MIN)
    assert native.same_items(ts, list(ts)) and native.same_items(tuple(ts), ts)
    other = list(ts)
    other[777] = ts[777].clone()
    assert not native.same_items(ts, other)
    assert not native.same_items(ts, ts[:-1]) and not native.same_items(ts[:-1], ts)
    other = list(ts)
    other[3], other[4] = other[4], other[3]
    assert not native.same_items(ts, other)


def test_layouts_are_the_address_and_what_else_a_view_depends_on(built, dtensors, monkeypatch):
    """``native.layouts``: each tensor's address (as ``data_ptrs``) and a hash of its sizes,
    strides, dtype and device, alike for the same metadata, different where any differs at
    the same address; None for short lists or with the extension off (the caller's own pass)."""
    ts = _tensors(2 * native.NATIVE_POINTERS_MIN) + dtensors
    got = native.layouts(ts)
    assert got.shape == (len(ts), 2) and got.dtype == np.int64
    assert got[:, 0].tolist() == native.data_ptrs(ts).tolist()
    assert np.array_equal(native.layouts(list(ts)), got)
    base = torch.arange(4096, dtype=torch.float32)
    same_address = [base.view(64, 64), base.view(64, 64).t(), base.view(32, 128), base.view(torch.int32),
                    base.view(4096, 1), base[:4095], base.view(64, 64)]
    again = native.layouts(ts[:len(ts) - len(same_address)] + same_address)[-len(same_address):]
    assert len(set(again[:, 0].tolist())) == 1
    assert len(set(again[:-1, 1].tolist())) == len(same_address) - 1  # every layout its own hash
    assert again[0, 1] == again[-1, 1]  # (and the same layout the same: another object)
    moved = list(ts)
    moved[5].data = torch.randn(7)
    assert (native.layouts(moved) != got).any(1).nonzero()[0].tolist() == [5]
    assert native.layouts(ts[:10]) is None  # (short: the caller's pass)
    monkeypatch.setenv("WEIGHTBUS_NATIVE_POINTERS", "0")
    assert native.layouts(ts) is None


def test_memory_given_anew_is_seen(built):
    ts = _tensors(native.NATIVE_POINTERS_MIN)
    before = native.data_ptrs(ts)
    ts[5].data = torch.randn(7)  # what a source must follow: .data = new memory
    after = native.data_ptrs(ts)
    assert (before != after).nonzero()[0].tolist() == [5]
    assert after[5] == ts[5].data_ptr()


def test_a_non_tensor_is_a_type_error_naming_its_place(built):
    ts: list = _tensors(native.NATIVE_POINTERS_MIN)
    ts[700] = None
    with pytest.raises(TypeError, match="item 700 is a NoneType"):
        native.data_ptrs(ts)


class _Wrapper(torch.Tensor):
    """A tensor with no bytes of its own (as a DTensor is)."""

    @staticmethod
    def __new__(cls, shape):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=torch.float32)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(func)


@pytest.fixture
def dtensors():
    """Two DTensors on a one-rank gloo group: an FSDP2 source's parameters."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        yield [distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)]) for _ in range(2)]
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("switch", ["1", "0"])
def test_a_dtensor_s_pointer_is_its_shard_s_and_a_bare_wrapper_s_is_0(built, dtensors, monkeypatch, switch):
    monkeypatch.setenv("WEIGHTBUS_NATIVE_POINTERS", switch)
    for n in (4, 2 * native.NATIVE_POINTERS_MIN):  # (the Python pass, and the C++ one where on)
        ts = _tensors(n) + dtensors + [_Wrapper((4,))]
        got = native.data_ptrs(ts).tolist()
        assert got[:n] == [t.data_ptr() for t in ts[:n]]
        assert got[n:] == [d._local_tensor.data_ptr() for d in dtensors] + [0]
        assert got[n] != 0 and got[n] != got[n + 1]


def test_switched_off_it_is_python_s_pass(monkeypatch):
    monkeypatch.setenv("WEIGHTBUS_NATIVE_POINTERS", "0")
    assert native.pointer_library() is None
    ts = _tensors(native.NATIVE_POINTERS_MIN)
    assert native.data_ptrs(ts).tolist() == [t.data_ptr() for t in ts]


def test_without_a_compiler_it_warns_once_and_takes_python_s_pass(tmp_path):
    import os
    import subprocess
    import sys
    code = ("import torch, logging; logging.basicConfig()\n"
            "from weightbus.packing import native\n"
            "assert native.pointer_library(wait=True) is None\n"
            "ts = [torch.zeros(2) for _ in range(2000)]\n"
            "assert native.data_ptrs(ts).tolist() == [t.data_ptr() for t in ts]\n")
    env = {**os.environ, "CXX": str(tmp_path / "no-such-compiler"), "XDG_CACHE_HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("the pointer extension did not build") == 1, done.stderr
