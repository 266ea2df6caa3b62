"""Every attention module on inputs of arbitrary strides and every float dtype: equal to
the same module in float64 on the contiguous copy, or a ValueError / TypeError."""
from __future__ import annotations

import copy

import pytest
import torch

import hsa_graph
from hsa_graph.nn import (
    CausalDecoderLayer,
    CausalHSAttention,
    HierarchicalTransformerEncoder,
    HierarchicalTransformerEncoderLayer,
    HSATransformerEncoderLayer,
    HSAttention,
)

TREE = hsa_graph.NestedSignal.from_parents([-1, 0, 0, 0, 1, 1, 1, 2, 2, 3, 9, 9])
C = 12
MODULES = {
    "HSAttention": lambda: HSAttention(C, heads=3),
    "HSAttention-pos": lambda: HSAttention(C, heads=3, pos_dim=4),
    "HSAttention-flat": lambda: HSAttention(C, heads=2, attention="flat"),
    "HSAttention-none": lambda: HSAttention(C, heads=2, attention="none"),
    "HTE layer": lambda: HierarchicalTransformerEncoderLayer(C, heads=3),
    "pre-norm layer": lambda: HSATransformerEncoderLayer(C, heads=3),
    "encoder": lambda: HierarchicalTransformerEncoder(C, num_layers=2, heads=3),
    "CausalHSAttention": lambda: CausalHSAttention(C, heads=3),
    "CausalDecoderLayer": lambda: CausalDecoderLayer(C, heads=3),
}
TOLERANCE = {torch.bfloat16: 0.15, torch.float16: 3e-2, torch.float32: 1e-4,
             torch.float64: 1e-10}


def layouts(x: torch.Tensor):
    yield "contiguous", x
    yield "step", torch.stack([x, torch.full_like(x, 3.0)], -1)[..., 0]
    yield "transposed", x.t().contiguous().t()
    yield "expand-features", x[:, :1].expand(x.shape)
    yield "expand-rows", x[:1].expand(x.shape)


@pytest.mark.parametrize("name", list(MODULES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16,
                                   torch.float16])
def test_modules_on_any_strides_and_dtypes(name, dtype):
    torch.manual_seed(0)
    module = MODULES[name]().eval()
    reference = copy.deepcopy(module).double()
    module = module.to(dtype)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(TREE.num_leaves, C, generator=g, dtype=torch.float64).to(dtype)
    for layout, view in layouts(x):
        got = module(view, TREE)
        want = reference(view.contiguous().double(), TREE)
        assert got.dtype == dtype, (layout, got.dtype)
        scale = want.abs().max().clamp_min(1.0)
        err = ((got.double() - want).abs().max() / scale).item()
        assert err < TOLERANCE[dtype], (name, layout, err)


@pytest.mark.parametrize("name", list(MODULES))
def test_modules_refuse_a_dtype_their_parameters_do_not_have(name):
    module = MODULES[name]()
    with pytest.raises(TypeError, match="float64 but the parameters"):
        module(torch.randn(TREE.num_leaves, C, dtype=torch.float64), TREE)
    with pytest.raises(TypeError, match="floating point"):
        module(torch.ones(TREE.num_leaves, C, dtype=torch.long), TREE)


@pytest.mark.parametrize("bad", [0, -1, True, 2.5])
def test_attention_sizes_must_be_positive_ints(bad):
    with pytest.raises((ValueError, TypeError)):
        HSAttention(C, heads=bad)
    with pytest.raises((ValueError, TypeError)):
        HSAttention(bad, heads=1)
    with pytest.raises((ValueError, TypeError)):
        CausalHSAttention(C, heads=bad)


def test_causal_step_on_strided_tokens_equals_forward():
    torch.manual_seed(2)
    attn = CausalHSAttention(C, heads=3).double().eval()
    x = torch.randn(C, TREE.num_leaves, dtype=torch.float64).t()   # rows not contiguous
    full = attn(x, TREE)
    cache = attn.new_cache()
    moves = hsa_graph.HSACache.moves_of(TREE)
    steps = torch.stack([attn.step(x[i], cache, **moves[i]) for i in range(x.shape[0])])
    torch.testing.assert_close(steps, full)
