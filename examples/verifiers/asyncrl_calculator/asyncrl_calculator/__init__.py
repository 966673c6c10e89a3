"""asyncrl-calculator: arithmetic questions answered with a calculator tool, a verifiers v1
taskset (`CalculatorTaskset`, id `asyncrl-calculator`) with a shared MCP tool server
(`CalculatorToolset`, tool `calc_calculate`). Runs with verifiers' own single-agent env; pin an
MCP-speaking harness (`--env.agent.harness.id null`)."""

from __future__ import annotations

from typing import Any

__all__ = ["CalculatorTaskset"]


def __getattr__(name: str) -> Any:
    """`CalculatorTaskset`, imported on first use. verifiers starts the tool server as
    `python -m asyncrl_calculator.tools`, which imports this package first: importing the
    taskset here, and with it the tools module, would load that module twice (runpy warns)."""
    if name == "CalculatorTaskset":
        from asyncrl_calculator.taskset import CalculatorTaskset

        return CalculatorTaskset
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
