"""What a review of the compiled runtime found about storage (CPU): an output folded to a constant handed
out as the same tensor every call, a cast that copies (`x.to(dtype, copy=True)`) taken for the identity, and
one tensor passed twice (or two overlapping views of one) cast into two copies. Each compiled model now leaves the caller's tensors, the
model's buffers and later calls as eager does."""

from __future__ import annotations

import warnings

import torch

import stof_cc


def _compiled(module: torch.nn.Module, args: tuple, dtype: torch.dtype = torch.float32):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return stof_cc.compile(module, args, dtype=dtype, tune=False)


class _Positions(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(x), torch.arange(x.shape[1]), torch.ones(4, 4).tril()  # the last two fold to constants


def test_an_output_folded_to_a_constant_is_a_new_tensor_every_call():
    """The caller advancing its position ids in place changed every later call's (eager: [0..4] each time)."""
    x = torch.randn(2, 5, 8)
    compiled = _compiled(_Positions().eval(), (x,))
    _, positions, mask = compiled(x)
    positions += 10
    mask.zero_()
    _, positions, mask = compiled(x)
    assert positions.tolist() == list(range(5)) and torch.equal(mask, torch.ones(4, 4).tril())


class _Copies(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("state", torch.zeros(4))

    def forward(self, x):
        return x.to(torch.float32, copy=True), self.state.to(torch.float32, copy=True)


def test_a_cast_that_copies_an_input_or_a_buffer_hands_out_a_copy():
    """Writing into the outputs overwrote the caller's x and the model's buffer (so every later call)."""
    module = _Copies().eval()
    x = torch.zeros(4)
    copy_of_x, copy_of_state = _compiled(module, (x,))(x)
    copy_of_x.fill_(7.0)
    copy_of_state.fill_(9.0)
    assert not x.any() and not module.state.any()


class _Accumulate(torch.nn.Module):
    def forward(self, a, b):
        a.add_(1)
        return b * 2


def test_one_tensor_passed_twice_and_cast_stays_one_tensor():
    """Cast to the compile dtype as two copies, the write into a did not reach b (eager: 2, compiled: 0)."""
    compiled = _compiled(_Accumulate().eval(), (torch.zeros(4), torch.zeros(4)), dtype=torch.float16)
    y = torch.zeros(4)
    out = compiled(y, y)
    assert out.tolist() == [2.0] * 4 and y.tolist() == [1.0] * 4


class _Doubled(torch.nn.Module):
    def forward(self, a, b):
        a.mul_(2)
        return b + 0


def test_overlapping_views_cast_stay_overlapping_and_apart_views_stay_apart():
    """y and y[:2] into a model writing into the first: eager's b sees the write (2, 2), the two casts did
    not (1, 1). Views whose bytes meet become views of one cast, laid out as given; apart ones are cast
    apart."""
    compiled = _compiled(_Doubled().eval(), (torch.ones(4), torch.ones(2)), dtype=torch.float16)
    y = torch.ones(4)
    assert compiled(y, y[:2]).tolist() == [2.0, 2.0] and y.tolist() == [2.0] * 4
    fused = torch.randn(2, 3, 8)
    interleaved = fused.unbind(1)
    cast = stof_cc.passes.cast_floating(interleaved, torch.float16)
    assert len({t.untyped_storage().data_ptr() for t in cast}) == 1
    assert all(t.stride() == u.stride() and torch.equal(t, u.half()) for t, u in zip(cast, interleaved, strict=True))
    apart = stof_cc.passes.cast_floating(fused.unbind(0), torch.float16)
    assert len({t.untyped_storage().data_ptr() for t in apart}) == 2
