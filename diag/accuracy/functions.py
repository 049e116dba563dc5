"""The elementwise functions of the accuracy tables, as data: one row per function.

Each row says what the function is (its exact value, in mpmath, written where it could
cancel in a form that cannot: `x * sigmoid(2z)` for gelu_tanh's `x/2 * (1 + tanh z)`), its
domain, a float64 formula the fast path of the ground truth evaluates (`diag.accuracy.truth`
proves each of its roundings), the op each framework calls so that rows compare (a dotted
path and its keyword arguments, resolved only inside the worker that runs that framework),
and the points near which the float32 samples look hardest (zeros, thresholds).

The float64 formulas call Python's `math` (the platform's libm) for every transcendental
function and numpy only for +, -, *, / and sqrt, which IEEE rounds correctly. Their error
analysis, which the proof in `diag.accuracy.truth` relies on, is written beside each formula
and in docs/accuracy.md: every one stays below 2^-40 relative (or 2^-1000 absolute where
float64 itself underflows), well inside the 2^-36 the proof allows.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["ElementwiseFunction", "FUNCTIONS", "JAX_SETTINGS", "get_function"]

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)  # relative error <= 2^-53: inside the bound
_GELU_TANH_C = 0.044715


def _libm(fn: Callable[[float], float]) -> Callable[[np.ndarray], np.ndarray]:
    """A `math` function over a float64 array (the platform libm: glibc documents <= 3 ulp
    for each function used here)."""
    vec = np.frompyfunc(fn, 1, 1)
    return lambda x: np.asarray(vec(x), dtype=np.float64)


def _or_inf(fn: Callable[[float], float]) -> Callable[[float], float]:
    """`fn`, with float64 overflow as inf (math raises OverflowError): the exact value is
    then above 2^1023, so above every dtype's overflow threshold, and rounds to inf."""

    def safe(v: float) -> float:
        try:
            return fn(v)
        except OverflowError:
            return math.inf

    return safe


_exp = _libm(_or_inf(math.exp))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    # x >= 0: 1/(1+e^-x), e^-x in (0, 1]; x < 0: e^x/(1+e^x): no cancellation, <= 4 ulp.
    # e^x underflows float64 below x = -708: the result is then < 2^-1000 (absolute term).
    e = _exp(-np.abs(x))
    with np.errstate(over="ignore"):
        return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def _softplus(x: np.ndarray) -> np.ndarray:
    # max(x, 0) + log1p(e^-|x|): a sum of non-negative terms, log1p's argument carries e^'s
    # relative error, which log1p damps (d log1p(y) / log1p(y) <= dy / y).
    return np.maximum(x, 0.0) + _libm(math.log1p)(_exp(-np.abs(x)))


def _gelu(x: np.ndarray) -> np.ndarray:
    # x * erfc(-x / sqrt 2) / 2. erfc's argument t carries 2^-52 relative error, amplified by
    # t * erfc'(t) / erfc(t) <= 2 t^2 + 2 <= 1460 while erfc is normal in float64 (t < 26.6):
    # < 2^-41; beyond, erfc is below 2^-1022 and |x| * erfc(t) below 2^-1000.
    t = -x * (1.0 / math.sqrt(2.0))
    return 0.5 * x * _libm(math.erfc)(t)


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    # x/2 * (1 + tanh z) == x * sigmoid(2z), z = sqrt(2/pi) (x + 0.044715 x^3): x and x^3
    # have one sign, so z carries <= 5 ulp; sigmoid(2z) amplifies it by <= |2z| (1 -
    # sigmoid(2z)), below 1500 while e^(2z) is normal: < 2^-40.
    with np.errstate(over="ignore"):
        z = _SQRT_2_OVER_PI * (x + _GELU_TANH_C * (x * x * x))
    return x * _sigmoid(2.0 * z)


def _mp_sigmoid(mp: Any, x: Any) -> Any:
    return 1 / (1 + mp.exp(-x))


