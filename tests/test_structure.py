"""The import graph read from the source (pure AST, nothing imported): no cycles between
modules, layers that keep to their side, and model files that share code through
models/layers.py instead of each other's private names."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("jaxdist", "models", "sharding", "ps", "experiments", "analysis")
MODEL_FILES_SHARED = {"models.layers", "models.registry", "models.fp8"}  # not model families


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def source_modules(packages=PACKAGES) -> dict[str, Path]:
    """Module name -> file, for every .py file under the given top-level packages."""
    return {module_name(p): p for pkg in packages for p in sorted((ROOT / pkg).rglob("*.py"))}


def imports_of(path: Path, known: set[str]) -> list[tuple[str, str, int]]:
    """(module, imported name or "", line) of every import in `path` (module level or inside
    functions) that resolves to a module in `known`. `from pkg import mod` counts as an
    import of pkg.mod when that is a module, else as importing `mod` from pkg."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, "", node.lineno) for a in node.names if a.name in known]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in known:
                    out.append((sub, "", node.lineno))
                elif base in known:
                    out.append((base, alias.name, node.lineno))
    return out


def import_graph(packages=PACKAGES) -> dict[str, set[str]]:
    """Module -> the modules it imports (a package's __init__ counts as the package)."""
    modules = source_modules(packages)
    known = set(modules)
    return {m: {target for target, _, _ in imports_of(p, known) if target != m}
            for m, p in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan), each sorted: a
    group is a set of modules that import each other, directly or through each other."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def test_cycle_finder_finds_a_known_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_in_models_and_jaxdist():
    # A package's __init__ importing its own submodules is how a package is assembled, not
    # a cycle between peers: leave those edges out.
    graph = {m: {t for t in targets if not t.startswith(m + ".")}
             for m, targets in import_graph().items()}
    scope = {m: graph[m] for m in graph if m.split(".")[0] in ("models", "jaxdist")}
    assert cycles(scope) == []


def test_models_and_sharding_import_no_experiments_analysis_or_ps():
    banned = ("experiments", "analysis", "ps")
    modules = source_modules()
    known = set(modules)
    bad = [f"{m}:{line} imports {target}"
           for m, path in modules.items() if m.split(".")[0] in ("models", "sharding")
           for target, _, line in imports_of(path, known) if target.split(".")[0] in banned]
    assert bad == []


def test_models_and_sharding_import_nothing_of_jaxdist_but_its_errors():
    """models/ and sharding/ are libraries the runtime uses: a model or a layout is data
    and code of its own, so they import no part of jaxdist but jaxdist.errors (the run's
    model config, which reads datasets and meshes, is jaxdist.run_model)."""
    modules = source_modules()
    known = set(modules)
    bad = [f"{m}:{line} imports {target}"
           for m, path in modules.items() if m.split(".")[0] in ("models", "sharding")
           for target, _, line in imports_of(path, known)
           if target.split(".")[0] == "jaxdist" and target != "jaxdist.errors"]
    assert bad == []


def test_packages_form_a_dag_except_the_shared_errors():
    """Top-level packages import each other one way only (jaxdist.errors, which imports
    nothing of the project, is everyone's)."""
    graph: dict[str, set[str]] = {}
    for m, targets in import_graph().items():
        package = m.split(".")[0]
        graph.setdefault(package, set()).update(
            t.split(".")[0] for t in targets
            if t != "jaxdist.errors" and t.split(".")[0] != package)
    assert cycles(graph) == []


def test_model_files_import_no_private_name_of_another_module():
    modules = source_modules(("models",))
    known = set(source_modules())
    bad = [f"{m}:{line} imports {target}.{name}"
           for m, path in modules.items()
           for target, name, line in imports_of(path, known)
           if name.startswith("_") and target != m]
    assert bad == []


def test_model_files_reach_no_private_attribute_of_another_model_module():
    # `from models import llama` then `llama._norm(...)` is the same violation, spelled
    # as an attribute.
    modules = source_modules(("models",))
    known = set(source_modules())
    bad = []
    for m, path in modules.items():
        aliases = {}
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module in known:
                for a in node.names:
                    if f"{node.module}.{a.name}" in known:
                        aliases[a.asname or a.name] = f"{node.module}.{a.name}"
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in known and a.asname:
                        aliases[a.asname] = a.name
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and node.attr.startswith("_")):
                bad.append(f"{m}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}")
    assert bad == []


def test_registry_imports_no_model_family():
    modules = source_modules()
    family_files = {m for m in modules if m.startswith("models.")} - MODEL_FILES_SHARED
    imported = {t for t, _, _ in imports_of(modules["models.registry"], set(modules))}
    assert imported & family_files == set()
    assert imported <= {"jaxdist.errors"}


def test_layers_import_no_model_family():
    modules = source_modules()
    imported = {t for t, _, _ in imports_of(modules["models.layers"], set(modules))}
    # but the FP8 matmul its linears run (models.fp8), itself beneath every model module
    assert {t for t in imported if t.startswith("models")} == {"models.fp8"}
    fp8 = {t for t, _, _ in imports_of(modules["models.fp8"], set(modules))}
    assert {t for t in fp8 if t.startswith("models")} == set()


