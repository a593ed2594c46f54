"""Layers point one way: pallas_kernels <- qwen_jax (the model) <- serving (the engine),
and no two modules import each other, however indirectly (a lazy import inside a function
counts too). Inside `serving`, each subpackage imports only the ones its row of
SERVING_LAYERS names (serving/__init__.py draws the picture).

The `qwen_jax` package's public names include the engine's (`from qwen_jax import LLM`);
`qwen_jax/__init__.py` resolves them by name on first use, never by an import statement,
so importing any module of the model leaves the engine unloaded.
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ("pallas_kernels", "qwen_jax", "serving")  # each may import only those before it


def imported_modules(path: Path) -> set[str]:
    """Every module an import statement in the file names, at any depth (functions too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize("layer", LAYERS[:-1])
def test_no_module_imports_a_layer_above_its_own(layer):
    above = LAYERS[LAYERS.index(layer) + 1:]
    offending = {
        str(path.relative_to(ROOT)): sorted(m for m in imported_modules(path)
                                            if m.split(".")[0] in above)
        for path in sorted((ROOT / layer).rglob("*.py"))}
    assert {path: mods for path, mods in offending.items() if mods} == {}


def test_importing_every_model_module_loads_no_engine_module():
    code = """
import importlib, pkgutil, sys
import qwen_jax
for info in pkgutil.walk_packages(qwen_jax.__path__, "qwen_jax."):
    importlib.import_module(info.name)
print(sorted(m for m in sys.modules if m.split(".")[0] == "serving"))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True, cwd=ROOT)
    assert result.stdout.strip() == "[]"


def test_the_public_names_still_include_the_engine():
    import qwen_jax
    from serving.core.request import SamplingParams
    from serving.entrypoints.llm import LLM
    assert qwen_jax.LLM is LLM and qwen_jax.SamplingParams is SamplingParams
    assert {"LLM", "AsyncLLM", "SamplingParams", "Qwen3ForCausalLM"} <= set(qwen_jax.__all__)


# subpackage -> the subpackages it may import. "core:" and "engine:" entries name the only
# modules of those subpackages it may import (their public face).
CORE_TYPES = {"core:request", "core:config", "core:structured_params", "core:lora_request"}
ENGINE_PUBLIC = {"engine:llm_engine", "engine:config", "engine:async_llm", "engine:process",
                 "engine:data_parallel", "engine:exceptions", "engine:multihost"}
SERVING_LAYERS: dict[str, set[str]] = {
    "core": set(),
    "parsers": {"core"},
    "structured_output": {"core"},
    "metrics": {"core"},
    "sample": {"core", "structured_output"},
    "executor": {"core", "structured_output", "sample"},
    "engine": {"core", "parsers", "structured_output", "metrics", "sample", "executor"},
    "entrypoints": CORE_TYPES | ENGINE_PUBLIC | {"parsers", "metrics"},
    "bench": CORE_TYPES | ENGINE_PUBLIC | {"parsers", "metrics", "entrypoints"},
    "cli": CORE_TYPES | ENGINE_PUBLIC | {"parsers", "metrics", "entrypoints", "bench"},
}


def serving_module_of(name: str) -> tuple[str, str] | None:
    """("executor", "model_runner") for serving.executor.model_runner[.Name]; None outside
    serving's subpackages (serving itself, serving/eval_tasks.py: the old command's name)."""
    parts = name.split(".")
    if parts[0] != "serving" or len(parts) < 2 or parts[1] not in SERVING_LAYERS:
        return None
    return parts[1], parts[2] if len(parts) > 2 else ""


def allowed(importer: str, imported: tuple[str, str]) -> bool:
    package, module = imported
    if package == importer:
        return True
    rules = SERVING_LAYERS[importer]
    return package in rules or f"{package}:{module}" in rules


def test_every_serving_subpackage_is_in_the_table():
    packages = {p.parent.name for p in (ROOT / "serving").glob("*/__init__.py")}
    assert packages == set(SERVING_LAYERS)


def test_each_serving_subpackage_imports_only_what_its_row_allows():
    offending = {}
    for path in sorted((ROOT / "serving").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        importer = serving_module_of(".".join(parts))
        if importer is None:
            continue
        # "from serving.core import request" names serving.core.request too: keep the
        # deepest name of each import, so a package's own name never hides its module
        names = imported_modules(path)
        bad = sorted(m for m in names if (target := serving_module_of(m)) is not None
                     and target[1] and not allowed(importer[0], target)
                     and not any(n.startswith(m + ".") and serving_module_of(n) is not None
                                 and allowed(importer[0], serving_module_of(n))
                                 for n in names))
        if bad:
            offending[str(path.relative_to(ROOT))] = bad
    assert offending == {}


def test_the_layer_rule_catches_a_forbidden_import():
    assert not allowed("core", ("engine", "llm_engine"))
    assert not allowed("entrypoints", ("core", "scheduler"))
    assert not allowed("entrypoints", ("executor", "model_runner"))
    assert allowed("entrypoints", ("engine", "exceptions"))
    assert not allowed("parsers", ("metrics", "prometheus"))
    assert allowed("sample", ("structured_output", "grammar"))


def test_every_serving_package_says_what_it_holds_and_may_import():
    for init in (ROOT / "serving").glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "import" in doc.lower(), init


def project_modules() -> dict[str, Path]:
    modules = {}
    for layer in LAYERS:
        for path in (ROOT / layer).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def import_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the directed graph as a list of modules, or None."""
    state: dict[str, str] = {}  # "open" while on the DFS stack, then "done"

    def visit(node: str, stack: list[str]) -> list[str] | None:
        state[node] = "open"
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                return stack[stack.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep, stack + [dep])):
                return cycle
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node, [node])):
            return cycle
    return None


def test_project_modules_import_each_other_without_cycles():
    modules = project_modules()
    # A package's own submodules may import it (its __init__ runs first anyway).
    graph = {name: {m for m in imported_modules(path) if m in modules
                    and not name.startswith(m + ".") and m != name}
             for name, path in modules.items()}
    assert import_cycle(graph) is None


def test_the_cycle_finder_finds_cycles():
    assert import_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert import_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_imports_inside_functions_are_seen(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("import os\n\ndef f():\n    from qwen_jax.weights import load_model\n")
    assert imported_modules(module) == {"os", "qwen_jax.weights", "qwen_jax.weights.load_model"}


def test_the_engine_imports_without_jaxtyping():
    # The GPU image runs the checkout with only jax/flax/orbax/aiohttp/tokenizers and a
    # few more installed: shape annotations must not need jaxtyping at import time.
    code = ("import sys; sys.modules['jaxtyping'] = None\n"
            "import serving.engine.llm_engine, serving.executor.model_runner\n"
            "import qwen_jax.model, pallas_kernels\n"
            "from pallas_kernels.array_types import Float\n"
            "assert Float[int, 'T D'] is int\n"
            "print('ok')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