@dataclass(frozen=True)
class ElementwiseFunction:
    """One function of the tables.

    Attributes:
      name: what users type (`--function`) and rows carry.
      domain: the inputs it is defined on, in words (`x > 0`).
      in_domain: that domain over a float64 array (every finite input outside it is left out).
      approx: the float64 formula of the fast path (see the module docstring).
      exact: the exact value with mpmath (`exact(mp, x)` at mp's working precision).
      jax, torch: the op each framework calls, a dotted path and its keyword arguments.
      lax: the `jax.lax` op that takes `accuracy=` (a row per `JAX_SETTINGS` entry), or ''.
      special: float32 inputs near which samples concentrate (zeros, thresholds).
      approach: the side from which f(x) nears a power of two 2^k too closely for mpmath at
        `diag.accuracy.truth` 's last precision to tell (tanh(100) = 1 - 2^-288...): -1 from
        below in magnitude (tanh, erf, sigmoid near 1; gelu, silu near x = 2^k), +1 from above
        (softplus(x) = x + log1p(e^-x)), 0 where such a value is the power of two itself
        (sqrt(4), 1/2: algebraic functions). Only the ulp of such a value depends on it.
    """

    name: str
    domain: str
    in_domain: Callable[[np.ndarray], np.ndarray]
    approx: Callable[[np.ndarray], np.ndarray]
    exact: Callable[[Any, Any], Any]
    jax: tuple[str, dict[str, Any]]
    torch: tuple[str, dict[str, Any]]
    lax: str = ""
    special: tuple[float, ...] = field(default_factory=tuple)
    approach: int = -1

    def call(self, framework: str) -> tuple[str, dict[str, Any]]:
        """The op `framework` (jax, torch; torch_xla runs torch's) calls for this function."""
        return self.jax if framework == "jax" else self.torch


def _everywhere(x: np.ndarray) -> np.ndarray:
    return np.ones(x.shape, dtype=bool)


_F = ElementwiseFunction
# Overflow and underflow thresholds of float32/bfloat16 (log of max, of the smallest normal
# and subnormal) and of float16, where exp-like functions change regime.
_EXP_EDGES = (88.72284, -87.33654, -103.27893, -103.97208, 11.0904, -9.7041, -17.3287)

