"""The README's Python example runs as written (two engines of this process over tcp)."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def python_blocks(path):
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


def test_the_readme_python_example_runs():
    blocks = [b for b in python_blocks(README) if "asyncio.run(" in b]
    assert len(blocks) == 1, "the README has one runnable Python example"
    exec(compile(blocks[0], str(README), "exec"), {"__name__": "readme"})
