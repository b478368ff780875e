import json, os, sys, time, tempfile, pathlib
OUT = pathlib.Path(sys.argv[1]); OUT.mkdir(parents=True, exist_ok=True)
WORK = pathlib.Path(os.environ["TERMINAL_CWD"])
import tools.terminal_tool  # registers terminal
import tools.process_registry  # registers process
from tools.registry import registry
TASK = "golden-task"
calls = []
def call(tool, args):
    t0 = time.monotonic()
    res = registry.dispatch(tool, args, task_id=TASK)
    dt = round(time.monotonic() - t0, 2)
    return res, dt
def rec(name, steps, note=None):
    d = {"steps": steps} if len(steps) > 1 else dict(steps[0])
    if note: d["note"] = note
    (OUT / f"{name}.json").write_text(json.dumps(d, ensure_ascii=False, indent=2) + "\n")
    print("==", name); [print(" ", s["call"], "->", s["result"][:300]) for s in steps]
def step(tool, args):
    r, dt = call(tool, args)
    return {"call": {"tool": tool, "args": args}, "result": r, "elapsed_s": dt}

# schemas
schemas = {n: registry.get_entry(n).schema for n in ("terminal", "process")}
(OUT / "_schemas.json").write_text(json.dumps(schemas, ensure_ascii=False, indent=2) + "\n")

rec("echo_hello", [step("terminal", {"command": "echo hello"})])
rec("exit_code_stderr", [step("terminal", {"command": "echo out; echo err >&2; exit 3"})])
rec("ansi_colour", [step("terminal", {"command": "printf '\\033[31mred\\033[0m\\n'"})])
rec("grep_no_match", [step("terminal", {"command": "echo abc | grep zzz"})])
rec("truncation_seq_300000", [step("terminal", {"command": "seq 1 300000"})])
rec("timeout_2s", [step("terminal", {"command": "echo start; sleep 30", "timeout": 2})])
rec("timeout_2s_no_output", [step("terminal", {"command": "sleep 30", "timeout": 2})])
rec("timeout_over_max", [step("terminal", {"command": "echo hi", "timeout": 601})])
rec("cd_persists", [step("terminal", {"command": "mkdir -p sub && cd sub"}), step("terminal", {"command": "pwd"})])
rec("export_persists", [step("terminal", {"command": "export X=1"}), step("terminal", {"command": "echo $X"})])
rec("workdir_arg", [step("terminal", {"command": "pwd", "workdir": str(WORK / "sub")}), step("terminal", {"command": "pwd"})])
rec("workdir_blocked", [step("terminal", {"command": "pwd", "workdir": "/tmp; rm -rf /"})])
rec("workdir_nonexistent", [step("terminal", {"command": "pwd", "workdir": "/nonexistent/dir"})])
rec("foreground_server_guard", [step("terminal", {"command": "python3 -m http.server 0"})])
rec("foreground_amp_guard", [step("terminal", {"command": "sleep 5 &"})])

# background sleep
s1 = step("terminal", {"command": "sleep 30", "background": True})
sid = json.loads(s1["result"])["session_id"]
time.sleep(1)
steps = [s1,
         step("process", {"action": "poll", "session_id": sid}),
         step("process", {"action": "log", "session_id": sid}),
         step("process", {"action": "wait", "session_id": sid, "timeout": 2}),
         step("process", {"action": "list"}),
         step("process", {"action": "kill", "session_id": sid})]
time.sleep(0.5)
steps += [step("process", {"action": "poll", "session_id": sid}),
          step("process", {"action": "kill", "session_id": sid}),
          step("process", {"action": "write", "session_id": sid, "data": "x"})]
rec("background_sleep_poll_log_wait_kill", steps)

# background with output, finished job wait
s2 = step("terminal", {"command": "for i in 1 2 3; do echo line$i; done; printf '\\033[32mgreen\\033[0m\\n'; exit 7", "background": True, "notify_on_complete": True})
sid2 = json.loads(s2["result"])["session_id"]
time.sleep(1.5)
rec("background_finished_job", [s2,
    step("process", {"action": "poll", "session_id": sid2}),
    step("process", {"action": "wait", "session_id": sid2, "timeout": 5}),
    step("process", {"action": "log", "session_id": sid2}),
    step("process", {"action": "log", "session_id": sid2, "offset": 1, "limit": 2})])

# cat job
s3 = step("terminal", {"command": "cat", "background": True})
sid3 = json.loads(s3["result"])["session_id"]
steps = [s3, step("process", {"action": "write", "session_id": sid3, "data": "hello "}),
         step("process", {"action": "submit", "session_id": sid3, "data": "world"})]
time.sleep(0.5)
steps += [step("process", {"action": "poll", "session_id": sid3}),
          step("process", {"action": "close", "session_id": sid3})]
time.sleep(0.5)
steps += [step("process", {"action": "wait", "session_id": sid3, "timeout": 5}),
          step("process", {"action": "close", "session_id": sid3}),
          step("process", {"action": "submit", "session_id": sid3, "data": "late"})]
rec("background_cat_write_submit_close", steps)

rec("process_list", [step("process", {"action": "list"})])
rec("process_unknown_session", [step("process", {"action": "poll", "session_id": "proc_000000000000"}),
    step("process", {"action": "log", "session_id": "proc_000000000000"}),
    step("process", {"action": "wait", "session_id": "proc_000000000000", "timeout": 1}),
    step("process", {"action": "kill", "session_id": "proc_000000000000"}),
    step("process", {"action": "write", "session_id": "proc_000000000000", "data": "x"}),
    step("process", {"action": "close", "session_id": "proc_000000000000"})])
rec("process_missing_session_id", [step("process", {"action": "poll"})])
rec("process_unknown_action", [step("process", {"action": "restart", "session_id": sid})])
rec("background_hint_plain", [step("terminal", {"command": "sleep 1", "background": True})])