FUNCTIONS: dict[str, ElementwiseFunction] = {
    f.name: f
    for f in (
        _F(
            "exp",
            "all x",
            _everywhere,
            _exp,
            lambda mp, x: mp.exp(x),
            ("jax.numpy.exp", {}),
            ("torch.exp", {}),
            "exp",
            (0.0, *_EXP_EDGES),
        ),
        _F(
            "log",
            "x > 0",
            lambda x: x > 0,
            _libm(math.log),
            lambda mp, x: mp.log(x),
            ("jax.numpy.log", {}),
            ("torch.log", {}),
            "log",
            (1.0, 2.0, 0.5),
        ),
        _F(
            "log1p",
            "x > -1",
            lambda x: x > -1,
            _libm(math.log1p),
            lambda mp, x: mp.log1p(x),
            ("jax.numpy.log1p", {}),
            ("torch.log1p", {}),
            "log1p",
            (0.0, -0.5, 1.0),
        ),
        _F(
            "expm1",
            "all x",
            _everywhere,
            _libm(_or_inf(math.expm1)),
            lambda mp, x: mp.expm1(x),
            ("jax.numpy.expm1", {}),
            ("torch.expm1", {}),
            "expm1",
            (0.0, *_EXP_EDGES),
        ),
        _F(
            "tanh",
            "all x",
            _everywhere,
            _libm(math.tanh),
            lambda mp, x: mp.tanh(x),
            ("jax.numpy.tanh", {}),
            ("torch.tanh", {}),
            "tanh",
            (0.0, 0.55, 9.01),
        ),
        _F(
            "sin",
            "all x",
            _everywhere,
            _libm(math.sin),
            lambda mp, x: mp.sin(x),
            ("jax.numpy.sin", {}),
            ("torch.sin", {}),
            "sin",
            tuple(k * math.pi for k in (0, 1, -1, 2, 10, 100, 1000, 102_944)),
        ),
        _F(
            "cos",
            "all x",
            _everywhere,
            _libm(math.cos),
            lambda mp, x: mp.cos(x),
            ("jax.numpy.cos", {}),
            ("torch.cos", {}),
            "cos",
            tuple((k + 0.5) * math.pi for k in (0, 1, -1, 10, 100, 1000, 102_944)),
        ),
        _F(
            "sqrt",
            "x >= 0",
            lambda x: x >= 0,
            np.sqrt,
            lambda mp, x: mp.sqrt(x),
            ("jax.numpy.sqrt", {}),
            ("torch.sqrt", {}),
            "sqrt",
            (1.0, 2.0),
            approach=0,
        ),
        _F(
            "erf",
            "all x",
            _everywhere,
            _libm(math.erf),
            lambda mp, x: mp.erf(x),
            ("jax.scipy.special.erf", {}),
            ("torch.erf", {}),
            "",
            (0.0, 0.5, 3.9, 5.9),
        ),
        _F(
            "sigmoid",
            "all x",
            _everywhere,
            _sigmoid,
            _mp_sigmoid,
            ("jax.nn.sigmoid", {}),
            ("torch.sigmoid", {}),
            "logistic",
            (0.0, 16.64, 17.33, -87.33654, -103.97208, -16.64),
        ),
        _F(
            "rsqrt",
            "x > 0",
            lambda x: x > 0,
            lambda x: 1.0 / np.sqrt(x),
            lambda mp, x: 1 / mp.sqrt(x),
            ("jax.lax.rsqrt", {}),
            ("torch.rsqrt", {}),
            "rsqrt",
            (1.0, 2.0, 4.0),
            approach=0,
        ),
        _F(
            "reciprocal",
            "x != 0",
            lambda x: x != 0,
            lambda x: 1.0 / x,
            lambda mp, x: 1 / x,
            ("jax.numpy.reciprocal", {}),
            ("torch.reciprocal", {}),
            "",
            (1.0, 2.0**126, 2.0**-126, 3.0),
            approach=0,
        ),
        _F(
            "gelu",
            "all x",
            _everywhere,
            _gelu,
            lambda mp, x: x * mp.erfc(-x / mp.sqrt(2)) / 2,
            ("jax.nn.gelu", {"approximate": False}),
            ("torch.nn.functional.gelu", {}),
            "",
            (0.0, -0.7517916, -4.0, -10.0, -13.0),
        ),
        _F(
            "gelu_tanh",
            "all x",
            _everywhere,
            _gelu_tanh,
            lambda mp, x: (
                x * _mp_sigmoid(mp, 2 * mp.sqrt(2 / mp.pi) * (x + mp.mpf("0.044715") * x**3))
            ),
            ("jax.nn.gelu", {"approximate": True}),
            ("torch.nn.functional.gelu", {"approximate": "tanh"}),
            "",
            (0.0, -0.7517916, -4.0, -10.0),
        ),
        _F(
            "silu",
            "all x",
            _everywhere,
            lambda x: x * _sigmoid(x),
            lambda mp, x: x * _mp_sigmoid(mp, x),
            ("jax.nn.silu", {}),
            ("torch.nn.functional.silu", {}),
            "",
            (0.0, -1.2784645, -20.0, -90.0),
        ),
        _F(
            "softplus",
            "all x",
            _everywhere,
            _softplus,
            lambda mp, x: mp.log1p(mp.exp(x)),
            ("jax.nn.softplus", {}),
            ("torch.nn.functional.softplus", {}),
            "",
            (0.0, 20.0, -20.0, -87.33654, -103.97208),
        ),
    )
}

#: JAX's accuracy settings of transcendental lax ops (`accuracy=`): a row per setting, for
#: the functions whose row names a `lax` op. The key is what rows carry as `setting`.
JAX_SETTINGS: dict[str, tuple[str, dict[str, Any]]] = {
    "accuracy=highest": ("AccuracyMode", {"name": "HIGHEST"}),
    "accuracy=default": ("AccuracyMode", {"name": "DEFAULT"}),
    "accuracy=tolerance(ulps=1)": ("Tolerance", {"atol": 0.0, "rtol": 0.0, "ulps": 1}),
}


def get_function(name: str) -> ElementwiseFunction:
    """The row of `name`; raises `UsageError` naming the known functions."""
    from diag.errors import UsageError

    try:
        return FUNCTIONS[name]
    except KeyError:
        raise UsageError(
            f"unknown function '{name}'; known functions: {', '.join(FUNCTIONS)}"
        ) from None
