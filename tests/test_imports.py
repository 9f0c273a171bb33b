"""The import graph of src/echo_tp, read from the source (no module is imported): what each
module imports, at the top or inside a function, is compared with the house's one-way flow.

  * no circles among the package's modules (a function-local import counts: it hides one);
  * the kernels import nothing from echo_tp.collective, directly or through what they import
    (the backends that run the kernels sit above them), and the floors below the collective
    (config, quant, compensator, the norm reference, the kernels) nothing above them;
  * imports inside functions are of optional dependencies only: triton (and the package's
    modules that need it: the kernels but fits, the p2p / one-shot / simulated-fused backends,
    symmetric memory), transformers (echo_tp.hf), megatron-core (echo_tp.megatron), vLLM
    (echo_tp.vllm.plugin), gguf, matplotlib;
  * the source names no issue numbers (docstrings say what the code does, not which ticket).
Where to look when it fails: the module and line named; move the shared piece down a floor
(STYLE.md, "Imports tell the truth") rather than importing it inside a function.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
OPTIONAL = ("triton", "transformers", "megatron", "torch.distributed._symmetric_memory",
            "vllm", "gguf", "matplotlib", "echo_tp.hf", "echo_tp.megatron", "echo_tp.vllm.plugin",
            "echo_tp.collective.p2p",
            "echo_tp.collective.oneshot", "echo_tp.collective.symm",
            "echo_tp.collective.simulated_fused")
FLOORS = ("echo_tp.config", "echo_tp.quant", "echo_tp.compensator", "echo_tp.norm_reference",
          "echo_tp.kernels")
ABOVE_FLOORS = ("echo_tp.collective", "echo_tp.communicator", "echo_tp.tp", "echo_tp.models",
                "echo_tp.hf", "echo_tp.megatron", "echo_tp.vllm", "echo_tp.eval", "echo_tp.train",
                "echo_tp.cli", "echo_tp.demo")


def _modules() -> dict[str, tuple[Path, bool]]:
    out = {}
    for p in SRC.rglob("*.py"):
        parts = list(p.relative_to(SRC).with_suffix("").parts)
        pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if pkg else parts)] = (p, pkg)
    return out


MODULES = _modules()


def _imports(name: str) -> list[tuple[str, int, bool]]:
    """(imported module, line, inside a function) of every import in module `name`."""
    path, pkg = MODULES[name]
    tree = ast.parse(path.read_text())
    base = name.split(".") if pkg else name.split(".")[:-1]
    local = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
             for n in ast.walk(f)}
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            out += [(a.name, n.lineno, id(n) in local) for a in n.names]
        elif isinstance(n, ast.ImportFrom):
            mod = ".".join(base[:len(base) - n.level + 1] + ([n.module] if n.module else [])) \
                if n.level else n.module
            for a in n.names:            # `from pkg import module` names the module itself
                sub = f"{mod}.{a.name}"
                named = sub in MODULES or not mod.startswith("echo_tp")
                out.append((sub if named else mod, n.lineno, id(n) in local))
    return out


def _graph() -> dict[str, set[str]]:
    return {m: {t for t, _, _ in _imports(m) if t in MODULES and t != m} for m in MODULES}


def test_no_circles():
    graph, state, circles = _graph(), {}, []

    def visit(m, path):
        state[m] = "open"
        for t in sorted(graph[m]):
            if state.get(t) == "open":
                circles.append(path[path.index(t):] + [t])
            elif t not in state:
                visit(t, path + [t])
        state[m] = "done"
    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not circles, circles


def test_the_floors_import_nothing_above_them():
    graph = _graph()
    for start in (m for m in MODULES if m.startswith(FLOORS)):
        seen, todo = set(), [start]
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo += [t for t in graph[m] if t != "echo_tp"]    # not the package's door
        above = sorted(m for m in seen if m.startswith(ABOVE_FLOORS))
        assert not above, (start, above)
    kernels = {t for m in MODULES if m.startswith("echo_tp.kernels") for t in graph[m]}
    assert not {t for t in kernels if t.startswith("echo_tp.collective")}


def test_function_local_imports_are_optional_dependencies_only():
    bad = [f"{MODULES[m][0].relative_to(SRC)}:{line} imports {t}"
           for m in MODULES for t, line, local in _imports(m)
           if local and not t.startswith(OPTIONAL)
           and not (t.startswith("echo_tp.kernels") and t != "echo_tp.kernels.fits")]
    assert not bad, "\n".join(bad)


def test_no_issue_numbers_in_the_source():
    bad = [f"{p.relative_to(SRC)}:{i}" for p in SRC.rglob("*.py")
           for i, line in enumerate(p.read_text().splitlines(), 1)
           if re.search(r"\b[Ii]ssues? \d+", line)]
    assert not bad, bad
