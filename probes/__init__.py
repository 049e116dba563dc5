"""Every op diag probes, one module each, installed as `diag.probes` (pyproject's package-dir).

A module holds its op's row (`PROBE`, a `diag.plan.probe.Probe`), its ground truth (the call into
`diag.oracle`), its tolerance (a row of `diag.tolerance`, or its own bound), `evaluate` and
`agree`, and its implementation per framework (`on_jax`, `on_torch`; the framework is
imported inside them, in the worker). `diag.plan.registry` discovers the modules; `suites/` holds
the shipped suite files. How to add an op: docs/ops.md.
"""
