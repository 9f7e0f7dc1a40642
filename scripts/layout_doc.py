"""docs/layout.md's list of every module, drawn from the code: each package in layer order
(tests/test_layout.py's LAYERS) with its modules and the first sentence of each docstring.

    .venv/bin/python scripts/layout_doc.py          # rewrites the list in docs/layout.md
    .venv/bin/python scripts/layout_doc.py --check  # exit 1 if it is out of date

tests/test_layout.py runs the check, so the list cannot drift from the code.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "layout.md"
BEGIN = "<!-- modules: drawn by scripts/layout_doc.py; do not edit by hand -->"
END = "<!-- end of modules -->"
LONGEST = 150  # characters of a docstring's first sentence


def layers() -> list[tuple[str, ...]]:
    """LAYERS, read from tests/test_layout.py without importing it."""
    tree = ast.parse((ROOT / "tests" / "test_layout.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and ast.unparse(node.target) == "LAYERS":
            return ast.literal_eval(node.value)  # type: ignore[arg-type]
    raise SystemExit("tests/test_layout.py has no LAYERS")


def first_sentence(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    text = " ".join(doc.split())
    match = re.match(r"(.+?\.)(\s|$)", text)
    sentence = (match.group(1) if match else text).rstrip(".")
    if len(sentence) > LONGEST:
        sentence = sentence[:LONGEST].rsplit(" ", 1)[0] + " …"
    return sentence.replace("|", "\\|")


def drawn() -> str:
    package = ROOT / "tierserve"
    lines = [BEGIN, ""]
    for i, units in enumerate(layers()):
        for unit in units:
            folder = package / unit
            if not folder.is_dir():
                path = package / f"{unit}.py"
                lines.append(f"- layer {i}, `tierserve/{unit}.py`: {first_sentence(path)}")
                continue
            lines.append(
                f"- layer {i}, `tierserve/{unit}/`: {first_sentence(folder / '__init__.py')}"
            )
            for path in sorted(folder.rglob("*.py")):
                if path.name == "__init__.py" and path.parent == folder:
                    continue
                name = path.relative_to(folder).as_posix()
                lines.append(f"  - `{name}`: {first_sentence(path)}")
    return "\n".join([*lines, "", END])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true")
    ns = ap.parse_args()
    text = DOC.read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    new = text[:start] + drawn() + text[end:]
    if ns.check:
        if new != text:
            print("docs/layout.md's module list is out of date: run scripts/layout_doc.py")
            return 1
        return 0
    DOC.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
