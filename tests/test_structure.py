"""The package's shape: imports point one way (no cycle), the config schema stands alone, and no
model family is named outside its own folder and the registry."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

PACKAGE = Path(__file__).resolve().parent.parent / "torchtitan_lite"


def _modules() -> dict[str, Path]:
    """Dotted module name → file, for every module of the package (``pkg/__init__.py`` is ``pkg``)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """Module → the package modules its ``import`` statements name (anywhere in the file, lazy and
    ``TYPE_CHECKING`` imports included). ``from pkg import name`` counts as ``pkg.name`` when that
    is a module, else as ``pkg``."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative import
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]
            for target in targets:
                while target and target not in modules:  # `import torchtitan_lite.a.b.c` of a name
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_import_graph_has_no_cycle() -> None:
    graph = import_graph()
    assert len(graph) > 20  # the whole package was read
    assert _find_cycle(graph) is None, " -> ".join(_find_cycle(graph) or [])


def test_cycle_finder_finds_a_cycle() -> None:
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def test_config_schema_imports_only_errors() -> None:
    graph = import_graph()
    parts = {f"torchtitan_lite.config.{name}" for name in ("sections", "types", "validate")}
    assert graph["torchtitan_lite.config.schema"] == parts  # (the schema's one name: split by concern)
    for part in parts:
        assert graph[part] <= {"torchtitan_lite.errors", *parts}, (part, graph[part])
    assert graph["torchtitan_lite.errors"] == set()
    # At run time too: importing the schema loads no other part of the package, and not torch.
    code = ("import sys, torchtitan_lite.config.schema; "
            "print(sorted(m for m in sys.modules if m.startswith(('torchtitan_lite', 'torch'))))")
    loaded = eval(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                 check=True, cwd=PACKAGE.parent).stdout)
    assert set(loaded) <= {"torchtitan_lite", "torchtitan_lite.config", "torchtitan_lite.config.schema",
                           "torchtitan_lite.config.cli", "torchtitan_lite.config.torchtitan",
                           "torchtitan_lite.errors", *parts}, loaded


def test_model_code_imports_no_parallelism() -> None:
    graph = import_graph()
    for module, targets in graph.items():
        if module.startswith("torchtitan_lite.models"):
            # (dtypes: the dtype table and torchao's quiet import, a leaf that imports nothing of ours)
            assert all(t.startswith(("torchtitan_lite.models", "torchtitan_lite.errors", "torchtitan_lite.dtypes"))
                       for t in targets), (module, targets)
    assert import_graph()["torchtitan_lite.dtypes"] == set()


def _docstring_nodes(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
        else:
            continue
        for first, nxt in zip(body, [*body[1:], None], strict=False):
            # The module/class/function docstring, and a string right after an annotated field.
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
            if isinstance(first, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
                ids.add(id(nxt.value))
    return ids


def test_no_model_family_named_outside_its_folder() -> None:
    """``llama`` appears in code (names, strings) only in ``models/llama3/`` and the registry;
    elsewhere only in docstrings and as the default of ``model.name``."""
    found = []
    for name, path in _modules().items():
        if name.startswith("torchtitan_lite.models.llama3") or name == "torchtitan_lite.models":
            continue
        tree = ast.parse(path.read_text(), str(path))
        docs = _docstring_nodes(tree)
        for node in ast.walk(tree):
            text = None
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
                text = node.value
            elif isinstance(node, ast.Name):
                text = node.id
            elif isinstance(node, ast.Attribute):
                text = node.attr
            elif isinstance(node, ast.alias):
                text = node.name
            if text and "llama" in text.lower():
                found.append((name, getattr(node, "lineno", 0), text))
    allowed = {("torchtitan_lite.config.sections", "llama3")}  # the default of model.name
    assert [f for f in found if (f[0], f[2]) not in allowed] == []


DATA = "torchtitan_lite.data"
SOURCE_MODULES = ("stdlib", "text", "c4", "tokens", "arrow")


def test_data_imports_point_one_way() -> None:
    """Nothing in ``data/`` imports the trainer (or anything but the config schema, errors, the
    progress lines, a leaf that imports nothing of the package, and itself); the base modules
    import no source; source modules import nothing from the loader,
    the mixture or the build; the loader and the mixture import no source module."""
    graph = import_graph()
    data = {m: t for m, t in graph.items() if m == DATA or m.startswith(DATA + ".")}
    assert {f"{DATA}.{name}" for name in (*SOURCE_MODULES, "files", "windows", "tokenizers", "sources", "mixture",
                                          "loader", "build")} <= set(data)
    for module, targets in data.items():
        outside = {t for t in targets if not t.startswith(DATA)}
        assert outside <= {"torchtitan_lite.errors", "torchtitan_lite.config.schema", "torchtitan_lite.progress"}, \
            (module, outside)
    assert not {t for t in graph["torchtitan_lite.progress"] if t.startswith("torchtitan_lite")}
    upper = {f"{DATA}.{name}" for name in ("loader", "mixture", "build", "sources")} | {DATA}
    for name in SOURCE_MODULES:
        assert not graph[f"{DATA}.{name}"] & upper, (name, graph[f"{DATA}.{name}"])
    for name in ("files", "windows", "tokenizers"):
        assert not graph[f"{DATA}.{name}"] & ({f"{DATA}.{s}" for s in SOURCE_MODULES} | upper), name
    for name in ("loader", "mixture"):
        assert not graph[f"{DATA}.{name}"] & {f"{DATA}.{s}" for s in (*SOURCE_MODULES, "sources")}, name


def test_trainer_names_no_source_kind() -> None:
    """The trainer (and the validator) read data through ``build_data`` only: no source kind's
    name, no source module, no streamed/windowed distinction appears in their code."""
    from torchtitan_lite.data import DATASETS

    for module in ("torchtitan_lite.trainer", "torchtitan_lite.training.validate", "torchtitan_lite.train"):
        path = _modules()[module]
        text = path.read_text()
        for kind in DATASETS:
            assert f'"{kind}"' not in text and f"'{kind}'" not in text, (module, kind)
        for word in ("arrow", "parquet", "Streaming", "LaneReader", "WindowReader", "STREAMED",
                     "isinstance(self.loader"):
            assert word not in text, (module, word)
        assert not {t for t in import_graph()[module] if t.startswith(DATA + ".")} - {
            f"{DATA}.windows"}, module  # the package's public names only (and the windows validation pads)


_COLLECTIVES = {"all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "broadcast",
                "broadcast_object_list", "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
                "all_to_all_single", "gather_object", "scatter_object_list", "barrier", "reduce"}


def _unnamed_collectives(path: Path) -> list[str]:
    """``dist.<collective>(...)`` calls of a file that do not say which group they run on."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _COLLECTIVES
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "dist"
                and not any(k.arg == "group" for k in node.keywords)):
            found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} dist.{node.func.attr}")
    return found


