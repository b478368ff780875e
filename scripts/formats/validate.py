"""Checks an export of `trajectory-worker export` with each format's own published code.

Usage: validate.py FORMAT FILE   (FORMAT: atif, adp, sharegpt, openai)

- atif: Harbor's own validator (harbor.utils.trajectory_validator.TrajectoryValidator, the
  pydantic models Harbor 0.25.0 reads trajectories with) on every line, plus ATIF's rule that
  token id arrays are as long as their counts.
- adp: the Agent Data Protocol's models (adp_schema.py, from its repository) on every line.
- sharegpt, openai: Hugging Face `datasets` loads the file as a JSON dataset (one schema for
  all rows), and each row's turns are checked for the roles and the call/result pairing the
  trainers' chat templates need.

Prints what it checked as one JSON object on stdout; exits 1, naming the line, at the first
line that fails.
"""

import json
import sys
from pathlib import Path


def fail(path, line, message):
    print(f"{path}:{line}: {message}", file=sys.stderr)
    sys.exit(1)


def lines(path):
    with open(path, encoding="utf-8") as file:
        for number, text in enumerate(file, start=1):
            yield number, text


def check_atif(path):
    from harbor.utils.trajectory_validator import TrajectoryValidator

    counts = {"documents": 0, "agent_steps": 0, "steps_with_ids": 0, "tool_calls": 0, "observations": 0}
    for number, text in lines(path):
        document = json.loads(text)
        validator = TrajectoryValidator()
        if not validator.validate(document):
            fail(path, number, "; ".join(validator.get_errors()))
        counts["documents"] += 1
        for step in document["steps"]:
            if step["source"] == "agent":
                counts["agent_steps"] += 1
            counts["tool_calls"] += len(step.get("tool_calls") or [])
            counts["observations"] += len((step.get("observation") or {}).get("results", []))
            metrics = step.get("metrics") or {}
            if "completion_token_ids" in metrics:
                counts["steps_with_ids"] += 1
                if len(metrics["completion_token_ids"]) != metrics["completion_tokens"]:
                    fail(path, number, f"step {step['step_id']}: completion ids != completion_tokens")
                if len(metrics["prompt_token_ids"]) != metrics["prompt_tokens"]:
                    fail(path, number, f"step {step['step_id']}: prompt ids != prompt_tokens")
                if len(metrics.get("logprobs", [])) != len(metrics["completion_token_ids"]):
                    fail(path, number, f"step {step['step_id']}: a logprob per completion id")
    return counts


def check_adp(path):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from adp_schema import ApiAction, MessageAction, TextObservation, Trajectory

    counts = {"trajectories": 0, "api_actions": 0, "message_actions": 0, "tool_results": 0}
    for number, text in lines(path):
        try:
            trajectory = Trajectory.model_validate_json(text)
        except Exception as error:  # pydantic's ValidationError, or JSON
            fail(path, number, str(error))
        counts["trajectories"] += 1
        for item in trajectory.content:
            if isinstance(item, ApiAction):
                counts["api_actions"] += 1
            elif isinstance(item, MessageAction):
                counts["message_actions"] += 1
            elif isinstance(item, TextObservation) and item.tool_call_id is not None:
                counts["tool_results"] += 1
    return counts


def load(path):
    import datasets

    datasets.disable_progress_bars()
    dataset = datasets.load_dataset("json", data_files=str(path), split="train")
    expected = sum(1 for _ in lines(path))
    if dataset.num_rows != expected:
        fail(path, 0, f"datasets read {dataset.num_rows} rows of {expected} lines")
    return dataset


def check_sharegpt(path):
    dataset = load(path)
    counts = {"rows": dataset.num_rows, "columns": sorted(dataset.column_names), "turns": 0}
    for number, row in enumerate(dataset, start=1):
        roles = [turn["from"] for turn in row["conversations"]]
        if roles[:2] != ["system", "human"] or not set(roles) <= {"system", "human", "gpt", "tool"}:
            fail(path, number, f"roles {roles}")
        counts["turns"] += len(roles)
    return counts


def check_openai(path):
    dataset = load(path)
    counts = {"rows": dataset.num_rows, "columns": sorted(dataset.column_names), "tool_calls": 0, "tool_messages": 0}
    for number, row in enumerate(dataset, start=1):
        asked = set()
        for message in row["messages"]:
            role = message["role"]
            if role not in {"system", "user", "assistant", "tool"}:
                fail(path, number, f"role {role!r}")
            for call in message.get("tool_calls") or []:
                json.loads(call["function"]["arguments"])
                asked.add(call["id"])
                counts["tool_calls"] += 1
            if role == "tool":
                if message["tool_call_id"] not in asked:
                    fail(path, number, f"a tool message answers no call: {message['tool_call_id']!r}")
                counts["tool_messages"] += 1
        for tool in row["tools"]:
            if tool["type"] != "function" or not tool["function"]["name"]:
                fail(path, number, f"tool {tool}")
    return counts


def main():
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    check = {"atif": check_atif, "adp": check_adp, "sharegpt": check_sharegpt, "openai": check_openai}
    counts = check[sys.argv[1]](Path(sys.argv[2]))
    print(json.dumps(counts))


if __name__ == "__main__":
    main()
