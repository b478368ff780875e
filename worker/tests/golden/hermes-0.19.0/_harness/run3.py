import json, os, sys, time, pathlib
OUT = pathlib.Path(sys.argv[1])
import tools.terminal_tool, tools.process_registry
from tools.registry import registry
def step(tool, args, task_id):
    t0 = time.monotonic(); r = registry.dispatch(tool, args, task_id=task_id)
    return {"call": {"tool": tool, "args": args, "task_id": task_id}, "result": r, "elapsed_s": round(time.monotonic()-t0, 2)}
def rec(name, steps, note=None):
    d = {"steps": steps}
    if note: d["note"] = note
    (OUT / f"{name}.json").write_text(json.dumps(d, ensure_ascii=False, indent=2) + "\n")
    print("==", name); [print(" ", s["call"], "->", s["result"][:400]) for s in steps]
rec("workdir_is_sticky", [step("terminal", {"command": "pwd"}, "wd-task"),
    step("terminal", {"command": "pwd", "workdir": "/tmp"}, "wd-task"),
    step("terminal", {"command": "pwd"}, "wd-task")],
    "A fresh task id: after a call with workdir, the session cwd record is the workdir (the wrapper's pwd marker updates env.cwd and record_session_cwd stores it).")
s = step("terminal", {"command": "echo done", "background": True}, "wd-task")
sid = json.loads(s["result"])["session_id"]; time.sleep(1)
rec("wait_clamped_finished", [s, step("process", {"action": "wait", "session_id": sid, "timeout": 999}, "wd-task")])
rec("multiline_and_unicode", [step("terminal", {"command": "printf 'a\\n\\n  b  \\n'; echo 'héllo ✓'"}, "wd-task")])
rec("output_without_trailing_newline", [step("terminal", {"command": "printf exact"}, "wd-task")])
