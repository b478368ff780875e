"""A minimal tool-calling agent for Harbor 0.25.0, for the benchmark that runs Harbor beside this
project on the same tasks with the same scripted OpenAI-compatible model: whatever differs in the
timings is then the harness, not the agent.

The loop: the task's instruction is the one user message, with one function tool, `terminal`
({"command": string}); each tool call of a reply is run in the task's environment through Harbor's
environment API (`environment.exec`, in the task's working directory, as the trial's default user)
and its output goes back as a `tool` message; the first reply without tool calls ends the run, as
do MAX_TURNS model calls.

Environment (Harbor's process environment, or `--ae KEY=VALUE`):
  OPENAI_BASE_URL      the endpoint's base URL, e.g. http://127.0.0.1:8000/v1 (required)
  TRAJ_SCRIPTED_MODEL  the model name sent (default: the -m model, else "scripted")
  OPENAI_API_KEY       sent as a bearer token when set
Each request carries the header x-session-id: <trial name> (the trial directory's name), so a
scripted server can keep one script position per conversation.

Use (the module must be importable: PYTHONPATH=scripts/harbor):
  PYTHONPATH=scripts/harbor scripts/harbor/with-docker.sh harbor run -p TASKS -e docker \
      -a scripted_agent:ScriptedAgent ...
Only the standard library and httpx (a Harbor dependency) are used. The conversation is written to
the trial's agent log directory as messages.json.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx

from harbor.agents.base import BaseAgent
from harbor.environments.base import BaseEnvironment
from harbor.models.agent.context import AgentContext

MAX_TURNS = 32
HTTP_TIMEOUT_SEC = 600.0

TERMINAL_TOOL = {
    "type": "function",
    "function": {
        "name": "terminal",
        "description": "Run a shell command in the task's environment and return its output.",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string", "description": "The command to run."}},
            "required": ["command"],
        },
    },
}


class ScriptedAgent(BaseAgent):
    @staticmethod
    def name() -> str:
        return "scripted"

    def version(self) -> str | None:
        return "1"

    async def setup(self, environment: BaseEnvironment) -> None:
        pass

    def _trial_name(self) -> str:
        # Harbor sets session_id to "<trial name>__agent"; the agent's log directory is
        # <trial dir>/agent, and the trial directory is named after the trial.
        if self.session_id and self.session_id.endswith("__agent"):
            return self.session_id[: -len("__agent")]
        return Path(self.logs_dir).parent.name

    async def run(
        self,
        instruction: str,
        environment: BaseEnvironment,
        context: AgentContext,
    ) -> None:
        base_url = self._get_env("OPENAI_BASE_URL")
        if not base_url:
            raise ValueError("OPENAI_BASE_URL is not set (e.g. http://127.0.0.1:8000/v1)")
        model = self._get_env("TRAJ_SCRIPTED_MODEL") or self.model_name or "scripted"
        headers = {"x-session-id": self._trial_name()}
        api_key = self._get_env("OPENAI_API_KEY")
        if api_key:
            headers["authorization"] = f"Bearer {api_key}"

        messages: list[dict] = [{"role": "user", "content": instruction}]
        turns = commands = 0
        n_input = n_output = 0
        model_seconds = tool_seconds = 0.0
        try:
            async with httpx.AsyncClient(
                base_url=base_url.rstrip("/") + "/", headers=headers, timeout=HTTP_TIMEOUT_SEC
            ) as client:
                while turns < MAX_TURNS:
                    turns += 1
                    started = time.monotonic()
                    response = await client.post(
                        "chat/completions",
                        json={"model": model, "messages": messages, "tools": [TERMINAL_TOOL]},
                    )
                    model_seconds += time.monotonic() - started
                    if response.status_code != 200:
                        raise RuntimeError(
                            f"POST {response.request.url}: HTTP {response.status_code}: "
                            f"{response.text[:500]}"
                        )
                    body = response.json()
                    usage = body.get("usage") or {}
                    n_input += int(usage.get("prompt_tokens") or 0)
                    n_output += int(usage.get("completion_tokens") or 0)
                    reply = body["choices"][0]["message"]
                    tool_calls = reply.get("tool_calls") or []
                    assistant: dict = {"role": "assistant", "content": reply.get("content")}
                    if tool_calls:
                        assistant["tool_calls"] = tool_calls
                    messages.append(assistant)
                    if not tool_calls:
                        break
                    for call in tool_calls:
                        function = call.get("function") or {}
                        if function.get("name") != "terminal":
                            output = f"unknown tool {function.get('name')!r}: the only tool is terminal"
                        else:
                            try:
                                arguments = json.loads(function.get("arguments") or "{}")
                                command = arguments["command"]
                            except (ValueError, KeyError, TypeError) as exc:
                                output = f"invalid arguments for terminal ({exc}): {function.get('arguments')!r}"
                            else:
                                commands += 1
                                started = time.monotonic()
                                result = await environment.exec(command)
                                tool_seconds += time.monotonic() - started
                                output = (result.stdout or "") + (result.stderr or "")
                                if result.return_code != 0:
                                    output += f"\n[exit code {result.return_code}]"
                        messages.append(
                            {"role": "tool", "tool_call_id": call.get("id", ""), "content": output}
                        )
        finally:
            context.n_input_tokens = n_input
            context.n_output_tokens = n_output
            context.metadata = {
                "turns": turns,
                "commands": commands,
                "model_seconds": round(model_seconds, 3),
                "tool_seconds": round(tool_seconds, 3),
            }
            try:
                (Path(self.logs_dir) / "messages.json").write_text(json.dumps(messages, indent=1))
            except OSError as exc:
                self.logger.warning("could not write messages.json: %s", exc)