def _probed(check: Any, source: str) -> list[str]:
    """What ``check`` (a checker of one file) finds in ``source``, written as a file of the tests."""
    probe = PACKAGE.parent / "tests" / "_probe_structure.py"
    probe.write_text(source)
    try:
        return check(probe)
    finally:
        probe.unlink()


def test_every_collective_of_the_loop_validation_and_data_names_its_group() -> None:
    """Losses, metrics, validation and data reduce over the data-parallel group; what every rank
    must agree on (the lock, auto's plan, finite weights) names the world group: none falls back to
    the default group by omission, which would be wrong once the mesh has another dimension."""
    files = [PACKAGE / "trainer.py", PACKAGE / "training" / "validate.py", *sorted((PACKAGE / "data").rglob("*.py"))]
    assert [line for f in files for line in _unnamed_collectives(f)] == []
    # The checker itself sees an unnamed call.
    assert len(_probed(_unnamed_collectives, "import torch.distributed as dist\ndist.all_reduce(x)\n"
                                             "dist.all_reduce(x, group=g)\n")) == 1


def _calls(name: str) -> dict[str, set[str]]:
    """Module → the lines that call a function or method called ``name``."""
    found: dict[str, set[str]] = {}
    for module, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call):
                func = node.func
                called = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
                if called == name:
                    found.setdefault(module, set()).add(f"{path.name}:{node.lineno}")
    return found


