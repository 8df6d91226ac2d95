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


def test_prediction_imports_no_plan():
    """One prediction pipeline: plans (jaxdist.plan) and runs (jaxdist.predict.inrun) use
    jaxdist.predict; nothing in jaxdist.predict imports a plan."""
    modules = source_modules()
    known = set(modules)
    bad = [f"{m}:{line} imports {target}"
           for m, path in modules.items() if m.startswith("jaxdist.predict")
           for target, _, line in imports_of(path, known)
           if target == "jaxdist.plan" or target.startswith("jaxdist.plan.")]
    assert bad == [] and "jaxdist.predict.prediction" in modules


ANALYSIS_MAY_IMPORT = {"jaxdist.record", "jaxdist.errors", "jaxdist.tbx", "jaxdist.plan_words",
                       "jaxdist.figures"}
HEAVY = ("jax", "jaxlib", "flax", "optax", "orbax", "chex", "torch")


def test_analysis_imports_no_jax_nor_anything_that_does():
    """Readers of runs start in well under a second: they import jaxdist.record,
    jaxdist.errors, jaxdist.tbx and the plan vocabulary (jaxdist.plan_words, jaxdist.figures)
    from the project (none imports jax), never models, sharding, ps or
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


def _names_a_layout(node: ast.AST) -> bool:
    """An expression that holds a layout's name: one that reads a name, an attribute or a
    key called *layout* (`layout`, `x.layout`, `x["layout"]`, `x.get("layout")`,
    `get_layout(...).name`); a PyTorch `strategy` is a namespace of its own."""
    for n in ast.walk(node):
        if (isinstance(n, ast.Name) and "layout" in n.id
                or isinstance(n, ast.Attribute) and "layout" in n.attr
                or isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant)
                and n.slice.value == "layout"
                or isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                and n.func.attr == "get" and n.args and isinstance(n.args[0], ast.Constant)
                and n.args[0].value == "layout"):
            return True
    return False


def _literal_names(node: ast.AST) -> set:
    """The strings of a literal: "ps", ("ps", "ddp"), {"tp_pp": ...} (a table's keys)."""
    elts = (node.keys if isinstance(node, ast.Dict) else node.elts
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node])
    return {e.value for e in elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}


