"""The code's shape, read from its own imports and definitions with `ast`: layers import only
downwards and no module imports itself around a circle; each fact the code states is defined
once and imported elsewhere; a long file says why it is one thing (docs/layout.md)."""

from __future__ import annotations

import ast
import functools
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import tierserve

ROOT = Path(tierserve.__file__).parent

# Lowest first; a unit is a top-level module or a folder. A unit imports only from its own layer
# or lower ones. distributed sits above layers because the ranks set up the parallel layers'
# groups; models above distributed because their loader reads the rank's shard.
LAYERS: list[tuple[str, ...]] = [
    ("errors", "utils"),
    ("args", "model_config", "sampling_params", "outputs", "core_messages", "parsers", "chat"),
    ("sizing",),
    ("storage",),
    ("cache",),
    ("layers",),
    ("distributed",),
    ("models",),
    ("speculative",),
    ("frontend",),
    ("engine",),
    ("server", "bench", "plan"),
    ("batch",),
    ("cli", "__init__"),
]
LAYER_OF = {unit: i for i, units in enumerate(LAYERS) for unit in units}


def modules() -> Iterator[tuple[str, Path]]:
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        yield ".".join(("tierserve", *parts)), path


@functools.cache
def parsed(path: Path) -> ast.Module:
    """A module's tree, parsed once for every check (each check walks every module)."""
    return ast.parse(path.read_text())


@functools.cache
def walked(path: Path) -> tuple[ast.AST, ...]:
    return tuple(ast.walk(parsed(path)))


