#!/usr/bin/env python3
"""Smoke test of a running model server (stdlib only).

Usage: scripts/model-server/with-model-server.sh python3 scripts/model-server/smoke.py [-v]
   or: source /tmp/trajectory-model-server/env && python3 scripts/model-server/smoke.py

Checks, against MODEL_BASE_URL / MODEL_NAME:
  1. a chat completion with a weather tool and tool_choice "auto" answers with tool_calls;
  2. a chat completion without tools answers with text.
Exits non-zero if either fails. -v prints the raw responses.
"""

import json
import os
import sys
import time
import urllib.error
import urllib.request

BASE = os.environ["MODEL_BASE_URL"].rstrip("/")
MODEL = os.environ["MODEL_NAME"]
VERBOSE = "-v" in sys.argv[1:]

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "City name"}},
            "required": ["city"],
        },
    },
}


def chat(body, timeout=120):
    body = {"model": MODEL, "temperature": 0, "max_tokens": 128, **body}
    req = urllib.request.Request(
        BASE + "/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            out = json.load(r)
    except urllib.error.HTTPError as e:
        raise SystemExit(f"HTTP {e.code}: {e.read().decode(errors='replace')[:2000]}")
    dt = time.monotonic() - t0
    if VERBOSE:
        print(json.dumps(out, indent=2))
    return out, dt


def main():
    failures = 0

    out, dt = chat(
        {
            "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
            "tools": [WEATHER_TOOL],
            "tool_choice": "auto",
        }
    )
    msg = out["choices"][0]["message"]
    calls = msg.get("tool_calls") or []
    if calls:
        fn = calls[0]["function"]
        print(f"ok   tool call in {dt:.2f}s: {fn['name']}({fn['arguments']})"
              f" finish_reason={out['choices'][0]['finish_reason']}")
    else:
        failures += 1
        print(f"FAIL no tool_calls in {dt:.2f}s: {json.dumps(msg)[:500]}")

    out, dt = chat({"messages": [{"role": "user", "content": "Say hello in one short sentence."}]})
    text = out["choices"][0]["message"].get("content") or ""
    if text.strip():
        print(f"ok   text in {dt:.2f}s: {text.strip()[:200]!r}")
    else:
        failures += 1
        print(f"FAIL no text in {dt:.2f}s: {json.dumps(out)[:500]}")

    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