def test_the_trainer_and_the_estimator_build_the_model_through_one_function() -> None:
    """``build_parallelized`` (the trainer) and the memory estimator both parallelize through
    ``parallelize`` (the family's steps); nothing else calls ``apply_fsdp`` or a model class on the
    meta device."""
    calls = {name: set(found) for name in ("parallelize", "apply_fsdp", "build_parallelized", "model_cls")
             if (found := _calls(name))}
    assert calls["parallelize"] == {"torchtitan_lite.distributed.parallelize", "torchtitan_lite.memory.estimate"}
    assert calls["apply_fsdp"] == {"torchtitan_lite.distributed.parallelize"}
    # (and an objective's frozen reference copy, built as the model is)
    assert calls["build_parallelized"] == {"torchtitan_lite.trainer", "torchtitan_lite.distributed.parallelize",
                                           "torchtitan_lite.objectives.reference"}
    assert "model_cls" not in calls or calls["model_cls"] == {"torchtitan_lite.models.spec"}


def test_nothing_is_imported_by_a_module_path_string() -> None:
    """Every import of the package's own modules is an import statement the graph above sees: no
    ``importlib.import_module`` or ``__import__`` anywhere in the package (a family's steps and
    the estimator's child process take functions, not "module:function" strings), but the one
    place that imports the user's own code by the name the config gives it (a reward function's
    dotted path, ``grpo.reward_functions``; an objective's, ``training.objective``) and the one that
    imports torchao's modules quietly."""
    assert set(_calls("import_module")) <= {"torchtitan_lite.rl.rewards", "torchtitan_lite.objectives.registry",
                                            "torchtitan_lite.dtypes"}
    assert _calls("__import__") == {}


def test_fully_shard_is_called_in_fsdp_py_only() -> None:
    """Every ``fully_shard`` of the package, the experts' included, is in ``distributed/fsdp.py``
    (with one mixed-precision, reshard and offload rule for all)."""
    assert set(_calls("fully_shard")) == {"torchtitan_lite.distributed.fsdp"}


def test_the_mixture_of_experts_is_a_package_of_parts() -> None:
    """``models/moe/``: router, experts, grouped products, the layer, counts and balancing each a
    module of their own; no ``models/moe.py`` and no top-level balancing module beside it."""
    moe = PACKAGE / "models" / "moe"
    assert moe.is_dir() and not (PACKAGE / "models" / "moe.py").exists() and not (PACKAGE / "moe_balance.py").exists()
    assert {p.stem for p in moe.glob("*.py")} == {"__init__", "router", "experts", "grouped_mm", "layer", "params",
                                                  "balance"}


def test_nothing_downstream_of_the_plan_reads_the_parallelism_section() -> None:
    """The degrees, the reshard mode, offload, loss parallel and the memory budget are read from
    the config once, by the plan (``job.py``); every later step takes them from the plan."""
    found = []
    for module, path in _modules().items():
        if module.startswith("torchtitan_lite.config") or module == "torchtitan_lite.job":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr == "parallelism":
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert found == []


def test_the_build_the_estimate_and_auto_take_one_job_shape() -> None:
    """One description of a job's shape: ``JobShape``. The plan builds it; the model's build, the
    memory estimate and ``auto`` take it (their keywords, where given, are its fields: no second
    list of them)."""
    import dataclasses
    import inspect

    from torchtitan_lite.config import load_job_config
    from torchtitan_lite.distributed.job_shape import JobShape
    from torchtitan_lite.distributed.parallelize import build_sharded_model, parallelize
    from torchtitan_lite.job import plan_job
    from torchtitan_lite.memory.auto import plan_auto_reshard
    from torchtitan_lite.memory.estimate import estimate_memory

    fields = {f.name for f in dataclasses.fields(JobShape)}
    from torchtitan_lite.job import JobPlan

    assert not fields & {f.name for f in dataclasses.fields(JobPlan)}  # the plan holds the shape, says none of it again
    for fn in (build_sharded_model, estimate_memory, plan_auto_reshard, parallelize):
        params = inspect.signature(fn).parameters
        assert "shape" in params and "JobShape" in str(params["shape"].annotation), fn.__name__
        assert not fields & set(params), (fn.__name__, fields & set(params))
    plan = plan_job(load_job_config(["--parallelism.tensor_parallel_degree", "2", "--model.flavor", "tiny",
                                     "--training.seq_len", "32", "--training.local_batch_size", "2"]), world_size=4)
    shape = plan.shape
    assert isinstance(shape, JobShape)
    assert (shape.world_size, shape.dp_replicate, shape.tensor_parallel, shape.grad_accum_steps, shape.seq_len) == (
        4, plan.dims.dp_replicate, 2, plan.shape.grad_accum_steps, 32)


