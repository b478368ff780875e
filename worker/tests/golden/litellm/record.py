"""Records how LiteLLM's own cost function prices a set of usages, as the golden file of
worker/tests/pricing_golden.rs (costs.json beside this script).

Each case is a usage object as a server sends it in a chat completion (OpenAI-style with cached
tokens, the same with cache writes as OpenAI-compatible gateways in front of Anthropic send it,
Anthropic's own shape, reasoning models, a prompt over a price tier's threshold, a model without
a cache price) and a model of LiteLLM's bundled price table; the file keeps the model's entry, so
the test prices from the same numbers without LiteLLM.

    python3 -m venv /tmp/litellm-venv && /tmp/litellm-venv/bin/pip install litellm==1.110.2
    LITELLM_LOCAL_MODEL_COST_MAP=True /tmp/litellm-venv/bin/python worker/tests/golden/litellm/record.py
"""

import importlib.metadata
import json
import os
import sys
from pathlib import Path

os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"  # the bundled table, not a download

import litellm  # noqa: E402
from litellm.llms.anthropic.chat.transformation import AnthropicConfig  # noqa: E402
from litellm.cost_calculator import batch_cost_calculator  # noqa: E402
from litellm.types.utils import Usage  # noqa: E402

CASES = [
    ("openai_cached", "gpt-4o", "openai",
     {"prompt_tokens": 2000, "completion_tokens": 300, "total_tokens": 2300,
      "prompt_tokens_details": {"cached_tokens": 1536}}),
    ("openai_uncached", "gpt-4o-mini", "openai",
     {"prompt_tokens": 1234, "completion_tokens": 567, "total_tokens": 1801}),
    ("anthropic_via_openai_compatible_gateway", "claude-sonnet-4-5", "anthropic",
     {"prompt_tokens": 5200, "completion_tokens": 400, "total_tokens": 5600,
      "prompt_tokens_details": {"cached_tokens": 3000},
      "cache_creation_input_tokens": 1200, "cache_read_input_tokens": 3000}),
    ("anthropic_native", "claude-sonnet-4-5", "anthropic",
     {"input_tokens": 1000, "output_tokens": 400,
      "cache_creation_input_tokens": 1200, "cache_read_input_tokens": 3000}),
    ("reasoning_same_rate", "o3-mini", "openai",
     {"prompt_tokens": 1000, "completion_tokens": 2500, "total_tokens": 3500,
      "completion_tokens_details": {"reasoning_tokens": 2000},
      "prompt_tokens_details": {"cached_tokens": 512}}),
    ("reasoning_own_rate", "dashscope/qwen-turbo", "dashscope",
     {"prompt_tokens": 3000, "completion_tokens": 1800, "total_tokens": 4800,
      "completion_tokens_details": {"reasoning_tokens": 1500}}),
    ("tier_below_threshold", "gemini/gemini-2.5-pro", "gemini",
     {"prompt_tokens": 200000, "completion_tokens": 1000, "total_tokens": 201000,
      "prompt_tokens_details": {"cached_tokens": 150000}}),
    ("tier_above_threshold", "gemini/gemini-2.5-pro", "gemini",
     {"prompt_tokens": 250000, "completion_tokens": 1000, "total_tokens": 251000,
      "prompt_tokens_details": {"cached_tokens": 200000}}),
    ("cache_hits_priced_apart", "deepseek/deepseek-chat", "deepseek",
     {"prompt_tokens": 40000, "completion_tokens": 900, "total_tokens": 40900,
      "prompt_tokens_details": {"cached_tokens": 38400}}),
    ("no_cache_price", "dashscope/qwen-turbo", "dashscope",
     {"prompt_tokens": 4000, "completion_tokens": 100, "total_tokens": 4100,
      "prompt_tokens_details": {"cached_tokens": 1000}}),
]

# Service tiers: the same usages billed at the flex and priority tiers (cost_per_token's
# service_tier) and through a Batch API (batch_cost_calculator): a model with the tier's own
# rates, one without (flex falls back to the standard rates, a batch to half of them), and
# thresholds with rates of the tier's own.
TIER_CASES = [
    ("flex_own_rates", "gpt-5-mini", "openai", "flex",
     {"prompt_tokens": 2000, "completion_tokens": 300, "total_tokens": 2300,
      "prompt_tokens_details": {"cached_tokens": 1536}}),
    ("flex_without_flex_rates", "gpt-4o", "openai", "flex",
     {"prompt_tokens": 2000, "completion_tokens": 300, "total_tokens": 2300,
      "prompt_tokens_details": {"cached_tokens": 1536}}),
    ("flex_above_threshold", "gpt-6-astra", "openai", "flex",
     {"prompt_tokens": 300000, "completion_tokens": 1000, "total_tokens": 301000,
      "prompt_tokens_details": {"cached_tokens": 200000}}),
    ("flex_gemini_above_threshold", "gemini/gemini-2.5-pro", "gemini", "flex",
     {"prompt_tokens": 250000, "completion_tokens": 1000, "total_tokens": 251000,
      "prompt_tokens_details": {"cached_tokens": 200000}}),
    ("priority_own_rates", "gpt-4o", "openai", "priority",
     {"prompt_tokens": 2000, "completion_tokens": 300, "total_tokens": 2300,
      "prompt_tokens_details": {"cached_tokens": 1536}}),
    ("batch_own_rates", "gpt-4o", "openai", "batch",
     {"prompt_tokens": 2000, "completion_tokens": 300, "total_tokens": 2300,
      "prompt_tokens_details": {"cached_tokens": 1536}}),
    ("batch_own_cache_rate", "gpt-5-mini", "openai", "batch",
     {"prompt_tokens": 2000, "completion_tokens": 300, "total_tokens": 2300,
      "prompt_tokens_details": {"cached_tokens": 1536}}),
    ("batch_half_without_batch_rates", "deepseek/deepseek-chat", "deepseek", "batch",
     {"prompt_tokens": 40000, "completion_tokens": 900, "total_tokens": 40900,
      "prompt_tokens_details": {"cached_tokens": 38400}}),
    ("batch_above_threshold", "gemini/gemini-2.5-pro", "gemini", "batch",
     {"prompt_tokens": 250000, "completion_tokens": 1000, "total_tokens": 251000,
      "prompt_tokens_details": {"cached_tokens": 200000}}),
]


def litellm_usage(raw: dict) -> Usage:
    if "input_tokens" in raw:
        return AnthropicConfig().calculate_usage(usage_object=raw, reasoning_content=None)
    return Usage(**raw)


def main() -> None:
    table = litellm.model_cost
    cases = []
    standard = [(name, model, provider, None, raw) for name, model, provider, raw in CASES]
    for name, model, provider, tier, raw in standard + TIER_CASES:
        if tier == "batch":
            prompt_cost, completion_cost = batch_cost_calculator(
                usage=litellm_usage(raw), model=model, custom_llm_provider=provider
            )
        else:
            prompt_cost, completion_cost = litellm.cost_per_token(
                model=model, custom_llm_provider=provider, usage_object=litellm_usage(raw),
                service_tier=tier,
            )
        case = {
            "name": name,
            "model": model,
            "entry": table[model],
            "usage": raw,
            "litellm": {"prompt_cost": prompt_cost, "completion_cost": completion_cost},
        }
        if tier is not None:
            case["tier"] = tier
        cases.append(case)
    out = Path(__file__).with_name("costs.json")
    out.write_text(json.dumps({"litellm": importlib.metadata.version("litellm"),
                               "cases": cases}, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(cases)} cases to {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
