"""Arithmetic: which arithmetic a backend's matmul really uses.

`precision` fingerprints a matmul with crafted inputs, `features` measures its unit's
features (exact products, extra bits, rounding, block FMA), `unit_model` is the numpy model
of such a unit, `dot_algorithms` the emulated dot algorithms (BF16_BF16_F32, TF32, ...).
"""
