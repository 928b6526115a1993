"""The shape of the package: no import cycle inside gpt2/, the trainer imported only by its entry
point (its start-up and state below it), training without checkpoint loading or Hugging Face
conversion, every module importable alone without side effects, and benchmarks that use the library's
public names only (README, "Architecture")."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "gpt2"
MODULES = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")
BENCH = REPO / "bench"


def imported_gpt2_modules(path: Path) -> set[str]:
    """The gpt2 modules a file imports, at the top or inside functions (lazy imports count too)."""
    deps = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.startswith("gpt2."):
                deps.add(node.module.split(".")[1])
            elif node.module == "gpt2":
                deps |= {a.name for a in node.names}
        elif isinstance(node, ast.Import):
            deps |= {a.name.split(".")[1] for a in node.names if a.name.startswith("gpt2.")}
    return deps


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == "open":
                return stack[stack.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycle_inside_the_package():
    graph = {m: imported_gpt2_modules(PACKAGE / f"{m}.py") - {m} for m in MODULES}
    assert all(dep in MODULES for deps in graph.values() for dep in deps), graph
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


LADDER_USERS = ["gpt2/doctor.py", "gpt2/sdpa_probe.py"]
"""The acceleration ladder (gpt2/ladder.py) times the trainer's train_step as bench/ladder.py does; the node
check (`python -m gpt2.doctor`) and its attention probe use it. No run imports any of them."""


def test_only_the_entry_point_imports_the_trainer():
    """train_ddp.py imports the trainer and its rehearsal, gpt2/dryrun.py, which nothing else imports
    (but the ladder above, which only the node check imports). The rehearsal runs the trainer's own
    start-up checks, not copies: they live below the trainer, in gpt2/startup.py (the start-up) and
    gpt2/state.py (what a checkpoint holds, check_compatible)."""
    sources = [*PACKAGE.glob("*.py"), *(REPO / "data_prep").glob("*.py")]
    importers = sorted(str(p.relative_to(REPO)) for p in sources if "trainer" in imported_gpt2_modules(p))
    assert importers == ["gpt2/ladder.py"], importers
    users = sorted(str(p.relative_to(REPO)) for p in [*sources, REPO / "train_ddp.py"]
                   if "ladder" in imported_gpt2_modules(p))
    assert users == LADDER_USERS, users
    assert [str(p.relative_to(REPO)) for p in sources if imported_gpt2_modules(p) & {"doctor", "sdpa_probe"}
            and p.stem != "doctor"] == []
    assert [str(p.relative_to(REPO)) for p in sources if "dryrun" in imported_gpt2_modules(p)] == []
    assert {"trainer", "dryrun"} <= imported_gpt2_modules(REPO / "train_ddp.py")
    assert {"startup", "state"} <= imported_gpt2_modules(PACKAGE / "trainer.py")
    assert {"startup", "state"} <= imported_gpt2_modules(PACKAGE / "dryrun.py")


def test_the_trainers_layers_import_nothing_above_them():
    """trainer -> startup -> (plan, resume, ...) and trainer -> state -> (checkpoint, ckpt_writer, ...):
    the start-up and the training state never import the loop, its rehearsal or the command line,
    and the state does not import the start-up."""
    above = {"trainer", "dryrun", "cli"}
    assert imported_gpt2_modules(PACKAGE / "startup.py") & above == set()
    assert imported_gpt2_modules(PACKAGE / "state.py") & (above | {"startup"}) == set()


def import_closure(module: str) -> set[str]:
    """module and every gpt2 module it imports, directly or through others (lazy imports included)."""
    seen, todo = set(), [module]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += imported_gpt2_modules(PACKAGE / f"{name}.py")
    return seen


def test_training_pulls_in_neither_checkpoint_loading_nor_hugging_face():
    """The trainer scores with gpt2/scoring.py; load.py (any checkpoint or HF directory), hf.py (the
    conversion) and eval.py (their command line) are for the tools, not for a training run."""
    assert import_closure("trainer") & {"load", "hf", "eval"} == set()
    assert import_closure("scoring") & {"load", "hf", "eval", "data"} == set()
    assert {"load", "scoring", "hellaswag"} <= import_closure("eval")  # the CLI is where they meet


def bench_imports(path: Path) -> tuple[list[tuple[str, str]], set[str], set[str]]:
    """A bench script's ("gpt2.x", name) pairs from `from gpt2.x import name`, the local names bound
    to gpt2 modules (`import gpt2.x`, `from gpt2 import x`), and its other top-level imports."""
    names, modules, others = [], set(), set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "gpt2":
                modules |= {a.asname or a.name for a in node.names}
            elif node.module.startswith("gpt2."):
                names += [(node.module, a.name) for a in node.names]
            else:
                others.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("gpt2."):
                    modules.add(a.asname or "gpt2")
                else:
                    others.add(a.name.split(".")[0])
    return names, modules, others


def test_the_library_never_imports_a_benchmark():
    bench_names = {"bench"} | {p.stem for p in BENCH.glob("*.py")}
    sources = [*PACKAGE.glob("*.py"), *(REPO / "data_prep").glob("*.py"), REPO / "train_ddp.py"]
    for path in sources:
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                imported.add(node.module.split(".")[0])
            elif isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
        assert not imported & bench_names, (path, imported & bench_names)


def test_benchmarks_use_only_public_names_that_exist():
    """A bench imports what the library exports, by names that exist (a renamed function breaks the
    suite, not the next person to run the bench), and reaches into no private `_name` of ours."""
    import importlib

    checked = 0
    for path in sorted(BENCH.glob("*.py")):
        names, modules, _ = bench_imports(path)
        for module, name in names:
            assert not name.startswith("_"), f"{path.name}: from {module} import {name} (a private name)"
            assert hasattr(importlib.import_module(module), name), f"{path.name}: {module} has no {name}"
            checked += 1
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                root = node.value
                while isinstance(root, ast.Attribute):
                    root = root.value
                assert not (isinstance(root, ast.Name) and root.id in modules), \
                    f"{path.name}:{node.lineno}: uses the private {node.attr} of the library"
    assert checked > 20  # the benches were read


ALONE = """
import importlib, json, os, sys
import torch
results = {}
for name in sys.argv[1:]:
    for loaded in [m for m in sys.modules if m == "gpt2" or m.startswith("gpt2.")]:
        del sys.modules[loaded]
    env, threads = dict(os.environ), torch.get_num_threads()
    importlib.import_module("gpt2." + name)
    changed = sorted(k for k in set(env) | set(os.environ) if env.get(k) != os.environ.get(k))
    results[name] = {"env": changed, "threads_changed": torch.get_num_threads() != threads}
print(json.dumps(results))
"""


def test_every_module_imports_alone_without_side_effects():
    """Each module imported first in a fresh gpt2 (no other module of ours loaded before it): it
    works whatever the import order, and changes neither the environment nor torch's threads."""
    run = subprocess.run([sys.executable, "-c", ALONE, *MODULES], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    results = json.loads(run.stdout.splitlines()[-1])
    assert sorted(results) == MODULES
    assert {m: r for m, r in results.items() if r["env"] or r["threads_changed"]} == {}


def test_readme_architecture_table_names_every_module():
    """docs/architecture.md is the map a reader starts from: every module of gpt2/ appears on it by its path."""
    import pytest

    if not (PACKAGE / "core").is_dir():
        pytest.skip("docs/architecture.md describes the grouped layout (gpt2/core/, ...); this checkout is flat")
    page = (REPO / "docs" / "architecture.md").read_text()
    paths = sorted(p.relative_to(REPO).as_posix() for p in PACKAGE.rglob("*.py") if p.name != "__init__.py")
    assert [p for p in paths if f"`{p}`" not in page] == []