def layout_name_comparisons(source: str, names: set, where: str = "") -> list[str]:
    """Where `source` (a module's text; `where` names it) asks a layout's name instead of
    the registry's facts: `==`, `!=`, `in`, `not in` between an expression holding a
    layout's name and a literal naming a registered layout, and a literal table keyed by
    layout names looked up by one (`{...}.get(layout)`, `{...}[layout]`)."""
    found = []
    for node in ast.walk(ast.parse(source, where)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            hit = any(map(_names_a_layout, sides)) and any(
                _literal_names(s) & names for s in sides if not _names_a_layout(s))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            hit = (node.func.attr == "get" and isinstance(node.func.value, ast.Dict)
                   and bool(node.args) and _names_a_layout(node.args[0])
                   and bool(_literal_names(node.func.value) & names))
        elif isinstance(node, ast.Subscript):
            hit = (isinstance(node.value, ast.Dict) and _names_a_layout(node.slice)
                   and bool(_literal_names(node.value) & names))
        else:
            continue
        if hit:
            found.append(f"{where}:{node.lineno}: {ast.unparse(node)[:90]}")
    return found


def test_no_module_outside_sharding_compares_a_layouts_name():
    """Layout facts live in the layout registry (sharding.registry.LayoutFacts: out of
    process, pipelined, replicated, the distributed optimizer, sequence parallel, gathered
    weights, mesh axes, analytic traffic); a run's record keeps them (`layout_facts`,
    jaxdist.record.layout_facts) for the readers that import no jax. So no product module
    (jaxdist, ps, experiments, analysis, scripts) compares a layout's name with a
    registered one, by `==`, `!=`, `in` or a table looked up by it. The tests name layouts
    to choose what they expect of one; a PyTorch strategy (experiments.torch_run) is a
    namespace of its own."""
    from sharding.registry import layout_names

    names = set(layout_names())
    found = [hit for pkg in ("jaxdist", "ps", "experiments", "analysis", "scripts")
             for path in sorted((ROOT / pkg).rglob("*.py"))
             for hit in layout_name_comparisons(path.read_text(), names,
                                                str(path.relative_to(ROOT)))]
    assert found == []


def test_the_layout_name_check_sees_each_form():
    """The check above finds every form it names, and not a PyTorch strategy's."""
    names = {"ps", "ddp", "tp_pp"}
    bad = ['cfg.train.layout == "ps"', 'results.get("layout") == "ps"',
           'r.layout in ("ps", "ddp")', 'p.get("layout") != "ddp"', 'r["layout"] == "tp_pp"',
           'layout not in ["ddp"]', 'get_layout(n).name == "ddp"',
           '{"tp_pp": "tensor"}.get(layout)', '{"ddp": 1}[r.layout]']
    ok = ['job["strategy"] == "ddp"', 'layout == "fsdp"', '"ps" in results',
          'r.layout == other', '{"ddp": 1}.get(strategy)', 'basis("tp") == "layout tp"']
    found = layout_name_comparisons("\n".join(bad + ok), names)
    assert [f.split(": ", 1)[1] for f in found] == [ast.unparse(ast.parse(e)) for e in bad]


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


RECORD_FILE = "results.json"


def results_json_parses(source: str) -> list[int]:
    """Lines of `source` where json.load(s) parses a run's record: its argument names
    results.json, or a name bound (assigned, `with ... as`, a loop or comprehension target, a
    parameter) in the same function or at module level to something that does, or a name
    that says so (`results_json`, `results_file`)."""
    tree = ast.parse(source)
    loaders = {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
               and node.module == "json" for a in node.names if a.name in ("load", "loads")}

    def bindings(scope):
        """(target names, value) of every binding in `scope` (nested scopes included)."""
        for node in ast.walk(scope):
            if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.NamedExpr)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                yield targets, node.value
            elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
                yield [node.target], node.iter
            elif isinstance(node, ast.withitem) and node.optional_vars is not None:
                yield [node.optional_vars], node.context_expr

    def names(nodes):
        return {n.id for t in nodes for n in ast.walk(t) if isinstance(n, ast.Name)}

    def tainted(scope, known: set[str]) -> set[str]:
        found, grown = set(known), True
        while grown:
            grown = False
            for targets, value in bindings(scope):
                if value is not None and mentions(value, found) and not names(targets) <= found:
                    found |= names(targets)
                    grown = True
        return found

    def mentions(node, found: set[str]) -> bool:
        for n in ast.walk(node):
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and RECORD_FILE in n.value:
                return True
            name = n.id if isinstance(n, ast.Name) else n.arg if isinstance(n, ast.arg) else ""
            if name in found or any(s in name.lower() for s in ("results_json", "results_file")):
                return True
        return False

    top = ast.Module(body=[s for s in tree.body if not isinstance(
        s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))], type_ignores=[])
    module = tainted(top, set())  # module-level bindings reach every function
    scopes = [top] + [n for n in ast.walk(tree)
                      if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))]
    lines = set()
    for scope in scopes:
        found = tainted(scope, module)
        for call in ast.walk(scope):
            if not isinstance(call, ast.Call):
                continue
            f = call.func
            if not (isinstance(f, ast.Attribute) and f.attr in ("load", "loads")
                    and isinstance(f.value, ast.Name) and f.value.id == "json"
                    or isinstance(f, ast.Name) and f.id in loaders):
                continue
            if any(mentions(arg, found) for arg in [*call.args, *call.keywords]):
                lines.add(call.lineno)
    return sorted(lines)


