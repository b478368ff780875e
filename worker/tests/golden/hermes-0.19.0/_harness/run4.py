import json, os, sys, time, pathlib
OUT = pathlib.Path(sys.argv[1])
import tools.terminal_tool
from tools.registry import registry
args={"command": "chmod -R 777 /tmp/hermes-golden/work/sub"}
r=registry.dispatch("terminal", args, task_id="g")
d={"call":{"tool":"terminal","args":args,"task_id":"g"},"result":r,"note":"dangerous-pattern command in a non-interactive local run (no HERMES_INTERACTIVE, no gateway)"}
(OUT/"dangerous_command_noninteractive.json").write_text(json.dumps(d,ensure_ascii=False,indent=2)+"\n"); print(r)
