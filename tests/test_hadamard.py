"""One Walsh–Hadamard: oscar.stats.hadamard owns the construction; every other module's `hadamard` is its
adapter. The owner is pinned against a construction written independently here (H[i, j] = (-1)^popcount(i & j)
for Sylvester orders), and each call site's function against the owner (dtype, normalisation, sign convention,
supported sizes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from oscar.common import OscarError
from oscar.constraints import hadamard_supported
from oscar.stats import hadamard as H

POW2 = [1 << k for k in range(11)]  # 1 .. 1024
PALEY = [m << k for m in (12, 20) for k in range(6)]  # 12 .. 640


def brute_sylvester(n: int) -> np.ndarray:
    i = np.arange(n)
    parity = np.vectorize(lambda v: bin(v).count("1") & 1)(i[:, None] & i[None, :])
    return np.where(parity == 1, -1.0, 1.0)


@pytest.mark.parametrize("n", POW2)
def test_sylvester_orders_equal_brute_force_bit_for_bit(n):
    want = brute_sylvester(n)
    assert np.array_equal(H.sylvester(n), want)
    got = H.hadamard(n)
    assert got.dtype == np.float64 and got.shape == (n, n)
    assert np.array_equal(got, want / np.sqrt(n))  # sign convention: first row and column +, H[1, 1] = -
    assert np.array_equal(got, got.T)


@pytest.mark.parametrize("n", PALEY)
def test_paley_orders_are_orthogonal_with_equal_magnitudes(n):
    h = H.hadamard(n)
    assert h.dtype == np.float64 and h.shape == (n, n)
    assert np.array_equal(np.abs(h), np.full((n, n), 1 / np.sqrt(n)))
    assert np.allclose(h @ h.T, np.eye(n), atol=1e-12)
    m = 12 if n % 12 == 0 else 20
    assert np.array_equal(h, np.kron(H.paley(m - 1), brute_sylvester(n // m)) / np.sqrt(n))


def test_supported_sizes_are_the_leaf_checks_and_the_rest_raise():
    orders = set(POW2) | {m << k for m in (12, 20) for k in range(7)}  # every order below 1300
    for n in range(0, 1300):
        assert H.supported(n) == hadamard_supported(n) == (n in orders)
    for n in (0, 3, 24 * 3, 36, 48 * 5, 100):
        with pytest.raises(H.HadamardUnsupported):
            H.hadamard(n)
    assert issubclass(H.HadamardUnsupported, OscarError)


def test_returned_matrix_is_a_copy():
    a = H.hadamard(8)
    a[0, 0] = 7.0
    assert H.hadamard(8)[0, 0] == 1 / np.sqrt(8)


def test_tensor_adapter_casts_the_float64_matrix():
    for n in POW2[:8] + PALEY[:4]:
        t = H.hadamard_tensor(n)
        assert t.dtype == torch.float64 and torch.equal(t, torch.from_numpy(H.hadamard(n)))
        f = H.hadamard_tensor(n, torch.float32)
        assert f.dtype == torch.float32 and torch.equal(f, t.float())
    with pytest.raises(H.HadamardUnsupported, match="the check needs a power-of-two head_dim, got 48"):
        H.hadamard_tensor(48, sylvester_for="the check")
    assert torch.equal(H.hadamard_tensor(64, sylvester_for="x"), H.hadamard_tensor(64))


def test_every_call_site_takes_the_owners_matrix():
    from oscar.stats import reference_recipe as rr
    from oscar.validate import codebooks, methods
    from oscar.validate.ablation import schemes

    assert schemes.hadamard is H.hadamard_tensor and codebooks.hadamard is H.hadamard_tensor
    for n in POW2:
        want = torch.from_numpy(H.hadamard(n))
        r, v = rr.hadamard(n), methods.hadamard(n)
        assert r.dtype == torch.float64 and torch.equal(r, want)  # the published recipe: float64
        assert v.dtype == torch.float32 and torch.equal(v, want.float())  # the hadamard-int2 baseline: float32
    for n in (0, 12, 48, 96, 160):  # Sylvester orders only, for both (a Paley order is refused, as before)
        with pytest.raises(OscarError, match="power-of-two head_dim"):
            rr.hadamard(n)
        with pytest.raises(OscarError, match="power-of-two head_dim"):
            methods.hadamard(n)
    for n in PALEY:
        assert torch.equal(schemes.hadamard(n), torch.from_numpy(H.hadamard(n)))
    # the fit's fixed factor H P_br and the fallback rotation are built on the same matrix
    from oscar.stats.rotations import hadamard_rot, mixer

    for n in (64, 96):
        assert np.array_equal(mixer(n, bitrev=False), H.hadamard(n))
        assert np.array_equal(hadamard_rot(2, n)[1], H.hadamard(n) @ H.perm_matrix(H.bitrev_perm(n)))
