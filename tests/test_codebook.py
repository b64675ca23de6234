"""Lloyd-Max codebooks: SPEC numbers, sample fitting, TOML round trip."""

import numpy as np
import pytest

from rq_core.codec.codebook import Codebook, fit_codebook, gaussian_codebook, get_codebook, sphere_codebook
from rq_core.errors import RQError

GAUSS3 = [0.2451, 0.7560, 1.3439, 2.1519]
SPHERE3_128 = [0.2444, 0.7533, 1.3366, 2.1315]


# The published levels and MSEs above are rounded to 4 decimals (half a unit: 5e-5); measured against them: levels
# within 4.6e-5 (Gaussian) and 3.0e-5 (sphere), the Gaussian MSE within 2.2e-6 (this file's tests). Bounds: twice
# the rounding.
ROUNDED = 1e-4


def _sym(levels):
    return np.array([-x for x in reversed(levels)] + list(levels))


def test_gaussian_3bit():
    cb = gaussian_codebook(3)
    np.testing.assert_allclose(cb.levels, _sym(GAUSS3), rtol=0, atol=ROUNDED)
    assert abs(cb.mse - 0.03455) < 1e-5  # 0.0345478: 5 significant digits published, rounding 5e-6
    np.testing.assert_allclose(cb.thresholds, (cb.levels[1:] + cb.levels[:-1]) / 2)


def test_sphere_128_3bit():
    cb = sphere_codebook(3, 128)
    np.testing.assert_allclose(cb.levels, _sym(SPHERE3_128), rtol=0, atol=ROUNDED)
    assert abs(cb.mse - 0.03397) < 1e-5  # measured 0.0339659 (SPEC rounds it to 0.0340)


def test_known_low_bits_and_trend():
    # measured within 1.5e-5 and 2.0e-5 of these 4-decimal values
    np.testing.assert_allclose(gaussian_codebook(1).levels, [-0.7979, 0.7979], rtol=0, atol=ROUNDED)  # ±sqrt(2/pi)
    np.testing.assert_allclose(gaussian_codebook(2).levels, [-1.5104, -0.4528, 0.4528, 1.5104], rtol=0, atol=ROUNDED)
    mses = [gaussian_codebook(b).mse for b in (1, 2, 3, 4)]
    assert all(a > b for a, b in zip(mses, mses[1:]))
    # The sphere marginal approaches N(0,1) as d grows.
    gap = [np.abs(sphere_codebook(3, d).levels - gaussian_codebook(3).levels).max() for d in (16, 128, 1024)]
    assert gap[0] > gap[1] > gap[2]


def test_fit_to_samples_recovers_gaussian():
    z = np.random.default_rng(0).standard_normal(200_000)
    cb = fit_codebook(z, 3)
    # seeded sample: measured 0.0082 from the exact levels and 2.5e-4 from the exact MSE; bounds 1.5x those
    np.testing.assert_allclose(cb.levels, gaussian_codebook(3).levels, rtol=0, atol=0.012)
    assert abs(cb.mse - 0.03455) < 4e-4
    assert np.all(np.diff(cb.levels) > 0)


def test_encode_counts_thresholds():
    cb = gaussian_codebook(2)
    z = np.array([-10, cb.thresholds[0], cb.thresholds[0] + 1e-9, 0.0, 10])
    assert cb.encode(z).tolist() == [0, 0, 1, 1, 3]


def test_toml_round_trip(tmp_path):
    cb = sphere_codebook(4, 64)
    path = tmp_path / "sub" / "cb.toml"
    cb.save(path)
    back = Codebook.load(path)
    assert back.bits == 4 and back.dim == 64 and back.distribution == "sphere"
    np.testing.assert_array_equal(back.levels, cb.levels)
    assert get_codebook(str(path), 4, 64).levels.tolist() == cb.levels.tolist()
    with pytest.raises(RQError, match="4 bits"):
        get_codebook(str(path), 3, 64)


def test_bad_inputs(tmp_path):
    for b in (0, 5):
        with pytest.raises(RQError, match="bits"):
            gaussian_codebook(b)
    with pytest.raises(RQError, match="power of two"):
        sphere_codebook(3, 100)
    bad = tmp_path / "bad.toml"
    bad.write_text("x = 1\n")
    with pytest.raises(RQError, match="not a codebook"):
        Codebook.load(bad)
    with pytest.raises(RQError, match="not found"):
        Codebook.load(tmp_path / "missing.toml")
    # levels strictly ascending: a repeated level would leave a cell no value is ever coded to (its threshold equals
    # the next one), a 2-bit codebook with 3 usable levels
    for levels in ("[-1.0, 0.0, 0.0, 1.0]", "[-1.0, 0.5, 0.0, 1.0]", "[-1.0, 0.0, 1.0]"):
        bad.write_text(f"[codebook]\nbits = 2\nlevels = {levels}\n")
        with pytest.raises(RQError, match="needs 4 ascending levels"):
            Codebook.load(bad)


def test_pair_codebooks_shipped_equal_their_fit():
    """assets/pair_codebooks.json holds exactly what `_pair_lloyd` fits (float32), for every head dim it covers;
    checked here on the cheapest entry and on an entry computed on the fly (head dim 32 is not shipped)."""
    from rq_core.codec.codebook import PAIR_POINTS, _pair_lloyd, check_pair_points, pair_codebook

    pair_codebook.cache_clear()
    shipped = pair_codebook(16, 64, "keys")
    assert shipped.shape == (16, 2) and shipped.dtype == np.float32
    np.testing.assert_array_equal(shipped, _pair_lloyd(16, 64, 1))
    fitted = pair_codebook(16, 32, "values")
    np.testing.assert_array_equal(fitted, _pair_lloyd(16, 32, 2))
    # Lloyd's points are the means of their cells: the codebook is centred like the marginal
    assert abs(float(fitted.mean())) < 0.005  # measured 0.0025
    assert check_pair_points([128, 32]) == (128, 32) and 256 in PAIR_POINTS
    with pytest.raises(RQError):
        check_pair_points([128, 3])


def test_reconstruction_gain_is_one_over_one_minus_distortion():
    """A Lloyd codebook shrinks its reconstructions by its distortion D: the gain E|z|^2 / E<ẑ, z> is 1 / (1 - D),
    checked against the scalar codebook's own mse (computed on a grid, not sampled); the 32-point value pair codebook
    (2.5 bits a coordinate) shrinks more than the 128-point key one."""
    from rq_core.codec.codebook import pair_codebook, reconstruction_gain

    cb = sphere_codebook(3, 128)
    # measured 6.4e-4 apart (the gain's quadrature against the mse's grid); 1.6x that
    assert reconstruction_gain(cb.levels, 128) == pytest.approx(1 / (1 - cb.mse), abs=1e-3)
    gv, gk = (reconstruction_gain(pair_codebook(n, 128, r), 128) for n, r in ((32, "values"), (128, "keys")))
    # the shipped codebooks' gains, measured (deterministic): 1.061458 and 1.018065
    assert gv == pytest.approx(1.061458, rel=1e-5) and gk == pytest.approx(1.018065, rel=1e-5) and gk < gv
    assert reconstruction_gain(np.array([-1.0, 1.0]), 64) > 1.0  # any codebook, not only Lloyd's