def test_results_json_finder_finds_each_form():
    source = '''
import json
from json import load as parse
RESULTS = "results.json"
a = json.loads((logdir / "results.json").read_text())
def f(run):
    record = run / RESULTS
    return json.loads(record.read_text())
def g(results_json):
    return json.loads(results_json.read_text())
def h(d):
    with open(d / "results.json") as fh:
        return parse(fh)
def i(d):
    return [json.loads(p.read_text()) for p in d.rglob("results.json")]
def j(d):
    return json.loads((d / "plan.json").read_text())
'''
    assert results_json_parses(source) == [5, 8, 10, 13, 15]


def test_results_json_is_parsed_only_in_record():
    """A run's record is read through jaxdist.record (RunRecord.load, or read_results for a
    reader that takes any record as it is): no other module, script or test parses a
    results.json with json.load(s)."""
    found = []
    for top in (*PACKAGES, "scripts", "tests"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if path == ROOT / "jaxdist" / "record.py":
                continue
            found += [f"{path.relative_to(ROOT)}:{line}"
                      for line in results_json_parses(path.read_text())]
    assert found == []


# -- the resolved job as the spine (jaxdist/job.py) ----------------------------------------

BELOW_EXPERIMENTS = ("jaxdist", "ps", "sharding", "models", "analysis")
PRODUCT = ("jaxdist", "models", "sharding", "ps", "experiments", "analysis")


def imports_of_name(path: Path, module: str, name: str) -> list[int]:
    """Lines of `path` that import `name` from `module` (module level or in a function)."""
    return [node.lineno for node in ast.walk(ast.parse(path.read_text(), str(path)))
            if isinstance(node, ast.ImportFrom) and node.module == module
            and any(a.name == name for a in node.names)]


def test_only_the_config_and_the_job_import_run_config():
    """Below experiments/ the config flows as the resolved job (jaxdist.job.Job): nothing
    but the config's module and the job's imports RunConfig to read or build one."""
    allowed = {"jaxdist.config", "jaxdist.job"}
    found = [f"{m}:{line}" for m, p in source_modules(BELOW_EXPERIMENTS).items()
             if m not in allowed for line in imports_of_name(p, "jaxdist.config", "RunConfig")]
    assert found == []


def call_sites(name: str, packages=PRODUCT) -> list[str]:
    """module:line of every call of a function called `name` (a bare or dotted call)."""
    out = []
    for m, p in source_modules(packages).items():
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, ast.Call):
                f = node.func
                called = f.id if isinstance(f, ast.Name) else getattr(f, "attr", None)
                if called == name:
                    out.append(f"{m}:{node.lineno}")
    return out


def test_call_site_finder_sees_bare_and_dotted_calls(tmp_path, monkeypatch):
    pkg = tmp_path / "jaxdist"
    pkg.mkdir()
    (pkg / "a.py").write_text("from x import build_model\nbuild_model(c)\nx.build_model(c)\n"
                              "def build_model(c):\n    return c\n")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    assert call_sites("build_model", ("jaxdist",)) == ["jaxdist.a:2", "jaxdist.a:3"]


def test_what_the_job_resolves_is_derived_at_most_twice():
    """The model config, the layout's rules, the mesh and the part are derived where the
    job is resolved (jaxdist.job, experiments.validation) and read from the job elsewhere:
    each derivation has at most two call sites in product code."""
    counts = {name: call_sites(name) for name in ("build_model", "get_layout",
                                                 "parse_mesh", "get_hardware")}
    assert {n: s for n, s in counts.items() if len(s) > 2} == {}


def test_only_the_step_builder_differentiates_the_training_loss():
    """One gradient of the training loss (jaxdist.train_step.loss_and_grad): the mesh
    layouts' step and the parameter-server worker take it; models.fp8 defines the
    value_and_grad it wraps."""
    sites = [s for s in call_sites("value_and_grad")
             if not s.startswith(("jaxdist.train_step:", "models.fp8:"))]
    assert sites == []


SECTIONS = ("mesh", "dist", "compiler", "model", "train", "data", "ps", "loop", "checkpoint",
            "power", "output")


