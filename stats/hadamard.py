"""Normalised Hadamard matrices and the bit-reversal permutation used by OSCAR rotations: the one
Walsh–Hadamard of the project (the fit's rotations, the published recipe, the validation's hadamard-int2
baseline, the ablation's and TurboQuant's random-sign WHT all take theirs from here).

Sizes supported: 2^k (Sylvester) and 12 * 2^k, 20 * 2^k (Kronecker product of a
Paley type-I Hadamard matrix of order 12 or 20 with a Sylvester one), which covers
head dims 24, 40, 48, 80, 96, 160, 192, 320, ... Everything is float64 and exact
up to the 1/sqrt(n) normalisation.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from oscar.common import OscarError
from oscar.constraints import HADAMARD_PALEY_ORDERS as PALEY_ORDERS
from oscar.constraints import hadamard_supported as supported  # the sizes rule the up-front checks read too


class HadamardUnsupported(OscarError):
    """No Hadamard matrix of this order here: a format / variant that needs one cannot serve the model."""


def _is_pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def sylvester(n: int) -> np.ndarray:
    """Unnormalised Sylvester Hadamard matrix of order n = 2^k (entries ±1)."""
    if not _is_pow2(n):
        raise HadamardUnsupported(f"Sylvester Hadamard needs a power of two, got {n}")
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def paley(q: int) -> np.ndarray:
    """Paley type-I Hadamard matrix of order q + 1 for a prime q ≡ 3 (mod 4) (entries ±1)."""
    if q % 4 != 3 or any(q % p == 0 for p in range(2, int(q**0.5) + 1)):
        raise OscarError(f"Paley construction I needs a prime q ≡ 3 mod 4, got {q}")
    squares = {(i * i) % q for i in range(1, q)}
    chi = np.array([0] + [1 if a in squares else -1 for a in range(1, q)])
    Q = np.array([[chi[(j - i) % q] for j in range(q)] for i in range(q)], dtype=np.float64)  # Jacobsthal
    n = q + 1
    S = np.zeros((n, n))
    S[0, 1:] = 1
    S[1:, 0] = -1
    S[1:, 1:] = Q
    h = np.eye(n) + S
    assert np.array_equal(h @ h.T, n * np.eye(n)), "Paley construction failed"
    return h


@lru_cache(maxsize=16)
def _hadamard(n: int) -> np.ndarray:
    if _is_pow2(n):
        h = sylvester(n)
    else:
        m = next((m for m in PALEY_ORDERS if n % m == 0 and _is_pow2(n // m)), None)
        if m is None:
            raise HadamardUnsupported(
                f"head_dim {n} has no Hadamard construction here (supported: 2^k, 12*2^k, 20*2^k, e.g. "
                f"64, 96, 128, 160); use a variant without a Hadamard factor: --variant random or --variant identity"
            )
        h = np.kron(paley(m - 1), sylvester(n // m))
    h = h / np.sqrt(n)
    h.setflags(write=False)
    return h


def hadamard(n: int) -> np.ndarray:
    """Normalised (orthogonal) Hadamard matrix of order n, float64 (n, n)."""
    return _hadamard(int(n)).copy()


def hadamard_tensor(n: int, dtype=None, *, sylvester_for: str | None = None):
    """hadamard(n) as a torch tensor: the float64 matrix, cast to dtype (default float64).

    sylvester_for: the caller that accepts only the Sylvester orders n = 2^k (the published recipe, the data-free
    hadamard-int2 baseline); any other n raises HadamardUnsupported naming it."""
    # late: keeps torch (2.1 s) out of `oscar --help`
    import torch  # here, not at the top: the CLI reads the variant registry (stats.rotations) without torch

    n = int(n)
    if sylvester_for is not None and not _is_pow2(n):
        raise HadamardUnsupported(f"{sylvester_for} needs a power-of-two head_dim, got {n}")
    return torch.from_numpy(hadamard(n)).to(torch.float64 if dtype is None else dtype)


def bitrev_perm(n: int) -> np.ndarray:
    """Bit-reversal permutation of size n as an index array.

    n = 2^k: perm[i] = i with its k bits reversed. n = m * 2^k (m = 12 or 20):
    mixed-radix reversal, i = a * 2^k + b  ->  bitrev_k(b) * m + a, which reduces to the
    plain bit reversal for m = 1.
    """
    m = 1 if _is_pow2(n) else next((m for m in PALEY_ORDERS if n % m == 0 and _is_pow2(n // m)), None)
    if m is None:
        raise OscarError(f"bit reversal: head_dim {n} is not 2^k, 12*2^k or 20*2^k")
    p = n // m
    k = p.bit_length() - 1
    b = np.arange(p)
    rb = np.zeros_like(b)
    for j in range(k):
        rb |= ((b >> j) & 1) << (k - 1 - j)
    a = np.arange(m)
    # output position of input index i = a * p + b is rb[b] * m + a; perm lists inputs by output position
    out_pos = (rb[None, :] * m + a[:, None]).reshape(-1)  # (n,) indexed by i
    perm = np.empty(n, dtype=np.int64)
    perm[out_pos] = np.arange(n)
    return perm


def perm_matrix(perm: np.ndarray) -> np.ndarray:
    """P with (x @ P)[j] = x[perm[j]] (row-vector convention)."""
    n = len(perm)
    P = np.zeros((n, n))
    P[perm, np.arange(n)] = 1.0
    return P
