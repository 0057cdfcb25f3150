"""Generated modules: readable, lint-clean, importable without specc, written atomically, and
checked for staleness."""

from __future__ import annotations

import ast
import math
import os
import shutil
import subprocess
import sys

import pytest

from specc.emit import emit_model
from specc_cli.main import main

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
SPECS = os.path.join(ROOT, "specs")


@pytest.mark.parametrize("name", ["gpt.yaml", "llama.yaml", "parallel-block.yaml"])
@pytest.mark.parametrize("tp,sp", [(1, False), (2, False), (4, True)])
def test_generated_code_parses_and_imports_only_torch_and_runtime(compiled, name, tp, sp):
    _, g = compiled(name, tp=tp, sp=sp)
    source = emit_model(g, "specc compile x")
    tree = ast.parse(source)
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module.split(".")[0])
    assert imported <= {"math", "torch", "runtime"}  # math: the spec's sqrt in an init scale
    classes = [n.name for n in tree.body if isinstance(n, ast.ClassDef)]
    assert len(classes) == 4  # one class per spec module: identical layers share one
    if tp == 1:
        assert "from runtime import mappings" not in source and " = mappings." not in source


def test_every_boundary_is_a_visible_call_with_a_comment(compiled):
    _, g = compiled("gpt.yaml", tp=2, sp=True)
    lines = emit_model(g, "x").splitlines()
    calls = [i for i, ln in enumerate(lines) if " = mappings." in ln]
    boundaries = [op for op in g.iter_ops() if op.kind == "boundary" and op.scope in ("", "layers.0", "layers.0.mlp",
                                                                                      "layers.0.self_attention")]
    assert len(calls) == len(boundaries) == 4  # embedding RS, position scatter, attention RS, MLP RS
    for i in calls:
        assert lines[i - 1].strip().startswith("# ") and ("reduce-scatter" in lines[i - 1] or "split" in lines[i - 1])
    gathers = [ln for ln in lines if "all-gathers its S(s) input" in ln]
    assert len(gathers) == 3  # qkv, fc1 and the output layer absorb the sequence all-gather


