"""Nothing in the repository refers to documents outside it (a design note, a shared folder); design references
name docs/design.md's sections. (A machine path such as benchmarks' PEERS_PYTHON default is not a document.)"""

import re
from pathlib import Path

ROOT = Path(__file__).parent.parent
# docs/design.md's sections: 1 Layers, 2 Points, 3 A call from capture to each backend, 4 vLLM invariants,
# 5 Adding a point kind, 6 Adding a family.
SECTIONS = range(1, 7)
OUTSIDE = re.compile(r"DESIGN\.md|DESIGN section|\bshared/|\bnotes/|the spec's (rule|text|default)")


def _tracked_text() -> dict[str, str]:
    paths = [ROOT / "README.md", ROOT / "pyproject.toml"]
    for folder in ("interp_engine", "tests", "validator", "benchmarks", "scripts", "docs"):
        paths += [p for p in (ROOT / folder).rglob("*") if p.suffix in {".py", ".md", ".sh", ".toml", ".txt"}]
    return {str(p.relative_to(ROOT)): p.read_text(errors="replace") for p in paths if p.is_file()}


def test_no_reference_to_a_document_outside_the_repository():
    files = _tracked_text()
    assert "README.md" in files and "validator/README.md" in files
    me = str(Path(__file__).relative_to(ROOT))
    hits = [f"{name}:{text.count(chr(10), 0, m.start()) + 1}: {m[0]}"
            for name, text in files.items() if name != me for m in OUTSIDE.finditer(text)]
    assert not hits, "point these at docs/design.md (or the README):\n" + "\n".join(hits)


def test_design_references_name_an_existing_section():
    for name, text in _tracked_text().items():
        for m in re.finditer(r"docs/design\.md section (\d+)", text):
            assert int(m[1]) in SECTIONS, f"{name}: {m[0]}"
