"""stof_cc.attention rejects what it cannot run before touching a GPU (CPU)."""

from __future__ import annotations

import pytest
import torch

from stof_cc import AttentionInputError, attention


def test_attention_rejects_non_tensors_and_autograd_before_anything_else():
    with pytest.raises(AttentionInputError, match="q must be a torch.Tensor"):
        attention([1.0], None, None)
    q = torch.randn(1, 1, 16, 64, requires_grad=True)
    with pytest.raises(AttentionInputError, match="inference-only"):
        attention(q, q, q)


def test_problems_past_the_grid_limits_are_named():
    from stof_cc import explain_attention
    from stof_cc.templates.attention import AttentionProblem
    from stof_cc.tune.attention import candidates

    long = AttentionProblem(1, 1, 65536 * 64, 65536 * 64, 64, torch.float16)  # too many rows for m64 and below
    assert candidates(long) and all(p["block_m"] > 64 for _, p in candidates(long))
    with pytest.raises(AttentionInputError, match="batch 70000 exceeds 65535"):
        explain_attention(70000, 1, 16, 16, 64)  # batch is the grid's y
    with pytest.raises(AttentionInputError, match="no attention kernel runs"):
        explain_attention(1, 1, 65536 * 192 + 1, 16, 64)


@pytest.mark.parametrize("bad", ["128", 128.0, True, None])
def test_explain_attention_names_a_size_that_is_not_an_int(bad):
    from stof_cc import explain_attention

    with pytest.raises(AttentionInputError, match=r"seq_q must be an int, got"):
        explain_attention(1, 1, bad, 128, 64)
    with pytest.raises(AttentionInputError, match="dtype 'fp16' is not supported"):
        explain_attention(1, 1, 128, 128, 64, dtype="fp16")


def test_key_padding_and_bias_are_checked_and_converted_on_the_cpu():
    """What the kernels read: per batch element the attended range and whether padding lies
    inside it; a bias expanded to the scores' shape (stride 0 where it broadcasts)."""
    from stof_cc.backends.attention_launch import bias_view, key_padding_on_device

    padding = torch.tensor([[1, 1, 1, 0, 0], [0, 1, 1, 1, 1], [1, 0, 1, 1, 0], [0, 0, 0, 0, 0]])
    converted = key_padding_on_device(padding)
    assert converted.ranges.tolist() == [[0, 3, 0], [1, 5, 0], [0, 4, 1], [5, 0, 0]]
    assert converted.valid.dtype == torch.uint8 and converted.valid.tolist() == padding.tolist()
    with pytest.raises(AttentionInputError, match=r"key_padding must be \[batch, keys\]"):
        key_padding_on_device(torch.ones(5))
    q = torch.randn(2, 12, 128, 64, dtype=torch.float16)
    bias = bias_view(torch.randn(1, 12, 128, 128), q, 128)
    assert bias.shape == (2, 12, 128, 128) and bias.stride(0) == 0 and bias.dtype == torch.float16
    with pytest.raises(AttentionInputError, match=r"bias of shape \(3, 64, 64\) does not broadcast to \[2, 12, 128, 128\]"):
        bias_view(torch.randn(3, 64, 64), q, 128)


def test_a_bias_in_another_dtype_saturates_and_a_bias_needing_grad_a_list_of_padding_are_refused():
    """An fp32 bias beyond fp16's range saturates at its largest (it became +-inf: NaN, or a row
    counted as hidden), -inf stays -inf; a bias that requires grad is refused as q, k and v are;
    key padding that is not a tensor is named (found by review)."""
    from stof_cc.backends.attention_launch import bias_view

    q = torch.randn(1, 1, 4, 64, dtype=torch.float16)
    wide = torch.tensor([[7e4, -1e9, float("-inf"), 3.0]]).expand(4, 4)
    assert bias_view(wide, q, 4)[0, 0, 0].tolist() == [65504.0, -65504.0, float("-inf"), 3.0]
    with pytest.raises(AttentionInputError, match="inference-only"):
        attention(q, q, q, bias=torch.zeros(4, 4, requires_grad=True))
    with pytest.raises(AttentionInputError, match="key_padding must be a .* got list"):
        attention(q, q, q, key_padding=[[1, 1, 1, 0]])


def test_a_strided_split_is_taken_only_where_it_applies_and_pays():
    """A dilated window splits into d sliding windows where the cost model prices that lower
    (S = 8192 on the MHA grid); not where S is not a multiple of d, nor where B * d batch slots
    would pass the grid's limit, nor beside a bias (the direct kernel still runs those)."""
    from stof_cc import masks
    from stof_cc.templates.attention import AttentionProblem
    from stof_cc.tune.attention import strided_split

    mask = masks.dilated(512, 4)
    assert strided_split(AttentionProblem(1, 12, 8192, 8192, 64, torch.float16), mask) == mask.strided_split()
    assert strided_split(AttentionProblem(1, 12, 8190, 8190, 64, torch.float16), mask) is None
    wide = AttentionProblem(20000, 1, 256, 256, 64, torch.float16)  # 80000 slots
    assert strided_split(wide, masks.dilated(8, 4)) is None
    assert strided_split(AttentionProblem(1, 12, 8192, 8192, 64, torch.float16), masks.causal()) is None
    biased = AttentionProblem(1, 12, 8192, 8192, 64, torch.float16, bias=True)  # the runtime never splits a bias
    assert strided_split(biased, mask) is None


