"""In-place variants (`OpInfo.inplace_variant`, e.g. `Tensor.add_`) on `tpu` write what CPU
writes, return `self` as CPU does, and reject what CPU rejects."""

import pytest

from .harness import INPLACE
from .plan import check_case, params


@pytest.mark.parametrize("case", params(INPLACE))
def test_inplace(case):
    check_case(case)
