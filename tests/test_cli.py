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
