"""Gradients of every differentiable OpInfo entry on `tpu` equal CPU's: the VJP of the entry's
outputs with a fixed random cotangent, through PyTorch's autograd on both devices."""

import pytest

from .harness import GRAD
from .plan import check_case, params


@pytest.mark.parametrize("case", params(GRAD))
def test_grad(case):
    check_case(case)
