"""Reads Harbor task directories with Harbor's own task model (harbor.models.task.config), as
`harbor run -p DIR` would: DIR itself when it holds a task.toml, else each subdirectory that does,
in name order. Prints one JSON line per task: its directory's name and its config as Harbor
dumps it (mode="json"), or the error Harbor's model raised.

Usage: harbor_tasks.py DIR   (the formats venv's python: scripts/formats/install.sh --print-path)
"""

import json
import sys
from pathlib import Path

from harbor.models.task.config import TaskConfig


def task_dirs(root: Path) -> list[Path]:
    if (root / "task.toml").is_file():
        return [root]
    return sorted(path for path in root.iterdir() if (path / "task.toml").is_file())


def main() -> None:
    for task in task_dirs(Path(sys.argv[1])):
        line: dict = {"task": task.name}
        try:
            config = TaskConfig.model_validate_toml((task / "task.toml").read_text())
            line["config"] = config.model_dump(mode="json")
        except Exception as error:  # noqa: BLE001 - the test compares refusals too
            line["error"] = str(error)
        print(json.dumps(line, sort_keys=True))


if __name__ == "__main__":
    main()
