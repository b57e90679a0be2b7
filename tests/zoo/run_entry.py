"""One zoo entry, in its own process: ``python tests/zoo/run_entry.py NAME FIXTURES`` prints one
JSON line (:func:`zoo.compare_entry`: ``vramplan run`` against the real CPU run, or ``{"skip": why}``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from zoo import compare_entry  # noqa: E402


def main() -> int:
    print(json.dumps(compare_entry(sys.argv[1], Path(sys.argv[2]))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
