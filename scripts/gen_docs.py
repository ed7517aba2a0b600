"""Rewrite what the documentation takes from the code: the generated blocks of
docs/ and .env.example (run after changing a setting)."""

from __future__ import annotations

from pathlib import Path

from tools.docgen import env_example, render

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    for path in [*sorted((ROOT / "docs").glob("*.md")), ROOT / ".env.example"]:
        text = path.read_text()
        new = env_example() if path.name == ".env.example" else render(text)
        if new != text:
            path.write_text(new)
            print(f"rewrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
