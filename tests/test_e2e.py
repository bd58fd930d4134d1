"""The README's two commands are what CI runs, verbatim: `.ci/run` runs the first from the root of a clean clone
(and checks its result: val accuracy, one weights digest, model.keras, TensorBoard events, nothing left in
jobs/), then the second. The same job from inside a job folder, from elsewhere through a symlink, with
another Ray cluster up (still on an embedded Ray), is tests/test_user_paths.py and the own-loop example's run."""
import re

from tests.conftest import REPO


def readme_commands() -> list[str]:
    """The commands of the README's first ```bash block (its two commands), comments dropped."""
    block = re.search(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), re.S).group(1)
    return [line.split("#")[0].strip() for line in block.splitlines() if line.split("#")[0].strip()]


def test_ci_runs_the_readme_commands_verbatim():
    commands = readme_commands()
    assert commands == ["pip install -e . && raytf run jobs/digits.yaml",
                        "pip install -e '.[test]' && python -m pytest"], commands
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    assert all(command in ci for command in commands), (commands, ci)
