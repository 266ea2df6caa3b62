"""The fused CPU kernels behind the family softmax: the backward of both results (the
log-sum-exp's gradient included) against autograd through a dense reference."""
import pytest
import torch

from hsa_graph.ops.flash import cpu_flash_attention, cpu_flash_attention_backward
from hsa_graph.ops.hsa import _FamilyAttention
from hsa_graph.typing import WITH_CPU_FLASH_ATTENTION

pytestmark = pytest.mark.skipif(not WITH_CPU_FLASH_ATTENTION,
                                reason="no fused CPU attention kernel in this PyTorch")

F, H, B, D = 5, 3, 7, 6
NEG_INF = float("-inf")


def token_major(seed: int, dtype=torch.float64):
    """``q, k, v`` as ``[F, H, b, D]`` views of token-major ``[F, b, H, D]`` rows (the
    layout HSA hands the kernels), and the two upstream gradients."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v, d_out = (torch.randn(F, B, H, D, generator=gen, dtype=dtype).transpose(1, 2)
                      for _ in range(4))
    d_lse = torch.randn(F, H, B, generator=gen, dtype=dtype)
    return q, k, v, d_out, d_lse


def biases(dtype=torch.float64):
    """None; a key-only bias with padded keys (HSA's leaf buckets); a full bias with a
    masked diagonal and padding (internal members, ``include_self=False``)."""
    gen = torch.Generator().manual_seed(9)
    keys = torch.randn(F, 1, 1, B, generator=gen, dtype=dtype)
    keys[:, :, :, -2:] = NEG_INF
    full = keys.expand(F, 1, B, B).clone()
    full.diagonal(dim1=-2, dim2=-1).fill_(NEG_INF)
    return [None, keys, full]


def reference(q, k, v, bias, scale):
    logits = q @ k.transpose(-1, -2) * scale
    if bias is not None:
        logits = logits + bias
    lse = torch.logsumexp(logits, -1)
    return torch.softmax(logits, -1) @ v, lse


@pytest.mark.parametrize("with_lse_grad", [True, False])
@pytest.mark.parametrize("bias_index", [0, 1, 2])
def test_backward_matches_autograd_of_the_dense_reference(bias_index, with_lse_grad):
    bias = biases()[bias_index]
    q, k, v, d_out, d_lse = token_major(seed=bias_index)
    scale = 0.4
    out, lse = cpu_flash_attention(q, k, v, bias, scale)
    ref_out, ref_lse = reference(q, k, v, bias, scale)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-12)

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = reference(*leaves, bias, scale)
    loss = (ref_out * d_out).sum() + ((ref_lse * d_lse).sum() if with_lse_grad else 0)
    expected = torch.autograd.grad(loss, leaves)
    got = cpu_flash_attention_backward(q, k, v, bias, out, lse, d_out,
                                       d_lse if with_lse_grad else None, scale)
    for name, g, e in zip("qkv", got, expected):
        assert g.shape == e.shape, name
        torch.testing.assert_close(g, e, rtol=0, atol=1e-11, msg=f"d{name}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("bias_index", [0, 1, 2])
def test_lse_gradient_on_rows_without_an_output_gradient(bias_index, dtype):
    """The log-sum-exp's gradient rides on the output gradient (the kernel reads
    ``dO . o'``); rows where ``dO`` is zero or too small to carry it (a leaf whose output
    no loss reads) take the extra passes, over their families alone: every mix gives
    the dense reference's gradients."""
    bias = biases(dtype)[bias_index]
    q, k, v, d_out, d_lse = (t.to(dtype) for t in token_major(seed=20 + bias_index))
    tiny = 1e-30 if dtype == torch.float32 else 1e-200
    d_out = d_out.clone()
    d_out[0] = 0.0                  # a whole family without output gradient
    d_out[1, :, 2] = 0.0            # single rows, in every head
    d_out[2, 1, :3] = tiny          # too small: |d_lse| / |dO| would overflow
    d_out[3, 0, 4] = 1e-3           # small but carried
    scale = 0.4
    out, lse = cpu_flash_attention(q, k, v, bias, scale)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = reference(*leaves, bias, scale)
    expected = torch.autograd.grad((ref_out * d_out).sum() + (ref_lse * d_lse).sum(), leaves)
    got = cpu_flash_attention_backward(q, k, v, bias, out, lse, d_out, d_lse, scale)
    atol = 1e-11 if dtype == torch.float64 else 2e-5
    for name, g, e in zip("qkv", got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=atol, msg=f"d{name}")
    only_lse = cpu_flash_attention_backward(q, k, v, bias, out, lse, torch.zeros_like(d_out),
                                            d_lse, scale)
    ref_lse = reference(*leaves, bias, scale)[1]
    expected = torch.autograd.grad((ref_lse * d_lse).sum(), leaves[:2])
    for name, g, e in zip("qk", only_lse, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=atol, msg=f"d{name} (lse alone)")
    assert only_lse[2].abs().max() == 0


