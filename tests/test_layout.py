"""The package's layout: a stage (a module a rule runs) never imports another stage; what stages
share lives in library modules."""
import ast
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "scripts" / "eaglepipe"


def stage_modules() -> set[str]:
    """The modules the rules run: `{STAGE}.<module>` or `... eaglepipe.<module>` in a shell command
    (the workflow's own `from eaglepipe.x import` lines are no stage)."""
    lines = [
        line
        for p in [REPO / "Snakefile", *sorted((REPO / "rules").glob("*.smk"))]
        for line in p.read_text().splitlines()
        if not line.lstrip().startswith(("from ", "import "))
    ]
    return set(re.findall(r"(?:\{STAGE\}|\beaglepipe)\.(\w+) ", "\n".join(lines)))


def imported_modules(source: str) -> set[str]:
    """The eaglepipe modules a module's source imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("eaglepipe.")}
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level == 0 and module.split(".")[0] != "eaglepipe":
                continue
            package_path = module.split(".")[1:] if node.level == 0 else module.split(".") if module else []
            if package_path:
                found.add(package_path[0])
            else:  # from . import x / from eaglepipe import x
                found |= {a.name for a in node.names}
    return found


def test_stage_modules_found():
    stages = stage_modules()
    assert {"train_draft", "evaluate", "extract_hidden_states", "export_draft"} <= stages
    assert all((PKG / f"{s}.py").is_file() for s in stages), stages


def test_no_stage_imports_another_stage():
    stages = stage_modules()
    offending = {
        stage: sorted(imported_modules((PKG / f"{stage}.py").read_text()) & stages - {stage}) for stage in stages
    }
    assert not {s: m for s, m in offending.items() if m}, (
        "a stage imports another stage; move what they share into a library module"
    )


def test_no_benchmark_imports_a_stage():
    # the lab leans on the product, never the reverse: a benchmark takes what it shares with a stage
    # from a library module (a stage's command line it may run, as a user does)
    stages = stage_modules()
    scripts = sorted((REPO / "benchmarks").glob("*.py"))
    offending = {p.name: sorted(imported_modules(p.read_text()) & stages) for p in scripts}
    assert len(scripts) > 3 and not {n: m for n, m in offending.items() if m}, offending


def test_imported_modules_sees_every_import_form():
    source = (
        "import eaglepipe.train_draft\n"
        "from eaglepipe.evaluate import main\n"
        "from eaglepipe import plots\n"
        "from . import model_card\n"
        "def f():\n"
        "    from .export_draft import main\n"
        "import json\n"
        "from pathlib import Path\n"
    )
    assert imported_modules(source) == {"train_draft", "evaluate", "plots", "model_card", "export_draft"}


def rule_modules() -> dict[str, str]:
    """Rule name -> the stage module its shell command runs (`use rule A as B` runs A's module)."""
    text = "\n".join(p.read_text() for p in sorted((REPO / "rules").glob("*.smk")))
    out, current = {}, None
    for line in text.splitlines():
        if m := re.match(r"\s*use rule (\w+) as (\w+)", line):
            out[m.group(2)] = m.group(1)  # resolved below
        elif m := re.match(r"\s*rule (\w+):", line):
            current = m.group(1)
        elif current and (m := re.search(r"(?:\{STAGE\}|\beaglepipe)\.(\w+) ", line)):
            out[current] = m.group(1)
            current = None
    return {rule: out.get(module, module) for rule, module in out.items()}


def test_every_stage_module_opens_with_the_rules_that_run_it_and_the_map_lists_them():
    modules = rule_modules()
    assert {"prepare_data", "extract_parity_hidden_states", "gather_hidden_states"} <= set(modules), modules
    package_doc = ast.get_docstring(ast.parse((PKG / "__init__.py").read_text()))
    for rule, module in modules.items():
        first_line = ast.get_docstring(ast.parse((PKG / f"{module}.py").read_text())).splitlines()[0]
        assert first_line.startswith("Stage") and rule in first_line, (rule, module, first_line)
        row = next((r for r in package_doc.splitlines() if r.startswith(f"| {rule}") or f", {rule} |" in r), None)
        assert row and f"| {module} |" in row, (rule, module)


def test_vllm_environment_defaults_are_set_by_the_stages_only():
    # scripts/eaglepipe/vllm_env.py sets them in every process that starts an engine; a copy in a
    # script or rule would be a second place to keep in step
    from eaglepipe.vllm_env import VLLM_ENV_DEFAULTS

    places = [REPO / "Snakefile", REPO / "setup.sh", *(REPO / "rules").glob("*.smk"), *(REPO / "benchmarks").glob("*.sh")]
    copies = [(p.relative_to(REPO).as_posix(), key) for p in places for key in VLLM_ENV_DEFAULTS
              if re.search(rf"\b{key}=", p.read_text())]
    assert len(places) > 5 and not copies, copies


def test_the_stages_that_handle_no_tensor_start_without_torch():
    # every run starts them; torch's import is ~1.3 CPU-s of each (shard_manifest.py says why apart)
    light = ["gather_manifest", "plots", "model_card"]
    assert set(light) <= stage_modules()
    code = f"import sys; import {', '.join('eaglepipe.' + m for m in light)}; print('torch' in sys.modules)"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert p.stdout.strip() == "False"
