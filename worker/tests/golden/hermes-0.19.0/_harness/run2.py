import json, os, sys, time, pathlib
OUT = pathlib.Path(sys.argv[1])
WORK = pathlib.Path(os.environ["TERMINAL_CWD"])
import tools.terminal_tool, tools.process_registry, tools.file_tools
from tools.registry import registry
def step(tool, args, task_id):
    t0 = time.monotonic(); r = registry.dispatch(tool, args, task_id=task_id)
    return {"call": {"tool": tool, "args": args, "task_id": task_id}, "result": r, "elapsed_s": round(time.monotonic()-t0, 2)}
def rec(name, steps, note=None):
    d = {"steps": steps}
    if note: d["note"] = note
    (OUT / f"{name}.json").write_text(json.dumps(d, ensure_ascii=False, indent=2) + "\n")
    print("==", name); [print(" ", s["call"], "->", s["result"][:400]) for s in steps]

# PTY cat job: write / submit / close
s = step("terminal", {"command": "cat", "background": True, "pty": True}, "golden-task")
sid = json.loads(s["result"])["session_id"]; steps=[s]
time.sleep(1.0)
steps.append(step("process", {"action": "write", "session_id": sid, "data": "hello "}, "golden-task"))
steps.append(step("process", {"action": "submit", "session_id": sid, "data": "world"}, "golden-task"))
time.sleep(0.5)
steps.append(step("process", {"action": "poll", "session_id": sid}, "golden-task"))
steps.append(step("process", {"action": "close", "session_id": sid}, "golden-task"))
time.sleep(1.0)
steps.append(step("process", {"action": "wait", "session_id": sid, "timeout": 5}, "golden-task"))
steps.append(step("process", {"action": "log", "session_id": sid}, "golden-task"))
rec("background_pty_cat_write_submit_close", steps, "pty=true (ptyprocess). In pipe mode (pty=false) a local background process gets stdin=DEVNULL, see background_cat_write_submit_close.")

# list with no task id (unfiltered) vs with a task id
s1 = step("terminal", {"command": "echo listed; sleep 20", "background": True}, None)
sid1 = json.loads(s1["result"])["session_id"]
time.sleep(1)
rec("process_list_entries", [s1, step("process", {"action": "list"}, None), step("process", {"action": "list"}, "task_7"),
    step("process", {"action": "kill", "session_id": sid1}, None)],
    "list filters by task_id == the spawning session's task_id; terminal() stores the COLLAPSED container id ('default') as task_id, so list called with any other task_id (e.g. batch_runner's task ids) returns [] unless a session key contextvar matches.")

# file tools relative path vs terminal cwd
steps = [step("terminal", {"command": "mkdir -p ftest && cd ftest && pwd"}, "ftask"),
         step("write_file", {"path": "rel.txt", "content": "x\n"}, "ftask"),
         step("terminal", {"command": "ls -1 rel.txt 2>&1; ls -1 ../rel.txt 2>&1; pwd"}, "ftask"),
         step("read_file", {"path": "rel.txt"}, "ftask")]
rec("file_tools_relative_path", steps)
