"""Rotation: orthogonality, butterflies = Hadamard matrix, quaternion blocks, costs, GQA."""

import mlx.core as mx
import numpy as np
import pytest

from rq_core.errors import RQError
from rq_core.codec.rotation import (VARIANTS, Rotation, hadamard_matrix, head_params, quat_conj, quat_mul, wht)

DIMS = [16, 32, 64, 128, 256, 512, 1024]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("d", DIMS)
def test_orthogonal_every_variant_and_dim(variant, d):
    H = 1 if variant == "dense" and d > 256 else 2  # a Haar QR per head is slow at d=1024
    rot = Rotation(d, H, variant=variant, seed=3, layer=1)
    R = np.array(rot.dense_matrices())
    assert R.shape == (H, d, d)
    # float32, every variant and dim up to 1024: measured R R^T - I within 3.3e-6 and x - R^-1 R x within 4.3e-6;
    # 1e-5 is 2.3x the worse (the error grows with d, so one bound for all dims)
    for h in range(H):
        assert np.abs(R[h] @ R[h].T - np.eye(d)).max() < 1e-5
    x = mx.random.normal((2, H, 3, d), key=mx.random.key(d))
    assert np.abs(np.array(rot.inverse(rot.forward(x)) - x)).max() < 1e-5


@pytest.mark.parametrize("variant", VARIANTS)
def test_norms_and_inner_products_preserved(variant):
    rot = Rotation(128, 4, variant=variant, seed=7, layer=5)
    a = mx.random.normal((1, 4, 10, 128), key=mx.random.key(1))
    b = mx.random.normal((1, 4, 10, 128), key=mx.random.key(2))
    ra, rb = rot.forward(a), rot.forward(b)
    # measured 1.1e-5 (inner products up to 25) and 3.2e-7 relative (norms); bounds 2-3x those
    np.testing.assert_allclose(np.array((ra * rb).sum(-1)), np.array((a * b).sum(-1)), atol=2.5e-5)
    np.testing.assert_allclose(np.array(mx.linalg.norm(ra, axis=-1)), np.array(mx.linalg.norm(a, axis=-1)),
                               rtol=1e-6)
    # forward is R x with the matrix from dense_matrices
    R = np.array(rot.dense_matrices())
    np.testing.assert_allclose(np.array(ra), np.einsum("hij,bhtj->bhti", R, np.array(a)), atol=5e-6)  # measured 1.9e-6


@pytest.mark.parametrize("d", DIMS)
def test_wht_equals_hadamard_matrix(d):
    x = np.random.default_rng(d).standard_normal((3, 2, d)).astype(np.float32)
    # measured 4.0e-7 and 6.0e-7 at most over DIMS (values up to 3.8); 2.5x that
    np.testing.assert_allclose(np.array(wht(mx.array(x))), x @ hadamard_matrix(d).T, atol=1.5e-6)
    np.testing.assert_allclose(np.array(wht(wht(mx.array(x)))), x, atol=1.5e-6)


def test_blocks_are_quaternion_products():
    d = 32
    q = head_params("wht_so4", d, 0, 2, 1)
    rot = Rotation(d, 2, variant="so4", seed=0, layer=2)
    v = np.random.default_rng(0).standard_normal((d // 4, 4))
    want = quat_mul(quat_mul(q[:, 0], v), quat_conj(q[:, 1]))
    x = mx.array(v.reshape(1, d).astype(np.float32))[None].astype(mx.float32)
    x = mx.concatenate([mx.zeros_like(x), x], axis=0)[None]  # heads 0 and 1, use head 1
    got = np.array(rot.forward(x))[0, 1, 0].reshape(d // 4, 4)
    np.testing.assert_allclose(got, want, atol=6e-7)  # measured 2.4e-7 (values up to 2.0)
    M = np.array(rot.block_matrices())
    assert M.shape == (2, d // 4, 4, 4) and M.dtype == np.float32
    np.testing.assert_allclose(np.einsum("jab,jb->ja", M[1], v), want, atol=6e-7)  # measured 3.7e-8


def test_so3_leaves_an_axis_fixed_so4_does_not():
    d = 64
    for variant, fixed in [("so3", True), ("so4", False)]:
        R = np.array(Rotation(d, 1, variant=variant, seed=1).dense_matrices())[0]
        # The real axis of each 4-block (coordinate 4j) maps to itself under q·v·conj(q).
        real_axes = np.diag(R)[::4]
        if fixed:
            np.testing.assert_allclose(real_axes, 1.0, atol=1e-6)
        else:
            assert np.all(real_axes < 0.999)
        # Fraction of coordinates e_i with R e_i = e_i.
        unmixed = np.mean(np.isclose(np.diag(R), 1.0, atol=1e-6))
        assert unmixed == (0.25 if fixed else 0.0)


def test_costs():
    assert Rotation(128, 1).param_count == 256 and Rotation(128, 1).fma_count == 1408
    dense = Rotation(128, 1, variant="dense")
    assert dense.param_count == 16384 and dense.fma_count == 16384
    assert Rotation(128, 1, variant="wht").fma_count == 896


def test_deterministic_from_seed_layer_head():
    a = np.array(Rotation(64, 3, seed=1, layer=2).block_matrices())
    b = np.array(Rotation(64, 3, seed=1, layer=2).block_matrices())
    c = np.array(Rotation(64, 3, seed=1, layer=3).block_matrices())
    assert np.array_equal(a, b) and not np.allclose(a, c) and not np.allclose(a[0], a[1])
    g = np.random.default_rng([1, 2, 1]).standard_normal((16, 2, 4))
    g /= np.linalg.norm(g, axis=-1, keepdims=True)
    np.testing.assert_allclose(head_params("wht_so4", 64, 1, 2, 1), g)


def test_gqa_queries_use_their_kv_head():
    rot = Rotation(32, 2, seed=0)
    q = mx.random.normal((1, 6, 2, 32), key=mx.random.key(0))  # G = 3
    got = np.array(rot.forward_queries(q))
    R = np.array(rot.dense_matrices())
    for h in range(6):
        np.testing.assert_allclose(got[0, h], np.array(q[0, h]) @ R[h // 3].T, atol=1.5e-6)  # measured 7.2e-7
    np.testing.assert_allclose(np.array(rot.inverse_queries(rot.forward_queries(q))), np.array(q),
                               atol=1.5e-6)  # measured 3.6e-7


@pytest.mark.parametrize("d", [8, 100, 2048, 0])
def test_bad_dim(d):
    with pytest.raises(RQError, match="power of two"):
        Rotation(d, 1)


def test_bad_variant():
    with pytest.raises(RQError, match="unknown rotation"):
        Rotation(64, 1, variant="so5")