def imported(path: Path, module: str) -> Iterator[tuple[str, int]]:
    """Every tierserve module `path` imports, at any depth of the file (function-level and
    TYPE_CHECKING imports too: a circle dodged by either is still a circle)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in walked(path):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                lazy = EXPORTS.get(base, {}).get(alias.name)
                yield (sub if sub in MODULES else f"{base}.{lazy}" if lazy else base), node.lineno


MODULES = {name for name, _ in modules()}


def exports_of(path: Path) -> dict[str, str]:
    """A package's EXPORTS (name -> its module), as its __init__ states them: the lazy table,
    or, for a face that imports plainly (utils/), its own top-level imports."""
    package = ".".join(("tierserve", *path.parent.relative_to(ROOT).parts))
    plain = {}
    for node in parsed(path).body:
        if isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["EXPORTS"]:
            return ast.literal_eval(node.value)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(f"{package}."):
            plain |= {alias.name: (node.module or "").rpartition(".")[2] for alias in node.names}
    return plain


EXPORTS = {
    name.removesuffix(".__init__"): exports_of(path)
    for name, path in modules()
    if path.name == "__init__.py"
}


def unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def edges() -> Iterator[tuple[str, str, int]]:
    for module, path in modules():
        for target, line in imported(path, module):
            if target.startswith("tierserve") and target != module:
                yield module, target, line


def test_every_unit_has_a_layer():
    assert {unit(m) for m in MODULES} - {"demo_model"} == set(LAYER_OF)


def test_no_import_climbs_a_layer():
    climbs = [
        f"{source}:{line} imports {target}"
        for source, target, line in edges()
        if LAYER_OF[unit(target)] > LAYER_OF[unit(source)]
    ]
    assert not climbs, "\n".join(climbs)


def test_no_import_circle():
    graph: dict[str, set[str]] = {}
    for source, target, _ in edges():
        if target in MODULES:
            graph.setdefault(source, set()).add(target)
    circles, state = [], dict.fromkeys(MODULES, 0)  # 0 unseen, 1 on the path, 2 done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state[nxt] == 1:
                circles.append(" -> ".join([*path[path.index(nxt) :], nxt]))
            elif state[nxt] == 0:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for module in sorted(MODULES):
        if state[module] == 0:
            visit(module, [module])
    assert not circles, "\n".join(circles)


def test_outsiders_import_a_package_by_its_face():
    """Code outside a package takes its names from the package (its __init__'s EXPORTS), not
    from the modules inside it; each exported name is defined where EXPORTS says."""
    reached = []
    for module, path in modules():
        for node in walked(path):
            if not (isinstance(node, ast.ImportFrom) and (node.module or "").count(".") == 2):
                continue
            target = node.module or ""
            if target.startswith("tierserve.") and unit(target) != unit(module):
                reached.append(f"{module}:{node.lineno} imports {target}")
    assert not reached, "\n".join(reached)
    for package, names in EXPORTS.items():
        for name, home in names.items():
            assert name in top_level_names(ROOT.joinpath(*package.split(".")[1:], f"{home}.py"))


# --- each fact once ----------------------------------------------------------------------------

# (name, the module that defines it): no other module defines that name at its top level.
FACTS = [
    ("device_pool_bytes", "tierserve.sizing.pools"),  # the device pool formula
    ("check_mem_fraction", "tierserve.args"),  # the (0, 1) rule of --mem-fraction-static
    ("DEFAULT_MARGIN", "tierserve.sizing.pools"),  # tierserve's host margin
    ("SGLANG_HOST_RESERVE", "tierserve.plan.sglang_versions"),  # SGLang's host reserve
    ("VLLM_DEFAULT_BLOCK", "tierserve.plan.vllm"),  # vLLM's block of 16
    ("SGLANG_EXTRA_PAGES", "tierserve.plan.sglang"),  # the page SGLang adds to a host pool
    ("DEFAULT_AVG_SEQ_LEN", "tierserve.plan.plan"),  # the 4,000-token average request
    ("host_request", "tierserve.sizing.pools"),  # flags -> HostRequest
    ("ranks_per_node", "tierserve.args"),  # ranks over nodes
    ("routes_to_experts", "tierserve.model_config"),  # the MoE-layer rule
    ("DTYPES", "tierserve.utils.dtypes"),  # dtype names, widths and short names
    ("KVSpec", "tierserve.sizing.kv"),  # KV bytes per token
    ("HostRequest", "tierserve.sizing.pools"),
    ("model_fingerprint", "tierserve.models.loader"),
    ("STORAGE_BACKENDS", "tierserve.storage.registry"),
    ("AddRequest", "tierserve.core_messages"),  # what reaches the engine
    ("CoreInput", "tierserve.core_messages"),  # API process -> engine core
    ("CoreOutput", "tierserve.core_messages"),  # engine core -> API process
    ("ENV_PARENT", "tierserve.distributed.rank_env"),  # whom a child process dies with
    ("MAX_CHARS_PER_TOKEN", "tierserve.frontend.prepare"),  # text refused before tokenizing
    ("STEP_GATE_ENV", "tierserve.engine.core_hooks"),  # the test-only step hooks
    ("STEP_HOLD_ENV", "tierserve.engine.core_hooks"),
]


def top_level_names(path: Path) -> set[str]:
    names = set()
    for node in parsed(path).body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            targets = [
                e for t in node.targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])
            ]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


@functools.cache
def referenced(path: Path) -> frozenset[str]:
    """Names the code uses (not its comments or strings)."""
    used = {n.id for n in walked(path) if isinstance(n, ast.Name)}
    return frozenset(used | {n.attr for n in walked(path) if isinstance(n, ast.Attribute)})


def imports_from(path: Path, home: str) -> set[str]:
    """Names `path` takes from module `home`: directly, or through its package's face."""
    package, _, leaf = home.rpartition(".")
    found = set()
    for node in walked(path):
        if not isinstance(node, ast.ImportFrom):
            continue
        for alias in node.names:
            if node.module == home or (
                node.module == package
                and (alias.name == leaf or EXPORTS.get(package, {}).get(alias.name) == leaf)
            ):
                found.add(alias.name)
    return found


@pytest.mark.parametrize(("name", "home"), FACTS)
def test_each_fact_is_defined_once_and_imported_elsewhere(name, home):
    defined = [m for m, path in modules() if name in top_level_names(path)]
    assert defined == [home]
    for module, path in modules():
        if module == home or name not in referenced(path):
            continue
        # It came from its home: by name, or through the home module itself.
        took = imports_from(path, home)
        assert name in took or home.rpartition(".")[2] in took, (
            f"{module} uses {name} without importing it from {home}"
        )


def literal_restatements() -> Iterator[str]:
    """Values that once stood in several places, written again instead of imported."""
    dtype_names = {"float32", "bfloat16", "float16"}
    for module, path in modules():
        for node in walked(path):
            where = f"{module}:{getattr(node, 'lineno', '?')}"
            if module != "tierserve.utils.dtypes" and isinstance(node, ast.Dict):
                keys = {k.value for k in node.keys if isinstance(k, ast.Constant)}
                if len(keys & dtype_names) >= 2:
                    yield f"{where}: a table of dtype names"
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
                pair = {ast.unparse(node.left), ast.unparse(node.right)}
                if pair == {"10", "GiB"} and module not in (
                    "tierserve.sizing.pools",
                    "tierserve.plan.sglang_versions",
                ):
                    yield f"{where}: 10 GiB, a margin or a reserve"
            if (
                isinstance(node, ast.Constant)
                and node.value == 4000
                and module != "tierserve.plan.plan"
            ):
                yield f"{where}: 4,000 tokens, the average request"
            fraction_rule = (
                isinstance(node, ast.Compare)
                and len(node.ops) == 2
                and "fraction" in ast.unparse(node.comparators[0])
            )
            if fraction_rule and module != "tierserve.args":
                yield f"{where}: the (0, 1) rule of a memory fraction"


def test_no_fact_is_written_out_again():
    found = list(literal_restatements())
    assert not found, "\n".join(found)


def test_the_vllm_block_and_the_sglang_page_are_named_where_used():
    # The literal 16 stands in plan/ once: VLLM_DEFAULT_BLOCK's definition.
    sixteens = [
        f"{path.name}:{node.lineno}"
        for path in (ROOT / "plan").glob("*.py")
        if path.name != "presets.py"  # model shapes (16 heads, 16 experts) are other facts
        for node in walked(path)
        if isinstance(node, ast.Constant) and node.value == 16 and type(node.value) is int
    ]
    assert len(sixteens) == 1 and sixteens[0].startswith("vllm.py"), sixteens
    sglang = (ROOT / "plan" / "sglang.py").read_text()
    assert "+ 1) *" not in sglang and sglang.count("SGLANG_EXTRA_PAGES") >= 3


# --- files -----------------------------------------------------------------------------------


def test_a_long_file_says_why_it_is_one_thing():
    long = []
    for module, path in modules():
        lines = path.read_text().count("\n")
        doc = ast.get_docstring(parsed(path)) or ""
        if lines > 400 and "one thing" not in doc.lower():
            long.append(f"{module}: {lines} lines")
    assert not long, "\n".join(long)


TOP_LEVEL_MODULES = 10  # issue 75: small top-level fact modules live in a package (utils/)


def test_the_top_level_holds_few_modules():
    top = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(top) <= TOP_LEVEL_MODULES, top


def test_docs_layout_lists_every_module_as_the_code_says():
    """docs/layout.md's module list is what scripts/layout_doc.py draws from the code now."""
    script = ROOT.parent / "scripts" / "layout_doc.py"
    done = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_docs_layout_lists_the_layers_in_this_order():
    """docs/layout.md's layer table is this file's LAYERS, row for row: it cannot drift."""
    doc = (ROOT.parent / "docs" / "layout.md").read_text()
    rows = re.findall(r"^\| (\d+) \| ([^|]+) \|", doc, flags=re.MULTILINE)
    drawn = [tuple(re.findall(r"`([^`]+)`", units)) for _, units in rows]
    assert [int(n) for n, _ in rows] == list(range(len(LAYERS)))
    assert drawn == LAYERS
