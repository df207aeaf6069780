"""Write docs/config.md, every config key with its type, default and the one-line docstring it has in
dapo_ray/config.py (the source is read, not imported: field docstrings are not kept at run time).

    .venv/bin/python scripts/config_reference.py            # rewrite docs/config.md
    .venv/bin/python scripts/config_reference.py --check    # exit 1 when it is out of date (a test runs this)
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "dapo_ray" / "config.py"
OUT = ROOT / "docs" / "config.md"


def _classes(tree: ast.Module) -> dict[str, list[tuple[str, str, str, str]]]:
    """Dataclass name -> its fields: (name, type, default, docstring)."""
    out = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef) or not any(ast.unparse(d).startswith("dataclass") for d in node.decorator_list):
            continue
        fields, body = [], node.body
        for i, item in enumerate(body):
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                doc = body[i + 1].value.value if i + 1 < len(body) and isinstance(body[i + 1], ast.Expr) and \
                    isinstance(body[i + 1].value, ast.Constant) else ""  # fmt: skip
                default = ast.unparse(item.value) if item.value is not None else ""
                if default.startswith("field(default_factory="):
                    default = default.removeprefix("field(default_factory=").removesuffix(")")
                    default = {"dict": "{}", "list": "[]", "tuple": "()"}.get(default, "")
                fields.append((item.target.id, ast.unparse(item.annotation), default, " ".join(doc.split())))
        out[node.name] = fields
    return out


def reference() -> str:
    classes = _classes(ast.parse(SOURCE.read_text()))
    lines = ["# Config reference", "",
             "Every key of the config tree (`dapo_ray/config.py`), by section: its type, its default, and what it does.",
             "Set keys in a YAML file (`--config`) or on the command line (`section.key=value`, read as YAML).",
             "Written by `python scripts/config_reference.py` from the source; a test keeps it current.", ""]  # fmt: skip
    for section, typename, _, doc in classes["Config"]:
        lines += [f"## {section}", "", doc, "", "| key | type | default | |", "|---|---|---|---|"]
        for name, annotation, default, text in classes[typename]:
            if annotation in classes:  # a nested section (data.synthetic)
                lines.append(f"| `{section}.{name}` | section | | {text} (the `{section}.{name}.*` keys below) |")
                continue
            text = text.replace("|", "\\|")
            lines.append(f"| `{section}.{name}` | `{annotation.replace('|', 'or')}` | `{default}` | {text} |")
        for name, annotation, _, _ in classes[typename]:
            if annotation in classes:
                lines += ["", f"### {section}.{name}", "", "| key | type | default | |", "|---|---|---|---|"]
                for sub, sub_ann, sub_default, sub_text in classes[annotation]:
                    sub_text = sub_text.replace("|", "\\|")
                    lines.append(f"| `{section}.{name}.{sub}` | `{sub_ann.replace('|', 'or')}` | `{sub_default}` | {sub_text} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    text = reference()
    if "--check" in sys.argv:
        current = OUT.read_text() if OUT.exists() else ""
        if current != text:
            print(f"{OUT} is out of date: run python scripts/config_reference.py", file=sys.stderr)
            sys.exit(1)
        sys.exit(0)
    OUT.write_text(text)
    print(f"wrote {OUT}")
