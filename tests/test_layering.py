"""The house's layers (docs/architecture.md), checked from the imports themselves: an AST pass
over every module of `asyncrl/` (every `import`, also inside functions and under
`TYPE_CHECKING`), not substrings. No module imports a higher layer; no circle among the
imports that run (a `TYPE_CHECKING` import never runs); `core/` imports no torch.distributed,
Ray, vLLM or transformers; `asyncrl.config` loads no torch. STYLE.md rule 1: the core and the
threads backend never import Ray; only `asyncrl/distributed/` does, and only when
`rollout.backend=ray` asks for it."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "asyncrl"

LAYERS: list[tuple[str, ...]] = [
    ("asyncrl.faults", "asyncrl.core"),
    ("asyncrl.config",),
    ("asyncrl.checkpoint", "asyncrl.tasks"),
    ("asyncrl.models",),
    ("asyncrl.algos", "asyncrl.rollout", "asyncrl.agents"),
    ("asyncrl.distributed",),
    ("asyncrl.train",),
    ("asyncrl.cli", "asyncrl.examples"),
]
"""Lowest first: a module may import its own layer's modules and lower layers', never a higher
layer's (docs/architecture.md says what each holds)."""

CORE_FORBIDDEN = ("torch.distributed", "ray", "vllm", "transformers")


def layer_of(module: str) -> int:
    for index, packages in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in packages):
            return index
    raise AssertionError(f"{module}: in no layer; add its package to LAYERS")


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(source: str, module: str, is_package: bool) -> tuple[set[str], set[str]]:
    """(every imported name, those that run: not under `if TYPE_CHECKING:`), absolute."""
    tree = ast.parse(source)
    type_only = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for stmt in node.body
        for n in ast.walk(stmt)
    }
    every, running = set(), set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = module.split(".")[: len(module.split(".")) - node.level + is_package]
                base = ".".join([*here, base] if base else here)
            names = [base, *(f"{base}.{a.name}" for a in node.names)]
        every.update(names)
        if id(node) not in type_only:
            running.update(names)
    return every, running


def import_graph(root: Path = PACKAGE) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """module -> the modules of the package it imports (every import; those that run)."""
    sources = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    every: dict[str, set[str]] = {}
    running: dict[str, set[str]] = {}
    for name, path in sources.items():
        all_names, run_names = imports_of(path.read_text(), name, path.name == "__init__.py")
        every[name] = {n for n in all_names if n in sources and n != name}
        running[name] = {n for n in run_names if n in sources and n != name}
    return every, running


def external_imports(root: Path = PACKAGE) -> dict[str, set[str]]:
    out = {}
    for path in sorted(root.rglob("*.py")):
        name = module_name(path, root)
        out[name] = imports_of(path.read_text(), name, path.name == "__init__.py")[0]
    return out


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def upward_arrows(graph: dict[str, set[str]]) -> list[str]:
    return [
        f"{a} (layer {layer_of(a)}) imports {b} (layer {layer_of(b)})"
        for a in sorted(graph)
        if a != "asyncrl"
        for b in sorted(graph[a])
        if layer_of(b) > layer_of(a)
    ]


def test_no_module_imports_a_higher_layer():
    every, _ = import_graph()
    assert upward_arrows(every) == []


def test_no_import_circle():
    _, running = import_graph()
    assert circles(running) == []


def test_core_imports_no_distributed_ray_vllm_or_transformers():
    for module, names in external_imports().items():
        if module.startswith("asyncrl.core"):
            bad = sorted(
                n for n in names for f in CORE_FORBIDDEN if n == f or n.startswith(f + ".")
            )
            assert bad == [], f"{module} imports {bad}"


def test_the_checks_catch_a_circle_an_upward_arrow_and_a_forbidden_import(tmp_path):
    """Negative controls on a small synthetic package: each check fails where it should."""
    root = tmp_path / "asyncrl"
    for sub in ("core", "train", "cli"):
        (root / sub).mkdir(parents=True)
        (root / sub / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    (root / "core" / "a.py").write_text("from asyncrl.train import b\nimport transformers\n")
    (root / "train" / "b.py").write_text("from . import c\n")
    (root / "train" / "c.py").write_text(
        "from typing import TYPE_CHECKING\nfrom asyncrl.train.b import x\n"
        "if TYPE_CHECKING:\n    from asyncrl.cli import d\n"
    )
    (root / "cli" / "d.py").write_text("def f():\n    from ..train import b\n")
    every, running = import_graph(root)
    assert every["asyncrl.cli.d"] == {"asyncrl.train", "asyncrl.train.b"}  # relative, in a def
    assert circles(running) == [["asyncrl.train.b", "asyncrl.train.c"]]
    assert upward_arrows(every) == [
        "asyncrl.core.a (layer 0) imports asyncrl.train (layer 6)",
        "asyncrl.core.a (layer 0) imports asyncrl.train.b (layer 6)",
        "asyncrl.train.c (layer 6) imports asyncrl.cli (layer 7)",
        "asyncrl.train.c (layer 6) imports asyncrl.cli.d (layer 7)",
    ]
    assert "transformers" in external_imports(root)["asyncrl.core.a"]
    assert "asyncrl.cli.d" not in running["asyncrl.train.c"]  # a TYPE_CHECKING import never runs


@pytest.mark.slow
def test_importing_the_config_package_loads_no_torch():
    code = (
        "import sys, asyncrl.config, asyncrl.config.keys\n"
        "from asyncrl.config.keys import build_config\n"
        "build_config({'algo': {'name': 'ppo'}})\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr


CORE_AND_THREADS = [
    "asyncrl.core.buffer", "asyncrl.core.ledger", "asyncrl.core.stream", "asyncrl.core.window",
    "asyncrl.core.advantages", "asyncrl.core.losses", "asyncrl.core.resume",
    "asyncrl.rollout.collector", "asyncrl.rollout.engine", "asyncrl.rollout.torch_engine",
    "asyncrl.rollout.weight_sync", "asyncrl.rollout.scorer", "asyncrl.algos.grpo",
    "asyncrl.algos.ppo", "asyncrl.algos.rloo", "asyncrl.checkpoint.snapshot",
    "asyncrl.train.trainer", "asyncrl.train.components", "asyncrl.cli.main",
]  # fmt: skip


def run_without_ray(code: str) -> subprocess.CompletedProcess[str]:
    prelude = "import sys; sys.modules['ray'] = None\n"  # any `import ray` now raises
    return subprocess.run(
        [sys.executable, "-c", prelude + code], capture_output=True, text=True, timeout=120
    )


@pytest.mark.slow
def test_the_core_and_the_threads_backend_import_without_ray():
    imports = "\n".join(f"import {name}" for name in CORE_AND_THREADS)
    done = run_without_ray(imports + "\nprint('ok')")
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


@pytest.mark.slow
def test_the_check_itself_catches_a_ray_import():  # negative control
    done = run_without_ray("import asyncrl.distributed.worker")
    assert done.returncode != 0 and "ray" in done.stderr


def test_the_trainer_names_no_algorithm_and_no_engine_class():
    """STYLE.md rule 13: the loop never branches on the algorithm; which algorithm and which
    engine a run uses is decided in one place (train/components.py, through the registries)."""
    from pathlib import Path

    import asyncrl.train.trainer as trainer

    source = Path(trainer.__file__).read_text()
    for name in (
        "GRPO",
        "PPO",
        "RLOO",
        "grpo",
        "ppo",
        "rloo",
        "TorchGenerationEngine",
        "RayEngine",
    ):
        assert name not in source, name
