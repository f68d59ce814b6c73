"""The documentation's command blocks are well formed (tests/ray/test_docs.py runs them), its links lead
somewhere, the README's test command is the one .ci/run runs, and the README's model is examples/my_model.py."""

from __future__ import annotations

import re
import shlex

import pytest

from tests.docs_blocks import REPO, Block, DocsError, blocks, page_blocks, pages


def test_a_block_runs_unless_the_line_before_its_fence_is_the_marker():
    text = "\n".join([
        "```bash", "raydl train --set a=1   # a comment", "# only a comment", "", "raydl data inspect \\",
        "  data/x", "```", "<!-- not tested: needs a cluster -->", "```bash", "ray start --head", "```",
        "<!-- not tested: -->", "```bash", "echo hi", "```"])
    found = blocks(text, "page.md")
    assert found == [Block("page.md", 1, ("raydl train --set a=1   # a comment", "raydl data inspect  data/x"), None),
                     Block("page.md", 9, ("ray start --head",), "needs a cluster"),
                     Block("page.md", 13, ("echo hi",), None)]   # an empty reason is no marker


@pytest.mark.parametrize("text, error", [
    ("```bash\n# nothing to run\n```", "no command and no 'not tested' marker"),
    ("```bash\nraydl train\n", "not closed"),
    ("<!-- not tested: a GPU -->\n\n```bash\nraydl train\n```", "the line just before"),
])
def test_malformed_blocks_are_refused(text, error):
    with pytest.raises(DocsError, match=error):
        blocks(text, "page.md")


def test_other_fences_are_not_commands():
    text = "```python\nimport raydl\n```\n```\n<!-- not tested: REASON -->\nraydl train\n```\n```yaml\na: 1\n```"
    assert blocks(text) == []


def test_a_tested_by_marker_names_the_test_that_runs_the_block():
    text = "<!-- tested by: tests/ray/test_x.py::test_y -->\n```bash\nraydl train\n```"
    assert blocks(text, "page.md") == [Block("page.md", 2, ("raydl train",), None, "tests/ray/test_x.py::test_y")]
    with pytest.raises(DocsError, match="no command"):
        blocks("<!-- tested by: tests/ray/test_x.py::test_y -->\n```bash\n```", "page.md")
    assert blocks("<!-- tested by: somewhere -->\n```bash\necho hi\n```")[0].tested_by is None   # not a test: runs


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.name)
def test_every_tested_by_marker_names_a_test_that_exists(page):
    for block in page_blocks(page):
        if block.tested_by:
            path, name = block.tested_by.split("::")
            assert (REPO / path).is_file(), f"{block.page}:{block.line}: {path} does not exist"
            assert re.search(rf"^def {name}\(", (REPO / path).read_text(), re.M), \
                f"{block.page}:{block.line}: {path} has no test {name}"


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.name)
def test_every_page_parses(page):
    parsed = page_blocks(page)
    assert all(b.commands or b.skip_reason for b in parsed), "a block with nothing to run and no reason to skip"


@pytest.mark.parametrize("page", [*pages(), REPO / "benchmarks" / "README.md", REPO / "ARCHITECTURE.md"],
                         ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_lead_to_files(page):
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if "://" in target or target.startswith(("#", "mailto:")):
            continue
        assert (page.parent / target.split("#")[0]).exists(), f"{page.name}: link to {target} leads nowhere"


def test_readme_test_command_is_what_ci_runs():
    """The README's second command and .ci/run: the same torch pin, extras, environment and pytest line."""
    readme_blocks = page_blocks(REPO / "README.md")
    command = next(c for b in readme_blocks for c in b.commands if "pytest" in c)
    ci = (REPO / ".ci" / "run").read_text()
    steps = [s.strip() for s in command.split("&&")]
    pip_steps = [s for s in steps if s.startswith(("pip install", "uv pip install"))]
    assert pip_steps and all(step.replace("pip install", "pip install -q", 1) in ci for step in pip_steps), command
    *env, python, m, pytest_, target = shlex.split(steps[-1])
    assert f"export {' '.join(env)}" in ci and f"{python} {m} {pytest_} {target}" in ci.splitlines()[-1], command


def test_readme_model_is_examples_my_model():
    readme = (REPO / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", readme, re.S)[1]
    assert code == (REPO / "examples" / "my_model.py").read_text()
    assert "--set model.name=examples.my_model:spec" in readme
