"""Read a chain of elementwise arithmetic as a polynomial in its input tensors.

Activations spelt out in primitives come in many orderings: ``x * 0.5 * (1 + t)``,
``(x * 0.5) * (1 + t)``, ``0.5 * ((1 + t) * x)``, ``x / 6 * c``, ``c * x * (1/6)`` ... Matching each
ordering node by node is endless; reading the chain as a polynomial in its leaves (``x``, the Erf /
Tanh / Clip output) turns every ordering into the same small dict, which one comparison checks.
Only tensors read by a single node are walked through, so every node of a match can be removed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx

from pulsar.frontend.passes.pattern import CONST_RTOL, FusionContext, close

# Monomial: sorted ((tensor name, power), ...); () is the constant term.
Monomial = tuple[tuple[str, int], ...]
Poly = dict[Monomial, float]

MAX_DEGREE = 6
MAX_NODES = 24
_OPS = ("Add", "Sub", "Mul", "Div", "Neg", "Pow")


def var(name: str, power: int = 1) -> Monomial:
    return ((name, power),)


def mono(*names: str) -> Monomial:
    """Product of the named variables (a name given twice is squared)."""
    powers: dict[str, int] = {}
    for name in names:
        powers[name] = powers.get(name, 0) + 1
    return tuple(sorted(powers.items()))


def _degree(m: Monomial) -> int:
    return sum(p for _, p in m)


def _add(a: Poly, b: Poly, sign: float = 1.0) -> Poly:
    out = dict(a)
    for m, c in b.items():
        out[m] = out.get(m, 0.0) + sign * c
    return out


def _mul(a: Poly, b: Poly) -> Poly | None:
    out: Poly = {}
    for ma, ca in a.items():
        for mb, cb in b.items():
            powers = dict(ma)
            for name, p in mb:
                powers[name] = powers.get(name, 0) + p
            m = tuple(sorted(powers.items()))
            if _degree(m) > MAX_DEGREE:
                return None
            out[m] = out.get(m, 0.0) + ca * cb
    return out


@dataclass
class Expr:
    poly: Poly
    nodes: list[onnx.NodeProto] = field(default_factory=list)
    const_ndim: int = 0  # highest rank among the constants: they must not broadcast the result up

    @property
    def variables(self) -> set[str]:
        return {name for m in self.poly for name, _ in m}


class PolyReader:
    """Reads tensors as polynomials; ``stop`` names tensors that are leaves even if private."""

    def __init__(self, ctx: FusionContext, stop: set[str] | None = None) -> None:
        self.ctx = ctx
        self.stop = stop or set()

    def read(self, name: str, top: bool = True) -> Expr:
        """``top``: ``name`` is the pattern's result, so its readers do not matter."""
        ctx = self.ctx
        value = ctx.const(name)
        if value is not None and value.size == 1 and value.dtype.kind == "f":
            return Expr({(): float(value.ravel()[0])}, [], value.ndim)
        leaf = Expr({var(name): 1.0})
        if value is not None or name in self.stop or (not top and not ctx.private(name)):
            return leaf
        node = ctx.node(name, *_OPS)
        if node is None or len(node.output) != 1:
            return leaf
        expr = self._combine(node)
        if expr is None or len({id(n) for n in expr.nodes}) > MAX_NODES:
            return leaf
        return expr

    def _combine(self, node: onnx.NodeProto) -> Expr | None:
        args = [self.read(i, top=False) for i in node.input]
        op = node.op_type
        if op == "Neg":
            poly: Poly | None = {m: -c for m, c in args[0].poly.items()}
        elif len(args) != 2:
            return None
        elif op in ("Add", "Sub"):
            poly = _add(args[0].poly, args[1].poly, 1.0 if op == "Add" else -1.0)
        elif op == "Mul":
            poly = _mul(args[0].poly, args[1].poly)
        elif op == "Div":
            divisor = args[1].poly
            if set(divisor) != {()} or divisor[()] == 0.0:
                return None
            poly = {m: c / divisor[()] for m, c in args[0].poly.items()}
        else:  # Pow with a small non-negative integer exponent
            exponent = args[1].poly
            power = exponent.get((), -1.0)
            if set(exponent) != {()} or not power.is_integer() or not 0 <= power <= MAX_DEGREE:
                return None
            poly = {(): 1.0}
            for _ in range(int(power)):
                poly = _mul(poly, args[0].poly) if poly is not None else None
        if poly is None:
            return None
        nodes = [n for a in args for n in a.nodes] + [node]
        return Expr(poly, nodes, max(a.const_ndim for a in args))


def matches(poly: Poly, target: Poly, rtol: float = CONST_RTOL) -> bool:
    """Same monomials (ignoring exact cancellations) with coefficients within ``rtol``."""
    scale = max((abs(c) for c in target.values()), default=1.0)
    present = {m for m, c in poly.items() if abs(c) > 1e-9 * scale}
    return present == set(target) and all(close(poly[m], c, rtol) for m, c in target.items())


def single_variable(expr: Expr) -> str | None:
    names = expr.variables
    return next(iter(names)) if len(names) == 1 else None


def affine(expr: Expr, x: str) -> tuple[float, float] | None:
    """(a, b) if ``expr`` is a*x + b."""
    if not set(expr.poly) <= {(), var(x)}:
        return None
    return expr.poly.get(var(x), 0.0), expr.poly.get((), 0.0)


def forward_match(
    ctx: FusionContext, start: str, stop: set[str], accept, max_steps: int = 6
) -> tuple[Expr, onnx.NodeProto | None] | None:
    """Follow the single reader of ``start`` through arithmetic and return the first accepted chain.

    ``accept(expr)`` decides whether the polynomial read back from a candidate result is the
    pattern; the zero-step candidate (``start`` itself) is tried first.
    """
    reader = PolyReader(ctx, stop)
    expr = reader.read(start)
    if accept(expr):
        return expr, None
    current = start
    for _ in range(max_steps):
        node = ctx.sole_reader(current, *_OPS)
        if node is None or len(node.output) != 1:
            return None
        current = node.output[0]
        expr = reader.read(current)
        if accept(expr):
            return expr, node
    return None


def consts_fit(ctx: FusionContext, expr: Expr, x: str) -> bool:
    """The constants do not broadcast ``x`` to a higher rank (a size-1 constant may have any rank <= x's)."""
    rank = ctx.rank(x)
    return expr.const_ndim <= (rank if rank is not None else 1)
