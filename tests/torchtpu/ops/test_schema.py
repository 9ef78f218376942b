"""`torchtpu.ops.schema`: which functional overload computes what an in-place or `out=` overload
writes, found by argument schema (names and types), never by overload name alone."""

from __future__ import annotations

import pytest
import torch

from torchtpu.ops.schema import functional_arguments, functional_variant, signature

aten = torch.ops.aten

VARIANTS = [
    (aten.add_.Tensor, aten.add.Tensor),
    (aten.add.out, aten.add.Tensor),
    # The same overload name would be wrong: pow.Scalar is (Scalar self, Tensor exponent).
    (aten.pow_.Scalar, aten.pow.Tensor_Scalar),
    (aten.pow_.Tensor, aten.pow.Tensor_Tensor),
    (aten.float_power_.Scalar, aten.float_power.Tensor_Scalar),
    (aten.ldexp_.default, aten.ldexp.Tensor),  # ldexp.default is (float x, int i) -> float
    (aten.floor_divide_.Tensor, aten.floor_divide.default),
    # Functional forms named `<op>_functional`.
    (aten.normal_.default, aten.normal_functional.default),
    (aten.rrelu_with_noise_.default, aten.rrelu_with_noise_functional.default),
    # Defaults may differ: bernoulli_.float has p=0.5, bernoulli.p none.
    (aten.bernoulli_.float, aten.bernoulli.p),
    (aten.bernoulli_.Tensor, aten.bernoulli.Tensor),
    (aten.polygamma_.default, aten.polygamma.default),
    (aten.polygamma.out, aten.polygamma.default),
    (aten._foreach_add_.List, aten._foreach_add.List),
    (aten.exp.default, aten.exp.default),  # a functional op is its own variant
]


@pytest.mark.parametrize("op, functional", VARIANTS, ids=lambda v: str(v))
def test_functional_variant_matches_the_argument_schema(op, functional):
    assert functional_variant(op) is functional


def test_arguments_follow_the_functional_schemas_order():
    # polygamma_(self, n) computes polygamma(n, self).
    assert functional_arguments(aten.polygamma_.default, ["self", 2]) == [2, "self"]
    # out= arguments are dropped.
    values = signature(aten.polygamma.out).normalize((3, "x"), {"out": "o"})
    assert functional_arguments(aten.polygamma.out, values) == [3, "x"]


def test_every_variant_takes_its_functional_arguments_by_name_and_type():
    """For every ATen overload that writes an argument and has a variant: the variant takes the
    overload's non-`out=` arguments, of the same types, and writes none."""
    checked = 0
    for name in dir(aten):
        packet = getattr(aten, name)
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            continue
        for overload in packet.overloads():
            op = getattr(packet, overload)
            sig = signature(op)
            functional = functional_variant(op)
            if not sig.written or functional is None:
                continue
            inputs = functional_arguments(op, list(op._schema.arguments))
            assert [str(a.type) for a in inputs] == [str(a.type) for a in functional._schema.arguments], op
            assert not signature(functional).written, op
            checked += 1
    assert checked > 1000