def test_cpu_tensors_are_sent_to_the_reference_for_any_mask_form():
    """The error named ``mask.to_dense(S_q, S_k)``, which a bool tensor or None has not (found by review)."""
    q = torch.randn(1, 2, 16, 64, dtype=torch.float16)
    with pytest.raises(AttentionInputError, match=r"q is on cpu; the kernels run on CUDA devices \(the CPU reference: "
                                                  r"stof_cc.ir.reference.masked_attention\(q, k, v, dense\), dense a "
                                                  r"bool tensor, mask.to_dense\(S_q, S_k\) for a stof-cc mask, or None\)"):
        attention(q, q, q, None)


def test_documents_described_anew_every_call_point_to_cu_seqlens_once(monkeypatch):
    """masks.document(lengths) built per call is a new description, planned on the host each time: the eighth
    such plan for one kind and layout warns, once, that cu_seqlens reads the documents on the device."""
    import warnings

    from stof_cc import masks
    from stof_cc.runtime import attention as runtime

    monkeypatch.setattr(runtime, "_plan", lambda *args, **kwargs: object())
    monkeypatch.setattr(runtime, "_documents_planned", type(runtime._documents_planned)())
    q = torch.randn(1, 2, 256, 64)
    kept = []  # plans are held per live description

    def plan_each(make, count, bias=False, windows=False):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for n in range(count):
                kept.append(make(n))
                runtime._planned(q, q, q, kept[-1], None, None, bias, windows=windows)
                runtime._planned(q, q, q, kept[-1], None, None, bias, windows=windows)  # its plan again: no count
        return [str(w.message) for w in caught]

    said = plan_each(lambda n: masks.document([100 + n, 156 - n]), runtime.PER_CALL_DOCUMENTS + 3)
    assert len(said) == 1 and "cu_seqlens=" in said[0] and "document" in said[0]
    said = plan_each(lambda n: masks.causal() & masks.document([64 + n, 192 - n]), runtime.PER_CALL_DOCUMENTS)
    assert len(said) == 1  # under a causal mask too: its own kind
    said = plan_each(lambda n: masks.document(segment_ids=(torch.arange(256) >= 60 + n).long().view(1, -1)),
                     runtime.PER_CALL_DOCUMENTS)
    assert len(said) == 1  # segment ids (transformers' packed batches) too
    assert plan_each(lambda n: masks.document([50 + n, 206 - n]), 12, bias=True) == []  # cu_seqlens takes no bias
    assert plan_each(lambda n: masks.document([40 + n, 216 - n]), 12, windows=True) == []  # on the device already
    assert plan_each(lambda n: masks.sliding_window(16 + n), 12) == []  # not documents


def test_an_out_that_overlaps_itself_or_the_inputs_is_refused_before_the_launch(monkeypatch):
    """out= expanded over the batch (every CTA writing one row), or lying where q, k or v lie (a tile
    reading q rows another tile already overwrote): refused, naming out (a review found both taken)."""
    from stof_cc.backends.attention_launch import LaunchPlan

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # CPU torch has no CUDA
    batch, heads, seq, dim = 2, 3, 16, 64
    q, k, v = (torch.randn(batch, heads, seq, dim, dtype=torch.float16) for _ in range(3))
    plan = LaunchPlan(kernel=None, grid=(1, 1, 1), threads=128, shared_bytes=0, shape=tuple(q.shape), dtype=q.dtype,
                      device=q.device, copy_inputs=False, mask_args=(), size_args=(seq, seq), end_args=(),
                      mask_tensors=(), bias_to_raw=1.0, reads_bias=False, reads_windows=False)
    expanded = torch.empty(1, heads, seq, dim, dtype=q.dtype).expand(batch, heads, seq, dim)
    packed = torch.empty(batch, seq, 4, heads, dim, dtype=q.dtype)  # q, k, v and out of one buffer, interleaved
    for out, inputs in ((expanded, (q, k, v)), (q, (q, k, v)), (v[:, :, :], (q, k, v)),
                        (packed[:, :, 3].transpose(1, 2), tuple(packed[:, :, i].transpose(1, 2) for i in range(3)))):
        with pytest.raises(AttentionInputError, match="out must not overlap"):
            plan.launch(*inputs, out=out)