def test_generated_directory_passes_ruff():
    ruff = shutil.which("ruff") or os.path.join(os.path.dirname(sys.executable), "ruff")
    if not os.path.exists(ruff):
        pytest.skip("ruff is not installed")
    result = subprocess.run([ruff, "check", "--isolated", "--no-cache", "generated"], cwd=ROOT, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_generated_module_imports_without_specc():
    code = ("import sys; import generated.gpt_tp2_sp.model as m; "
            "assert not [k for k in sys.modules if k == 'specc' or k.startswith('specc.')]; print(m.SETTINGS['tp'])")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "2"


def test_compile_writes_all_files(tmp_path, capsys):
    assert main(["compile", os.path.join(SPECS, "gpt-tiny.yaml"), "--tp", "2", "--sp", "-o", str(tmp_path)]) == 0
    folder = tmp_path / "gpt_tiny_tp2_sp"
    assert sorted(os.listdir(folder)) == [".specc-output", "__init__.py", "graph.dot", "model.py", "plan.json",
                                          "plan.txt"]
    assert 'COMPILE_COMMAND = "specc compile' in (folder / "model.py").read_text()
    assert [p for p in os.listdir(tmp_path) if p.startswith(".")] == []  # no temporary leftovers


def test_failed_compile_leaves_previous_output_untouched(tmp_path, capsys):
    assert main(["compile", os.path.join(SPECS, "gpt-tiny.yaml"), "-o", str(tmp_path), "--name", "out"]) == 0
    before = {f: (tmp_path / "out" / f).read_text() for f in os.listdir(tmp_path / "out")}
    code = main(["compile", os.path.join(SPECS, "gpt-tiny.yaml"), "--tp", "3", "-o", str(tmp_path), "--name", "out"])
    assert code == 2
    assert "not divisible by tensor-model-parallel size 3" in capsys.readouterr().err
    after = {f: (tmp_path / "out" / f).read_text() for f in os.listdir(tmp_path / "out")}
    assert before == after
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_check_passes_on_the_committed_tree_and_catches_staleness(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert main(["check", "generated"]) == 0
    stale = tmp_path / "generated"
    shutil.copytree(os.path.join(ROOT, "generated", "gpt_tp2_sp"), stale / "gpt_tp2_sp")
    plan = stale / "gpt_tp2_sp" / "plan.txt"
    plan.write_text(plan.read_text().replace("reduce_scatter", "all_reduce", 1))
    capsys.readouterr()
    assert main(["check", str(stale)]) == 1
    out = capsys.readouterr().out
    assert "--- " in out and "+++ " in out and "1 stale file(s)" in out


def test_compiled_tiny_models_run_forward_and_backward_at_tp1(compiled):
    torch = pytest.importorskip("torch")
    import specc_torch

    for name in ("gpt-tiny.yaml", "llama-tiny.yaml", "parallel-block-tiny.yaml"):
        model = specc_torch.build_model(os.path.join(SPECS, name), seed=7)
        gen = torch.Generator().manual_seed(0)
        tokens, labels = torch.randint(0, 256, (2, 32), generator=gen), torch.randint(0, 256, (2, 32), generator=gen)
        loss = model(tokens, labels)
        assert loss.shape == (2, 32)
        assert abs(loss.mean().item() - torch.log(torch.tensor(256.0)).item()) < 0.2  # near-uniform at init
        loss.mean().backward()
        assert all(p.grad is not None for p in model.parameters())


def test_init_scales_are_the_specs_expressions_and_each_gradient_mark_is_written_once(compiled):
    """gpt.yaml's sizes and its residual-output scale `${init_std / sqrt(2 * num_layers)}` reaches model.py as that
    expression over CONFIG, which Python evaluates to the very float the compiler computed; every
    partial-gradient mark names its parameter once, with the union of the axes of all its uses (the
    row-parallel bias at TP x CP is partial over cp where the GEMM uses it and over tp and cp where
    it is added to S(s)); every comment fits 120 columns."""
    _, g = compiled("gpt.yaml", tp=2, sp=True, cp=2)
    source = emit_model(g, "x")
    assert "import math\n" in source
    assert 'init_std=CONFIG["init_std"] / math.sqrt(2 * CONFIG["num_layers"]))' in source
    tree = ast.parse(source)
    config = next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                  and n.targets[0].id == "CONFIG")
    # config values that are expressions themselves (ffn_hidden_size, max_position_embeddings) are written out
    assert config == {"vocab_size": 50304, "hidden_size": 768, "num_layers": 12, "seq_length": 1024, "init_std": 0.02}
    proj = next(op for op in g.iter_ops() if op.attr_name == "linear_proj" and op.kind == "linear")
    assert config["init_std"] / math.sqrt(2 * config["num_layers"]) == proj.attrs["init_std"]
    # sizes too, where Python computes the compiler's very int from the expression
    assert 'runtime.RowParallelLinear(4 * CONFIG["hidden_size"], CONFIG["hidden_size"], bias=True' in source
    assert 'runtime.PositionEmbedding(CONFIG["seq_length"], CONFIG["hidden_size"]' in source
    assert 'runtime.VocabParallelEmbedding(CONFIG["vocab_size"], CONFIG["hidden_size"], tp=self.tp' in source
    marks = [ln.strip() for ln in source.splitlines() if "mark_partial_grad(" in ln or "mark_tp_partial_grad(" in ln]
    params = [m.split("(", 1)[1].split(",")[0].rstrip(")") for m in marks]
    assert len(params) == len(set(params)) > 0
    assert 'runtime.mark_partial_grad(self.linear_proj.bias, "tp", "cp")' in marks
    assert all(len(ln) <= 120 for ln in source.splitlines() if ln.strip().startswith("#") or "  # " in ln)
    given = emit_model(compiled("gpt.yaml", overrides={"output_init_std": 0.001, "ffn_hidden_size": 1000})[1], "x")
    assert 'init_std=CONFIG["output_init_std"])' in given and "    'output_init_std': 0.001,\n" in given
    # a --set size is a number the user gave: its name, not the expression it replaced
    assert 'runtime.RowParallelLinear(CONFIG["ffn_hidden_size"], CONFIG["hidden_size"]' in given
    assert "    'ffn_hidden_size': 1000,\n" in given
