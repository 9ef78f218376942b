"""Forward of every OpInfo entry on `tpu` equals CPU: float32, and bfloat16 / int64 where the
entry supports them, in every eager mode (see plan.py for the CI subset and the full sweep)."""

import pytest

from .harness import BFLOAT16, FLOAT32, INT64
from .plan import check_case, params


@pytest.mark.parametrize("case", params(FLOAT32, BFLOAT16, INT64))
def test_forward(case):
    check_case(case)
