"""The one backend choice (kernels.dispatch.backend): a cache's explicit choice, else $OSCAR_KERNELS, else device."""

import pytest

from oscar.common import OscarError
from oscar.kernels.dispatch import backend, triton_usable


def test_explicit_choice_wins_over_the_environment(monkeypatch):
    monkeypatch.setenv("OSCAR_KERNELS", "bogus")
    assert backend("cpu", "reference") == "reference"  # explicit: the environment is not read
    with pytest.raises(OscarError, match="OSCAR_KERNELS='bogus': expected 'triton' or 'reference'"):
        backend("cpu")
    with pytest.raises(OscarError, match="backend='fast': expected 'triton' or 'reference'"):
        backend("cpu", "fast")


def test_default_and_triton(monkeypatch):
    monkeypatch.delenv("OSCAR_KERNELS", raising=False)
    assert backend("cpu") == "reference"  # CPU tensors: the reference, even under TRITON_INTERPRET=1
    monkeypatch.setenv("OSCAR_KERNELS", "reference")
    assert backend("cpu") == "reference"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if not triton_usable("cpu"):
        with pytest.raises(OscarError, match="backend=triton but Triton cannot run on cpu"):
            backend("cpu", "triton")
        with pytest.raises(OscarError, match="OSCAR_KERNELS=triton but Triton cannot run on cpu"):
            monkeypatch.setenv("OSCAR_KERNELS", "triton")
            backend("cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if triton_usable("cpu"):
        assert backend("cpu", "triton") == "triton"
