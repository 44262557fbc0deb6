"""The command line: plan a model given as module:factory, show the saved plan, one-line errors."""

import pytest

from autopar.cli import main


def test_plan_then_show(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert (
        main(
            [
                "plan",
                "examples.models:gpt2_tiny",
                "--cluster",
                "dgx-a100",
                "--nodes",
                "1",
                "--zero",
                "2",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "dp=8 x tp=1 x pp=1" in printed and out.exists()
    assert main(["show", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "ZeRO stage" in shown and "GPT2LMHeadModel" in shown


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["plan", "nomodule"], "module:factory"),
        (["plan", "no_such_module_xyz:f"], "cannot import module"),
        (["plan", "examples.models:nothing"], "no callable 'nothing'"),
        (["plan", "examples.models:gpt2_tiny", "--cluster", "dgx-z9"], "unknown cluster preset"),
        (["plan", "examples.models:gpt2_tiny", "--dp", "3"], "does not match"),
        (["show", "/nonexistent/plan.json"], "cannot read plan file"),
    ],
)
def test_bad_input_exits_2_with_one_line(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err and err.startswith("autopar: error:")


@pytest.fixture(scope="module")
def saved_plans(tmp_path_factory):
    """Two plans of the small MLP on 4 local processes (searched, and pure data parallel: dp fixed to 4), as JSON."""
    d = tmp_path_factory.mktemp("cli")
    a, b = d / "a.json", d / "b.json"
    common = ["examples.models:mlp_tiny", "--local", "4", "--precision", "fp32", "--time-limit", "20"]
    assert main(["plan", *common, "--json", str(a), "--report", str(d / "a.html")]) == 0
    assert main(["plan", *common, "--dp", "4", "--json", str(b)]) == 0
    return a, b, d


def test_show_explain_report_pictures(saved_plans, capsys):
    a, _, d = saved_plans
    assert (d / "a.html").read_text().startswith("<!DOCTYPE html>")
    capsys.readouterr()
    assert main(["show", str(a), "--explain", "up.weight"]) == 0
    out = capsys.readouterr().out
    assert "parameter up.weight" in out and "chosen placement" in out
    assert main(["show", str(a), "--explain", "down"]) == 0
    assert "module down" in capsys.readouterr().out
    assert main(["show", str(a), "--report", str(d / "shown.html"), "--pictures", str(d / "pics")]) == 0
    assert (d / "shown.html").exists() and (d / "pics" / "memory.png").exists()


def test_diff(saved_plans, capsys):
    a, b, _ = saved_plans
    capsys.readouterr()
    assert main(["diff", str(a), str(a)]) == 0
    assert "no difference" in capsys.readouterr().out
    assert main(["diff", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "dp=4" in out and "step time" in out  # data parallelism is the slowest layout here: a differs


def test_export_onnx(saved_plans, tmp_path, capsys):
    a, _, _ = saved_plans
    out = tmp_path / "mlp.onnx"
    assert main(["export-onnx", "examples.models:mlp_tiny", "--plan", str(a), "--out", str(out)]) == 0
    assert out.exists() and "tensors annotated" in capsys.readouterr().out


def test_help_names_every_command(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    for cmd in ("plan", "show", "diff", "export-onnx"):
        assert cmd in text


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["show", "{a}", "--explain", "up.weightt"], "close matches: up.weight"),
        (["show", "{a}", "--report", "/proc/no/report.html"], "cannot write"),
        (["diff", "{a}", "/nonexistent/b.json"], "cannot read plan file"),
        (
            ["export-onnx", "examples.models:mlp_tiny", "--plan", "/nonexistent/p.json", "--out", "x.onnx"],
            "cannot read",
        ),
        (["export-onnx", "examples.models:gpt2_tiny", "--plan", "{a}", "--out", "x.onnx"], "another model"),
    ],
)
def test_bad_inspection_input_exits_2_with_one_line(saved_plans, argv, needle, capsys):
    a, _, _ = saved_plans
    assert main([x.replace("{a}", str(a)) for x in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err and err.startswith("autopar: error:")


def test_a_failing_factory_is_one_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "broken_models.py").write_text("def build():\n    raise ValueError('no weights here')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["plan", "broken_models:build", "--local", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "broken_models:build() raised ValueError: no weights here" in err and "\n" not in err
