//! Costs as `LiteLLM`'s own cost function computes them: `golden/litellm/costs.json` holds usages
//! as servers send them (OpenAI-style with cached tokens, Anthropic-style with cache writes in
//! both the gateway and the native shape, reasoning models with and without a reasoning rate,
//! a prompt on each side of a price tier's threshold, a model without a cache price), the model's
//! entry of `LiteLLM`'s bundled price table, and what `litellm.cost_per_token` made of them
//! (recorded by `golden/litellm/record.py`, which says how to record them again); and usages
//! billed at the flex and priority tiers and through a Batch API, as `LiteLLM`'s
//! `cost_per_token(service_tier=…)` and `batch_cost_calculator` price them. Each must come
//! out the same here, to the cent's millionth.

use std::path::Path;

use serde_json::Value;
use trajectory_worker::model::Usage;
use trajectory_worker::pricing::{CostSource, PriceTier, Prices};

/// A cent's millionth, in USD.
const TOLERANCE: f64 = 1e-8;

#[test]
fn every_golden_usage_costs_what_litellm_says() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/litellm/costs.json");
    let golden: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let cases = golden["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 19, "the recorded cases");
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let entry = case["entry"].as_object().unwrap();
        let prices = Prices::from_litellm(entry).unwrap_or_else(|err| panic!("{name}: {err}"));
        let usage = Usage::from_json(&case["usage"]);
        let tier = match case["tier"].as_str() {
            None => PriceTier::Standard,
            Some("flex") => PriceTier::Flex,
            Some("priority") => PriceTier::Priority,
            Some("batch") => PriceTier::Batch,
            Some(other) => panic!("{name}: a tier not priced here: {other}"),
        };
        let cost = prices.cost(usage.tokens(), Usage::reported_cost(&case["usage"]), tier);
        let expected_prompt = case["litellm"]["prompt_cost"].as_f64().unwrap();
        let expected_completion = case["litellm"]["completion_cost"].as_f64().unwrap();
        let prompt = cost.input + cost.cached_input + cost.cache_write;
        assert!(
            (prompt - expected_prompt).abs() < TOLERANCE,
            "{name}: prompt {prompt} against LiteLLM's {expected_prompt} ({usage:?})"
        );
        assert!(
            (cost.output - expected_completion).abs() < TOLERANCE,
            "{name}: completion {} against LiteLLM's {expected_completion} ({usage:?})",
            cost.output
        );
        assert!(
            (cost.total - expected_prompt - expected_completion).abs() < TOLERANCE,
            "{name}: total"
        );
        assert_eq!(cost.source, CostSource::Prices, "{name}");
    }
}

#[test]
fn the_two_anthropic_shapes_are_one_usage() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/litellm/costs.json");
    let golden: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let usage_of = |name: &str| {
        let case = golden["cases"]
            .as_array()
            .unwrap()
            .iter()
            .find(|case| case["name"] == name)
            .unwrap();
        Usage::from_json(&case["usage"])
    };
    let gateway = usage_of("anthropic_via_openai_compatible_gateway");
    assert_eq!(gateway, usage_of("anthropic_native"));
    assert_eq!(
        (
            gateway.prompt_tokens,
            gateway.cached_tokens,
            gateway.cache_write_tokens
        ),
        (5200, 3000, 1200),
        "every input token counted once, the cache's among them"
    );
}