def test_backward_declines_where_the_kernel_does_not_apply():
    q, k, v, d_out, d_lse = token_major(seed=3)
    out, lse = reference(q, k, v, None, 0.5)
    half = [t.to(torch.bfloat16) for t in (q, k, v, out, lse, d_out, d_lse)]
    assert cpu_flash_attention(*half[:3], None, 0.5) is None
    assert cpu_flash_attention_backward(*half[:3], None, *half[3:], 0.5) is None


@pytest.mark.parametrize("dv", [3, 9])
@pytest.mark.parametrize("bias_index", [0, 2])
def test_value_width_other_than_the_key_width(dv, bias_index):
    """``Dv != D`` (positions widen the queries and keys): the narrower side is widened
    with zero features for the kernels, forward and backward equal the reference."""
    bias = biases()[bias_index]
    q, k, _, _, d_lse = token_major(seed=7)
    gen = torch.Generator().manual_seed(8)
    v, d_out = (torch.randn(F, B, H, dv, generator=gen, dtype=torch.float64).transpose(1, 2)
                for _ in range(2))
    out, lse = cpu_flash_attention(q, k, v, bias, 0.6)
    assert out.shape == (F, H, B, dv)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = reference(*leaves, bias, 0.6)
    torch.testing.assert_close(out, ref_out.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse.detach(), rtol=0, atol=1e-12)
    expected = torch.autograd.grad((ref_out * d_out).sum() + (ref_lse * d_lse).sum(), leaves)
    got = cpu_flash_attention_backward(q, k, v, bias, out, lse, d_out, d_lse, 0.6)
    for name, g, e in zip("qkv", got, expected):
        assert g.shape == e.shape, name
        torch.testing.assert_close(g, e, rtol=0, atol=1e-11, msg=f"d{name}")


def test_backward_in_blocks_of_families(monkeypatch):
    """Past a few MiB the backward runs in blocks of families (their temporaries reuse
    heap memory): blocks of one and of two families give the single call's gradients."""
    import hsa_graph.ops.flash as flash

    bias = biases()[1]
    q, k, v, d_out, d_lse = token_major(seed=11)
    out, lse = cpu_flash_attention(q, k, v, bias, 0.4)
    whole = cpu_flash_attention_backward(q, k, v, bias, out, lse, d_out, d_lse, 0.4)
    per_family = q[:1].numel() * q.element_size()
    for families in (1, 2):
        monkeypatch.setattr(flash, "_BLOCK_BYTES", families * per_family)
        blocked = cpu_flash_attention_backward(q, k, v, bias, out, lse, d_out, d_lse, 0.4)
        for g, e, t in zip(blocked, whole, (q, k, v)):
            assert g.stride() == t.stride()  # token-major, as the inputs
            torch.testing.assert_close(g, e, rtol=0, atol=1e-13)


@pytest.mark.parametrize("bias_index", [1, 2])
def test_family_attention_fused_and_matmul_backwards_agree(bias_index):
    """The autograd function takes the fused backward on a first-order backward and the
    differentiable matmul one under ``create_graph``: both give the same gradients."""
    bias = biases()[bias_index]
    q, k, v, d_out, d_lse = token_major(seed=5)
    grads = []
    for create_graph in (False, True):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out, lse = _FamilyAttention.apply(*leaves, bias, 0.3)
        loss = (out * d_out).sum() + (lse * d_lse).sum()
        grads.append(torch.autograd.grad(loss, leaves, create_graph=create_graph))
    for fused, matmul in zip(*grads):
        torch.testing.assert_close(fused, matmul.detach(), rtol=0, atol=1e-11)
