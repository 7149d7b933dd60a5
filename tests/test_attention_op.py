"""torch.ops.stof_cc.attention (runtime/attention_op.py): torch.library's own checks of the
operator (schema, fake kernel, dispatch), its values against the reference on the CPU (the
kernel it registers there), one graph under torch.compile(fullgraph=True); on the GPU, stof-cc's
kernels through the op, compiled, against the reference."""

from __future__ import annotations

import pytest
import torch

import stof_cc
from stof_cc.ir.reference import masked_attention
from stof_cc.masks import parse_spec

B, H, H_KV, S, D = 2, 4, 2, 96, 32


def _inputs(device: str = "cpu", dtype: torch.dtype = torch.float32):
    torch.manual_seed(0)
    q = torch.randn(B, H, S, D, device=device, dtype=dtype)
    k, v = (torch.randn(B, H_KV, S, D, device=device, dtype=dtype) for _ in range(2))
    padding = torch.ones(B, S, dtype=torch.bool, device=device)
    padding[1, S - 20:] = False
    return q, k, v, padding


def _want(q, k, v, spec, padding, scale=None):
    allowed = parse_spec(spec).to_dense(S, S).to(q.device) & padding[:, None, None, :]
    return masked_attention(q.float(), k.float(), v.float(), allowed, scale)


@pytest.mark.parametrize("spec", ["causal", "sliding:w=16,causal=1", "longformer:w=16,g=4"])
def test_the_op_passes_torch_library_checks_and_matches_the_reference(spec):
    q, k, v, padding = _inputs()
    torch.library.opcheck(torch.ops.stof_cc.attention.default, (q, k, v, spec, None, padding))
    got = torch.ops.stof_cc.attention(q, k, v, spec, 0.25, padding)
    torch.testing.assert_close(got, _want(q, k, v, spec, padding, 0.25))
    assert got.is_contiguous() and got.shape == q.shape


def test_no_mask_and_no_padding_is_plain_attention():
    q, k, v, _ = _inputs()
    got = stof_cc.attention_op(q, k, v, None, None, None)
    want = torch.nn.functional.scaled_dot_product_attention(q, *(t.repeat_interleave(2, 1) for t in (k, v)))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_torch_compile_traces_it_as_one_node():
    q, k, v, padding = _inputs()

    def block(q, k, v, padding):
        return torch.ops.stof_cc.attention(q * 2.0, k, v, "causal", None, padding) + 1.0

    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")  # a graph break would raise
    torch.testing.assert_close(compiled(q, k, v, padding), block(q, k, v, padding))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_on_the_gpu_the_op_runs_the_kernels_compiled_and_matches(dtype):
    q, k, v, padding = _inputs("cuda", dtype)

    def block(q, k, v, padding):
        return torch.ops.stof_cc.attention(q, k, v, "sliding:w=16,causal=1", None, padding)

    want = _want(q, k, v, "sliding:w=16,causal=1", padding)
    for run in (block, torch.compile(block, fullgraph=True)):
        got = run(q, k, v, padding)
        assert torch.linalg.norm(got.float() - want) / torch.linalg.norm(want) < 1e-2


def _same_document(cu_seqlens: list[int]) -> torch.Tensor:
    """[S, S]: query and key in one document of ``cu_seqlens`` (rows past its end see nothing)."""
    rows = torch.arange(S)
    document = torch.bucketize(rows, torch.tensor(cu_seqlens[1:]), right=True)
    inside = rows < cu_seqlens[-1]
    return (document[:, None] == document[None, :]) & inside[:, None] & inside[None, :]


def test_packed_documents_pass_torch_library_checks_and_compile_as_one_node():
    """cu_seqlens through the op: torch.library's checks, the reference's values (documents on top
    of the causal mask and the padding), and one graph under torch.compile."""
    q, k, v, padding = _inputs()
    cu_seqlens = torch.tensor([0, 30, 31, 70, 90], dtype=torch.int32)  # a one-row document; 6 rows of no document
    torch.library.opcheck(torch.ops.stof_cc.attention.default, (q, k, v, "causal", None, padding, cu_seqlens))
    got = torch.ops.stof_cc.attention(q, k, v, "causal", None, padding, cu_seqlens)
    allowed = parse_spec("causal").to_dense(S, S) & padding[:, None, None, :] & _same_document(cu_seqlens.tolist())
    torch.testing.assert_close(got, masked_attention(q, k, v, allowed))
    assert (got[:, :, 90:] == 0).all()

    def block(q, k, v, cu_seqlens):
        return torch.ops.stof_cc.attention(q, k, v, "causal", None, None, cu_seqlens) * 2.0

    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q, k, v, cu_seqlens), block(q, k, v, cu_seqlens))


@pytest.mark.gpu
def test_on_the_gpu_packed_documents_run_the_kernels_compiled_and_match():
    q, k, v, _ = _inputs("cuda", torch.bfloat16)
    cu_seqlens = torch.tensor([0, 30, 31, 70, 90], dtype=torch.int32, device="cuda")

    def block(q, k, v, cu_seqlens):
        return torch.ops.stof_cc.attention(q, k, v, "causal", None, None, cu_seqlens)

    allowed = (parse_spec("causal").to_dense(S, S) & _same_document(cu_seqlens.tolist())).cuda()
    want = masked_attention(q.float(), k.float(), v.float(), allowed)
    for run in (block, torch.compile(block, fullgraph=True)):
        got = run(q, k, v, cu_seqlens)
        assert torch.linalg.norm(got.float() - want) / torch.linalg.norm(want) < 1e-2


@pytest.mark.parametrize(("change", "match"), [
    (lambda q, k, v, p: (q, k[:, :, :, :16], v, p), "k and v must be"),  # head dims differ
    (lambda q, k, v, p: (q[:, :3], k, v, p), "dividing"),  # 3 query heads over 2 KV heads
    (lambda q, k, v, p: (q, k, v[:, :, :50], p), "k and v must be"),  # k and v lengths differ
    (lambda q, k, v, p: (q, k, v, p[:, :50]), "key_padding must be"),
    (lambda q, k, v, p: (q, k, v, p[:1]), "key_padding must be"),
    (lambda q, k, v, p: (q[0], k, v, p), "4-D"),
    (lambda q, k, v, p: (q, k.half(), v.half(), p), "one dtype"),
])
def test_on_the_cpu_the_op_refuses_what_the_kernels_refuse_naming_it(change, match):
    """The CPU kernel (the reference) runs the CUDA path's checks on shapes, so a graph that runs on
    the CPU does not fail on the GPU (it broadcast a batch or failed deep inside torch before)."""
    q, k, v, padding = change(*_inputs())
    with pytest.raises(stof_cc.AttentionInputError, match=match):
        torch.ops.stof_cc.attention(q, k, v, "causal", None, padding)
    # an infinite scale gave NaN (found by review); below 1e-30 the softmax's slack is no finite fp32 number
    for scale in (-1.0, float("inf"), 1e-31):
        with pytest.raises(stof_cc.AttentionInputError, match="scale must be positive and finite"):
            torch.ops.stof_cc.attention(*_inputs()[:3], "causal", scale, None)