def _model_attribute_assignments(path: Path) -> list[str]:
    """``model.x = ...`` (or ``self.model.x``, ``whole.x``, ``reference.x``) in ``path``: an
    attribute of a model set from outside (a class swap, ``__class__``, is how wrappers keep
    parameter names, and is allowed)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            if not isinstance(target, ast.Attribute) or target.attr == "__class__":
                continue
            owner = target.value
            name = owner.id if isinstance(owner, ast.Name) else (
                owner.attr if isinstance(owner, ast.Attribute) and isinstance(owner.value, ast.Name)
                and owner.value.id == "self" else "")
            if name in ("model", "whole", "reference"):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    return found


def test_no_attribute_of_a_model_is_set_outside_its_own_module() -> None:
    """The parallelize steps change a model through its own methods (the decoder's
    ``use_context_parallel``, ``keep_stages`` …) and return what they built around it
    (``Parallelized``); the trainer reads nothing back off the model with ``getattr``."""
    found = [hit for module, path in _modules().items() if not module.startswith("torchtitan_lite.models")
             for hit in _model_attribute_assignments(path)]
    assert found == []
    trainer = (PACKAGE / "trainer.py").read_text()
    assert "getattr(self.model" not in trainer and "getattr(model" not in trainer
    assert len(_probed(_model_attribute_assignments,
                       "model.context_parallel = 1\nself.model.x = 2\nmodel.__class__ = object\nother.x = 3\n")) == 2


_FSDP_PRIVATE = ("_get_fsdp_state", "_fsdp_param_groups", "_fully_shard", "_state_ctx", "fully_shard.state",
                 "_root_post_backward_final_callback", "unsharded_accumulated_grad", "fsdp_params")


def test_fsdp_internals_are_used_in_fsdp_py_only() -> None:
    """FSDP2's private state (param groups, the root's end-of-backward callback, the custom
    collectives' interfaces) is read in ``distributed/fsdp.py`` only, behind its functions
    (``gathered_through_step``, ``set_custom_all_gather``): when torch changes it, one file breaks."""
    found = [f"{path.relative_to(PACKAGE.parent)}: {name}" for module, path in _modules().items()
             if module != "torchtitan_lite.distributed.fsdp" for name in _FSDP_PRIVATE if name in path.read_text()]
    assert found == []


def test_the_checkpoint_manager_is_policy_under_250_lines() -> None:
    """``CheckpointManager`` decides when and what to save and load; the storage formats
    (``storage.py``), the step folders and what a failed save does (``commit.py``) live apart."""
    path = PACKAGE / "checkpoint" / "manager.py"
    (manager,) = [node for node in ast.parse(path.read_text()).body
                  if isinstance(node, ast.ClassDef) and node.name == "CheckpointManager"]
    assert manager.end_lineno - manager.lineno + 1 < 250


def _identifier_words(name: str) -> set[str]:
    """The words of an identifier: ``GRPOObjective`` → grpo, objective; ``build_preference`` →
    build, preference; ``FSDPOptions`` → fsdp, options."""
    words = set()
    for part in name.split("_"):
        words |= {w.lower() for w in re.findall(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[a-z]+|[A-Z]+|\d+", part)}
    return words


def _objective_identifiers(path: Path) -> list[str]:
    """Identifiers of ``path`` (names, attributes, definitions, arguments, keywords, imports, and
    the modules imported from) that name DPO, GRPO or preference."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Name):
            names = [node.id]
        elif isinstance(node, ast.Attribute):
            names = [node.attr]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names = [node.name]
        elif isinstance(node, ast.arg):
            names = [node.arg]
        elif isinstance(node, ast.keyword) and node.arg:
            names = [node.arg]
        elif isinstance(node, ast.alias):
            names = [node.name, node.asname or ""]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        for name in names:
            if any(_identifier_words(part) & {"dpo", "grpo", "preference"} for part in name.split(".")):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{getattr(node, 'lineno', 0)} {name}")
    return found