# ---------------------------------------------------------------- the whole tree

def test_no_import_cycle_anywhere():
    # A package's __init__ assembling its own submodules is not a cycle between peers.
    graph = {m: {t for t in targets if not t.startswith(m + ".")}
             for m, targets in import_graph().items()}
    assert cycles(graph) == []


def test_runtime_imports_no_entry_point():
    modules = source_modules()
    known = set(modules)
    bad = [f"{m}:{line} imports {target}"
           for m, path in modules.items() if m.split(".")[0] in ("jaxdist", "models", "sharding", "ps")
           for target, _, line in imports_of(path, known)
           if target.split(".")[0] in ("experiments", "analysis")]
    assert bad == []


ANALYSIS_MAY_IMPORT = {"jaxdist.record", "jaxdist.errors", "jaxdist.tbx"}
HEAVY = ("jax", "jaxlib", "flax", "optax", "orbax", "chex", "torch")


def test_analysis_imports_no_jax_nor_anything_that_does():
    """Readers of runs start in well under a second: they import jaxdist.record,
    jaxdist.errors and jaxdist.tbx from the project (none imports jax), never models, sharding, ps or
    the rest of the runtime, and no heavy framework."""
    modules = source_modules()
    known = set(modules)
    bad = []
    for m, path in modules.items():
        if not m.startswith("analysis"):
            continue
        for target, _, line in imports_of(path, known):
            if target.split(".")[0] != "analysis" and target not in ANALYSIS_MAY_IMPORT:
                bad.append(f"{m}:{line} imports {target}")
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad += [f"{m}:{node.lineno} imports {n}" for n in names if n.split(".")[0] in HEAVY]
    for allowed in ANALYSIS_MAY_IMPORT:
        tree = ast.parse(modules[allowed].read_text())
        imported = {n.split(".")[0] for node in ast.walk(tree)
                    for n in ([a.name for a in node.names] if isinstance(node, ast.Import)
                              else [node.module or ""] if isinstance(node, ast.ImportFrom)
                              else [])}
        bad += [f"{allowed} imports {n}" for n in imported & set(HEAVY)]
    assert bad == []


def test_no_module_outside_sharding_branches_on_a_mesh_layouts_name():
    """Layout facts live in the layout registry (sharding.registry.LayoutFacts: pipelined,
    sequence_parallel, gathers_weights, tp_comm_chunks, analytic traffic, mesh axes): no
    comparison of a layout with a mesh layout's name elsewhere. The parameter server ("ps")
    is the one layout whose runtime is not a mesh program, so checks for it stay; analysis/
    reads records without jax (so without the registry) and selects rows by the strategy a
    paper names; jaxdist.summary prints zero1 without "+ distributed optimizer" (its name
    says so)."""
    from sharding.registry import layout_names

    mesh_layouts = set(layout_names()) - {"ps"}
    allowed = {"jaxdist.summary"}
    found = []
    for name, path in source_modules(("jaxdist", "ps", "experiments")).items():
        if name in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            if not any("layout" in ast.unparse(side) for side in sides):
                continue
            names = {c.value for side in sides for c in ast.walk(side)
                     if isinstance(c, ast.Constant) and isinstance(c.value, str)}
            if names & mesh_layouts:
                found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    assert found == []


def test_programs_compile_in_one_place():
    """Every compile of a lowered program goes through jaxdist.program.xla_compile (compile_with,
    compile_timed, compile_lowered: its options, the device-less XLA:GPU liveness dump, the
    count of compiles): runs, plans, PS workers and shards, the micro-batch FLOPs count and
    the PyTorch reference's JAX initial weights. No module outside jaxdist/program/ calls
    `.compile()`."""
    found = []
    for name, path in source_modules().items():
        if name == "jaxdist.program.xla_compile":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "compile" and "re" != ast.unparse(node.func.value)):
                found.append(f"{name}:{node.lineno}: {ast.unparse(node)[:80]}")
    assert found == []


def test_hlo_text_is_parsed_only_in_program_hlo():
    """The modules that read a compiled program's HLO (collectives, kernels, op names, a
    pipeline's sends, the time model's ring rule) read jaxdist.program.hlo's typed
    instructions and import no `re`; liveness keeps regexes only for XLA's buffer-assignment
    and live-range dumps and the block scope inside an op name, xla_log for XLA's log."""
    readers = {"jaxdist.program.comm", "jaxdist.program.kernels", "jaxdist.pipeline.report",
               "jaxdist.predict.time_model", "jaxdist.program.program_reading"}
    found = []
    for name, path in source_modules().items():
        if name not in readers:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import) and any(a.name == "re" for a in node.names) or \
                    isinstance(node, ast.ImportFrom) and node.module == "re":
                found.append(f"{name}:{node.lineno}")
    assert found == [] and readers <= set(source_modules())
