"""The gate: a run held against what was accepted before.

`baseline` writes and reads a baseline, `drift` and `record_drift` say what moved and why
(once per cause), `junit` writes the result for a CI system.
"""