def config_field_reads(path: Path) -> list[int]:
    """Lines of `path` that read a field of a config section through a config:
    `cfg.train.layout`, `self.cfg.ps.ps_mode` (any name ending in `cfg`)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) \
                and node.value.attr in SECTIONS:
            base = node.value.value
            name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", "")
            if name == "cfg" or name.endswith("_cfg") and name != "model_cfg":
                out.append(node.lineno)
    return out


def test_config_read_finder_sees_each_form(tmp_path):
    f = tmp_path / "a.py"
    f.write_text("cfg.train.layout\nself.cfg.ps.ps_mode\njob.train.layout\n"
                 "model_cfg.model.x\ncfg.train\n")
    assert config_field_reads(f) == [1, 2]


def test_below_experiments_the_config_is_read_through_the_job():
    """The job is resolved once and passed whole: below experiments/ no module reads
    `cfg.<section>.<field>`; it reads the job (its typed sections and what it resolved)."""
    found = [f"{m}:{line}" for m, p in source_modules(BELOW_EXPERIMENTS).items()
             for line in config_field_reads(p)]
    assert found == []


FIGURE_PACKAGES = ("jaxdist.plan", "jaxdist.predict", "jaxdist.program")


def _names_bare_dict(annotation: ast.expr) -> bool:
    """Whether a return annotation holds `dict` (or typing's Dict) unparameterized, or a
    mapping to Any: a record passed as a dict."""
    for node in ast.walk(annotation):
        if isinstance(node, ast.Subscript):
            base = ast.unparse(node.value)
            if base in ("dict", "Dict", "Mapping") and "Any" in ast.unparse(node.slice):
                return True
    subscripted = {id(n.value) for n in ast.walk(annotation) if isinstance(n, ast.Subscript)}
    return any(isinstance(n, ast.Name) and n.id in ("dict", "Dict") and id(n) not in
               subscripted for n in ast.walk(annotation)) or \
        (isinstance(annotation, ast.Constant) and str(annotation.value).split("[")[0]
         in ("dict", "Dict"))


def bare_dict_returns(path: Path) -> list[str]:
    """Functions of `path` whose annotation returns a bare dict, or which, unannotated,
    return a dict display or dict(...); `to_json` (a record's JSON, the edge) aside."""
    out = []
    for fn in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or fn.name == "to_json":
            continue
        if fn.returns is not None:
            if _names_bare_dict(fn.returns):
                out.append(f"{fn.name}:{fn.lineno}")
            continue
        if any(isinstance(r, ast.Return) and (
                isinstance(r.value, (ast.Dict, ast.DictComp)) or
                isinstance(r.value, ast.Call) and isinstance(r.value.func, ast.Name)
                and r.value.func.id == "dict") for r in ast.walk(fn)):
            out.append(f"{fn.name}:{fn.lineno}")
    return out


def test_bare_dict_finder_sees_each_form(tmp_path):
    f = tmp_path / "a.py"
    f.write_text("from typing import Any\n"
                 "def a() -> dict: ...\n"
                 "def b() -> dict | None: ...\n"
                 "def c() -> list[dict]: ...\n"
                 "def d() -> dict[str, Any]: ...\n"
                 "def e():\n    return {'x': 1}\n"
                 "def f():\n    return dict(x=1)\n"
                 "def ok1() -> dict[str, int]: ...\n"
                 "def ok2() -> 'Record': ...\n"
                 "def to_json(self) -> dict: ...\n")
    assert [s.split(":")[0] for s in bare_dict_returns(f)] == ["a", "b", "c", "d", "e", "f"]


def test_figures_are_typed_records_not_bare_dicts():
    """What plans, predictions and program readings return is a typed record (a frozen
    dataclass, jaxdist.figures) or a mapping typed by its keys and values; a bare dict is
    only a record's JSON (`to_json`), at the edge."""
    found = [f"{m}.{fn}" for m, p in source_modules(("jaxdist",)).items()
             if m.startswith(FIGURE_PACKAGES) for fn in bare_dict_returns(p)]
    assert found == []
