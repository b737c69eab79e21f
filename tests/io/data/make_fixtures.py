#!/usr/bin/env python3
"""Writes the .npy fixtures of tests/io with NumPy. Run once from this folder; the outputs are
committed, so the tests need no Python:  /usr/bin/python3 make_fixtures.py"""

import numpy as np
from numpy.lib import format as npf


def save(name, arr, version=None):
    with open(name, "wb") as f:
        if version is None:
            np.save(f, arr)
        else:
            npf.write_array(f, arr, version=version)


save("f4_2x3.npy", (np.arange(6, dtype="<f4").reshape(2, 3) * 0.5 - 1).astype("<f4"))
save("f8_exact.npy", np.array([0.5, -2.0, 3.0, np.inf], dtype="<f8"))
save("f8_inexact.npy", np.array([[1.0, 2.0], [0.1, 4.0]], dtype="<f8"))
save("i4_3.npy", np.array([7, -1, 2147483647], dtype="<i4"))
save("i8_fits.npy", np.array([[1, -2], [2**31 - 1, -2**31]], dtype="<i8"))
save("i8_big.npy", np.array([0, 1, 2**40], dtype="<i8"))
save("b1_5.npy", np.array([True, False, True, True, False]))
save("u1_2x2x2.npy", np.arange(8, dtype="|u1").reshape(2, 2, 2))
# bf16 bit patterns of 1.0, -2.5, 0.0, inf (the upper halves of the float32 bits).
save("u2_bf16.npy", (np.array([1.0, -2.5, 0.0, np.inf], dtype="<f4").view("<u4") >> 16).astype("<u2"))
save("f4_scalar.npy", np.array(3.25, dtype="<f4"))
save("f4_0x4.npy", np.zeros((0, 4), dtype="<f4"))
save("i4_v2.npy", np.arange(3, dtype="<i4"), version=(2, 0))
save("i4_v3.npy", np.arange(3, dtype="<i4"), version=(3, 0))
save("f4_fortran.npy", np.asfortranarray(np.arange(6, dtype="<f4").reshape(2, 3)))
save("f4_big_endian.npy", np.arange(3, dtype=">f4"))
save("f2.npy", np.arange(3, dtype="<f2"))
save("record.npy", np.zeros(2, dtype=[("a", "<f4"), ("b", "<i4")]))
