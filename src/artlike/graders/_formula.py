"""A safe evaluator for a multi grader's `calculate_output`: arithmetic over the sub-graders' scores.

Only these parse: numbers, the given variable names, `+ - * / **` (and `^`, OpenAI's power), unary
`+`/`-`, parentheses, and calls of min, max, abs, sqrt, log, exp, floor, ceil by name. Nothing else
(attributes, subscripts, strings, keywords, other names) gets past `compile_formula`; nothing is eval'd.

    >>> compile_formula("0.5 * a + 0.5 * max(b, 0.2)", {"a", "b"}).evaluate({"a": 1.0, "b": 0.0})
    0.6
    >>> compile_formula("a ^ 2", {"a"}).evaluate({"a": 3.0})
    9.0
    >>> compile_formula("__import__('os')", {"a"})
    Traceback (most recent call last):
    ...
    artlike.graders._errors.FormulaError: calculate_output: '__import__' is not a function here (allowed: abs, ceil, exp, floor, log, max, min, sqrt)
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ._errors import FormulaError

MAX_LENGTH = 1000
MAX_NODES = 200
MAX_EXPONENT = 64.0  # scores live in [0, 1]; a larger power is a typo or an attack
MAX_VALUE = 1e12

_FUNCTIONS: dict[str, tuple[Callable[..., float], int, int | None]] = {  # name: (function, min args, max args)
    "min": (min, 2, None),
    "max": (max, 2, None),
    "abs": (abs, 1, 1),
    "sqrt": (math.sqrt, 1, 1),
    "log": (math.log, 1, 1),
    "exp": (math.exp, 1, 1),
    "floor": (math.floor, 1, 1),
    "ceil": (math.ceil, 1, 1),
}


def _power(base: float, exponent: float) -> float:
    if abs(exponent) > MAX_EXPONENT:
        raise FormulaError(f"calculate_output: exponent {exponent:g} is over the limit of {MAX_EXPONENT:g}")
    result: float | complex = base**exponent
    if isinstance(result, complex):
        raise FormulaError(f"calculate_output: {base:g} ** {exponent:g} is not a real number")
    return result


_BINARY: dict[type[ast.operator], Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: _power,
    ast.BitXor: _power,  # OpenAI's formulas write powers as `^`
}
_UNARY: dict[type[ast.unaryop], Callable[[float], float]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}


@dataclass(frozen=True)
class Formula:
    source: str
    tree: ast.expr
    names: frozenset[str]

    def evaluate(self, values: Mapping[str, float]) -> float:
        """The formula's value; a FormulaError for a domain error, a division by zero or a non-finite result."""
        missing = self.names - values.keys()
        if missing:
            raise FormulaError(f"calculate_output: no value for {sorted(missing)}")
        try:
            result = float(_eval(self.tree, values))
        except (ArithmeticError, ValueError) as e:  # ZeroDivisionError, OverflowError, math domain errors
            raise FormulaError(f"calculate_output {self.source!r}: {e}") from e
        if not math.isfinite(result) or abs(result) > MAX_VALUE:
            raise FormulaError(f"calculate_output {self.source!r} gave {result:g}")
        return result


def _eval(node: ast.expr, values: Mapping[str, float]) -> float:
    # compile_formula already accepted every node, so the casts here cannot fail.
    if isinstance(node, ast.Constant):
        assert isinstance(node.value, int | float)
        return float(node.value)
    if isinstance(node, ast.Name):
        return float(values[node.id])
    if isinstance(node, ast.UnaryOp):
        return _UNARY[type(node.op)](_eval(node.operand, values))
    if isinstance(node, ast.BinOp):
        return _BINARY[type(node.op)](_eval(node.left, values), _eval(node.right, values))
    assert isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    return float(_FUNCTIONS[node.func.id][0](*(_eval(a, values) for a in node.args)))


def _check(node: ast.AST, variables: frozenset[str], used: set[str]) -> None:
    if isinstance(node, ast.Constant):
        # bool is an int subclass: `True` is no number here
        value = node.value
        if type(value) not in (int, float) or not isinstance(value, int | float):
            raise FormulaError(f"calculate_output: {value!r} is not a number")
        if abs(value) > MAX_VALUE:
            raise FormulaError(f"calculate_output: {value:g} is over the limit of {MAX_VALUE:g}")
    elif isinstance(node, ast.Name):
        if node.id not in variables:
            raise FormulaError(f"calculate_output: unknown name {node.id!r} (graders: {sorted(variables)})")
        used.add(node.id)
    elif isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        _check(node.operand, variables, used)
    elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        _check(node.left, variables, used)
        _check(node.right, variables, used)
    elif isinstance(node, ast.Call):
        name = node.func.id if isinstance(node.func, ast.Name) else None
        if name not in _FUNCTIONS:
            shown = name or ast.unparse(node.func)
            raise FormulaError(
                f"calculate_output: {shown!r} is not a function here (allowed: {', '.join(sorted(_FUNCTIONS))})")
        _, low, high = _FUNCTIONS[name]
        if node.keywords or len(node.args) < low or (high is not None and len(node.args) > high):
            raise FormulaError(f"calculate_output: wrong arguments to {name}()")
        for arg in node.args:
            if isinstance(arg, ast.Starred):
                raise FormulaError(f"calculate_output: wrong arguments to {name}()")
            _check(arg, variables, used)
    else:
        raise FormulaError(f"calculate_output: {ast.unparse(node)!r} is not allowed ({type(node).__name__})")


def compile_formula(source: str, variables: set[str] | frozenset[str]) -> Formula:
    """Parse and check `source` against the whitelist; FormulaError names what is not allowed."""
    if len(source) > MAX_LENGTH:
        raise FormulaError(f"calculate_output is longer than {MAX_LENGTH} characters")
    try:
        tree = ast.parse(source.strip(), mode="eval")
    except SyntaxError as e:
        raise FormulaError(f"calculate_output {source!r} does not parse: {e.msg}") from e
    except (ValueError, RecursionError, MemoryError) as e:  # NUL bytes; nesting past the parser's limits
        raise FormulaError(f"calculate_output does not parse: {type(e).__name__}") from e
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise FormulaError(f"calculate_output has more than {MAX_NODES} parts")
    used: set[str] = set()
    _check(tree.body, frozenset(variables), used)
    return Formula(source, tree.body, frozenset(used))
