"""docs/design.md's package map (1.2) names every module of the package, in the bullet of its folder: a newcomer
reads there where a change goes (issue 50), and a module added without a line there fails this test."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "p2p_diloco"


def package_map() -> dict[str, str]:
    """Folder ("" for the package's top level) -> the text of its bullet in design.md 1.2."""
    text = (ROOT / "docs" / "design.md").read_text()
    section = text[text.index("### 1.2 Package map"):text.index("### 1.3")]
    bullets: dict[str, str] = {}
    for bullet in re.split(r"\n- ", section)[1:]:
        folder = re.match(r"`([a-z_/]+/)`", bullet)
        key = folder.group(1) if folder else ""
        bullets[key] = bullets.get(key, "") + bullet
    return bullets


def test_the_package_map_names_every_module_in_its_folders_bullet():
    bullets = package_map()
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name in ("__init__.py", "__main__.py"):
            continue
        relative = path.relative_to(PACKAGE)
        folder = "" if len(relative.parts) == 1 else "/".join(relative.parts[:-1]) + "/"
        if f"`{path.name}`" not in bullets.get(folder, ""):
            missing.append(str(relative))
    assert not missing, f"design.md 1.2 does not name these modules in their folder's bullet: {missing}"
