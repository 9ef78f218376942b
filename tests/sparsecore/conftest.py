"""Fixtures shared by the sparsecore tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from sparsecore.preprocess import native, pipeline


@pytest.fixture(scope="module", params=["native", "numpy"])
def each_preprocess_implementation(request: pytest.FixtureRequest) -> Iterator[str]:
    """Runs a module's tests once with each host-preprocessing implementation as what
    `implementation="auto"` selects (a module opts in with `pytestmark =
    pytest.mark.usefixtures("each_preprocess_implementation")`). The compiled one must build:
    a test machine without a C++ compiler fails here rather than testing NumPy twice."""
    if request.param == "native":
        assert native.build_error() is None, native.build_error()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pipeline, "_auto_native", lambda: request.param == "native")
        yield request.param
