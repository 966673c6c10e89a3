"""The arithmetic behind the calculator environment, free of verifiers: the calculator's safe
evaluation, the questions and their split, and the reading of a final answer from a reply."""

from __future__ import annotations

import ast
import hashlib
import random
import re
from collections.abc import Iterator
from fractions import Fraction

MAX_EXPRESSION_CHARS = 200
"""Longer expressions are refused: with + - * / only, 200 characters bound a result's size."""

_OPERATORS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
}


class CalculationError(ValueError):
    """An expression the calculator does not evaluate; the message says why."""


def evaluate(expression: str) -> Fraction:
    """The exact value of `expression`, which may hold numbers (integers or decimals), + - * /,
    unary + and -, and parentheses. The expression is parsed with `ast` and walked node by node;
    nothing is passed to `eval`. Raises CalculationError for anything else, for division by
    zero, and for an expression over MAX_EXPRESSION_CHARS characters."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculationError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise CalculationError(f"cannot parse {expression!r}") from None
    return _value(tree.body)


def _value(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, int | float):
            raise CalculationError(f"not a number: {node.value!r}")
        # A decimal is read as written (repr(0.1) == '0.1'), not as its nearest binary float.
        return Fraction(repr(node.value))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.UAdd | ast.USub):
        operand = _value(node.operand)
        return -operand if isinstance(node.op, ast.USub) else operand
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Div) and right == 0:
            raise CalculationError("division by zero")
        return _OPERATORS[type(node.op)](left, right)
    raise CalculationError(f"unsupported: {ast.unparse(node)!r} (use numbers, + - * / and ( ))")


def format_number(value: Fraction) -> str:
    """`value` as the calculator prints it: an integer exactly ("444"), anything else as a
    decimal rounded to 6 places ("3.5", "0.333333")."""
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.6f}".rstrip("0").rstrip(".")


def calculate(expression: str) -> str:
    """What the calculator tool answers: the value of `expression` (see `evaluate`) as
    `format_number` writes it, or "error: <why>" when it cannot be evaluated."""
    try:
        return format_number(evaluate(expression))
    except CalculationError as e:
        return f"error: {e}"


_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?")
"""A number in a reply: digits with an optional sign and decimals, or thousands groups split
by commas ("1,234")."""


def last_number(text: str) -> Fraction | None:
    """The last number written in `text` (see `_NUMBER`), or None when it holds none."""
    found = _NUMBER.findall(text)
    return Fraction(found[-1].replace(",", "")) if found else None


def is_correct(reply: str, answer: int) -> bool:
    """Whether the last number in `reply` equals `answer`."""
    return last_number(reply) == answer


SPLIT_SEEDS = {"train": 20250101, "test": 20250202}
"""Each split draws its questions from its own random stream."""

QUESTION = "What is {expression}? Use the calculator tool, then give the final answer as a number."


def split_of(expression: str) -> str:
    """The split an expression belongs to: "test" for about a quarter of all expressions (by
    the first byte of the expression's SHA-256), "train" for the rest. Each split keeps only its
    own expressions, so no question is in both."""
    return "test" if hashlib.sha256(expression.encode()).digest()[0] < 64 else "train"


def _draw(rng: random.Random) -> tuple[str, int]:
    op = rng.choice("+-*")
    if op == "*":
        a, b = rng.randint(2, 30), rng.randint(2, 30)
    else:
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        if op == "-" and a < b:
            a, b = b, a  # answers stay at or above zero
    answer = {"+": a + b, "-": a - b, "*": a * b}[op]
    return f"{a} {op} {b}", answer


def questions(split: str, num_tasks: int) -> Iterator[tuple[str, int]]:
    """The first `num_tasks` (expression, answer) pairs of `split`: two operands joined by
    + (2-99), - (2-99, never below zero) or * (2-30), the same on every call. An expression
    may repeat within a split, never across splits (see `split_of`)."""
    if split not in SPLIT_SEEDS:
        raise ValueError(f"split must be one of {sorted(SPLIT_SEEDS)}, not {split!r}")
    rng = random.Random(SPLIT_SEEDS[split])
    made = 0
    while made < num_tasks:
        expression, answer = _draw(rng)
        if split_of(expression) == split:
            made += 1
            yield expression, answer