OBJECTIVE_HOMES = ("torchtitan_lite.objectives", "torchtitan_lite.rl", "torchtitan_lite.config", "torchtitan_lite.data")


def test_an_objective_is_local_to_its_module() -> None:
    """Identifiers naming DPO, GRPO or preference appear in at most 2 modules outside
    ``objectives/``, ``rl/``, ``config/`` and ``data/`` (the trainer, the plan, validation, the
    metrics, the estimator, the memory command and the engine ask the objective's entry); there is
    no top-level ``dpo.py``; the checker itself sees such names (and not ``FSDPOptions``)."""
    elsewhere = {module: hits for module, path in _modules().items()
                 if not module.startswith(OBJECTIVE_HOMES) and (hits := _objective_identifiers(path))}
    assert len(elsewhere) <= 2, elsewhere
    assert not (PACKAGE / "dpo.py").exists()
    assert _identifier_words("FSDPOptions") == {"fsdp", "options"}
    assert len(_probed(_objective_identifiers, "from torchtitan_lite.objectives.grpo import x\nbuild_preference()\n"
                                              "DPOSetup\nFSDPOptions\n")) == 3


def test_the_engine_writes_no_attribute_of_the_trainer() -> None:
    """The training engine drives the trainer through its methods (``finish_step`` ends a step as
    the loop does); it assigns none of its attributes."""
    tree = ast.parse((PACKAGE / "engine.py").read_text())
    written = [f"engine.py:{node.lineno}" for node in ast.walk(tree)
               if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign))
               for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
               if isinstance(target, ast.Attribute) and not (isinstance(target.value, ast.Name)
                                                              and target.value.id == "self")]
    assert written == []


def test_what_every_family_declares_is_read_not_probed() -> None:
    """``num_experts`` and ``tie_word_embeddings`` are declared by every family's args
    (``DecoderArgs``): no ``getattr(…, "num_experts" / "tie_word_embeddings", default)`` anywhere."""
    probes = [f"{path.relative_to(PACKAGE.parent)}:{node.lineno}" for path in _modules().values()
              for node in ast.walk(ast.parse(path.read_text(), str(path)))
              if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
              and node.args[1].value in ("num_experts", "tie_word_embeddings")]
    assert probes == []


def test_the_package_shows_its_layers() -> None:
    """At most 14 top-level modules besides ``__init__.py`` (the process's life in ``run/``,
    validation and the start-up log with the training loop, profiling with its callback); no
    package module over 800 lines."""
    top = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert len(top) <= 14, top
    long = {str(p.relative_to(PACKAGE.parent)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 800}
    assert long == {}


def _area(module: str) -> str:
    """A module's area: its top-level module or package (``torchtitan_lite.objectives.grpo`` →
    ``objectives``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def area_floors() -> dict[str, int]:
    """Each area's floor in the import drawing: 1 + the highest floor of the areas it imports
    (the base, which imports none of them, is floor 1)."""
    graph: dict[str, set[str]] = {}
    for module, targets in import_graph().items():
        graph.setdefault(_area(module), set()).update(_area(t) for t in targets if _area(t) != _area(module))
    assert _find_cycle(graph) is None, " -> ".join(_find_cycle(graph) or [])
    floors: dict[str, int] = {}

    def floor(area: str) -> int:
        if area not in floors:
            floors[area] = 1 + max((floor(other) for other in graph[area]), default=0)
        return floors[area]

    for area in graph:
        floor(area)
    return floors


def test_the_import_drawing_has_no_circle_and_its_floors_are_the_architecture_pages() -> None:
    """Between areas (top-level modules and packages) imports point one way, and the floors
    ``docs/architecture.md`` names are the package's (12 of them; 13 before objectives were parts
    of their own and the process's life a package)."""
    floors = area_floors()
    assert max(floors.values()) <= 12, floors
    drawn = {}
    text = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    block = re.search(r"<!-- floors:start -->(.*?)<!-- floors:end -->", text, re.S)
    assert block is not None
    for line in block.group(1).splitlines():
        if (found := re.match(r"\s*(\d+)\s+(.*)$", line)):
            for area in re.findall(r"[\w.]+", found.group(2)):
                drawn[area] = int(found.group(1))
    assert drawn == {a: f for a, f in floors.items() if a != "__init__"}, (drawn, floors)
