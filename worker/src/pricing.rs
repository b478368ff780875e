//! What a completion cost: the run's prices (`spec.model.pricing`) applied to each completion's
//! usage, the way `LiteLLM`'s cost function applies its price table, so that a run's figures agree
//! with the tool most users check their bills against (`worker/tests/pricing_golden.rs` holds
//! `LiteLLM`'s own results).
//!
//! Each completion is priced on its own, not the conversation's summed usage: a price tier
//! (`input_cost_per_token_above_200k_tokens`) applies to one request's prompt. Its [`Tokens`]
//! come normalised (the model client's usage): `prompt` counts every input token, cache reads
//! (`cached`) and cache writes (`cache_write`) included, whichever convention the server used. A
//! cost the provider reports itself (`OpenRouter`'s `usage.cost`) is used as it is, unless the run
//! says otherwise.
//!
//! Like [`crate::spec`] it builds with serde alone: [`crate::validate`] refuses prices that
//! cannot be used before any pod starts, with these words.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::spec::PricingSpec;

/// Prices that cannot be used: which field of `spec.model.pricing`, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PricingError {
    pub field: &'static str,
    pub message: String,
}

impl std::fmt::Display for PricingError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "spec.model.pricing.{}: {}", self.field, self.message)
    }
}

impl std::error::Error for PricingError {}

/// The token counts of one completion, in one convention: `prompt` counts every input token,
/// the cache's reads and writes included; `completion` every output token, reasoning included.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Tokens {
    pub prompt: u64,
    pub cached: u64,
    pub cache_write: u64,
    pub completion: u64,
    pub reasoning: u64,
}

/// USD per token of each kind, for prompts up to a tier's threshold.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Rates {
    input: f64,
    output: f64,
    /// Absent: cache reads cost what other input costs.
    cache_read: Option<f64>,
    /// Absent: cache writes cost what other input costs.
    cache_write: Option<f64>,
}

/// The run's prices.
#[derive(Debug, Clone, PartialEq)]
pub struct Prices {
    base: Rates,
    /// Rates for prompts of more than the threshold's tokens, by ascending threshold; each
    /// overrides what it names, over the tiers below it.
    tiers: Vec<(u64, TierRates)>,
    /// USD per reasoning token, when the model prices them apart from other output.
    reasoning: Option<f64>,
    /// A cost the provider reports with the usage is taken as the completion's cost.
    prefer_reported: bool,
}

/// What a tier changes; what it leaves out stays as below it.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
struct TierRates {
    input: Option<f64>,
    output: Option<f64>,
    cache_read: Option<f64>,
    cache_write: Option<f64>,
}

/// Where a cost came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CostSource {
    /// The run's prices applied to the usage.
    Prices,
    /// The provider's own figure (`usage.cost`).
    Reported,
    /// Some completions of each.
    Mixed,
}

/// What one completion, or a whole conversation, cost in USD: the parts the prices give (zero
/// for a reported cost, which comes whole) and their total.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Cost {
    /// Input tokens neither read from nor written to a cache.
    pub input: f64,
    pub cached_input: f64,
    pub cache_write: f64,
    /// Output tokens, reasoning included.
    pub output: f64,
    pub total: f64,
    pub source: CostSource,
}

impl Cost {
    /// A cost the provider reported whole.
    pub fn reported(total: f64) -> Self {
        Self {
            input: 0.0,
            cached_input: 0.0,
            cache_write: 0.0,
            output: 0.0,
            total,
            source: CostSource::Reported,
        }
    }

    /// This cost and `other`, one after the other.
    pub fn add(&mut self, other: Self) {
        self.input += other.input;
        self.cached_input += other.cached_input;
        self.cache_write += other.cache_write;
        self.output += other.output;
        self.total += other.total;
        if self.source != other.source {
            self.source = CostSource::Mixed;
        }
    }

    /// `total` of a conversation that may have cost nothing priced yet.
    pub fn add_to(total: &mut Option<Self>, other: Self) {
        match total {
            Some(total) => total.add(other),
            None => *total = Some(other),
        }
    }
}

/// Per million tokens, as people quote prices, to per token.
const PER_MILLION: f64 = 1_000_000.0;

impl Prices {
    /// The run's prices: USD per million tokens given inline, or one model's entry of `LiteLLM`'s
    /// price table (`model_prices_and_context_window.json`), never both.
    pub fn from_spec(spec: &PricingSpec) -> Result<Self, PricingError> {
        let inline = [
            spec.input,
            spec.cached_input,
            spec.cache_write,
            spec.output,
            spec.reasoning,
        ]
        .iter()
        .any(Option::is_some);
        let mut prices = match (&spec.litellm, inline) {
            (Some(_), true) => {
                return Err(PricingError {
                    field: "litellm",
                    message: "give LiteLLM's entry or inline prices (input, output, …), not both"
                        .into(),
                });
            }
            (Some(Value::Object(entry)), false) => Self::from_litellm(entry)?,
            (Some(_), false) => {
                return Err(PricingError {
                    field: "litellm",
                    message: "must be an object: one model's entry of LiteLLM's price table".into(),
                });
            }
            (None, _) => {
                let per_token = |value: Option<f64>, field: &'static str| {
                    value
                        .map(|value| checked(value, field).map(|value| value / PER_MILLION))
                        .transpose()
                };
                let required = |value: Option<f64>, field: &'static str| {
                    per_token(value, field)?.ok_or_else(|| PricingError {
                        field,
                        message: "is required (USD per million tokens)".into(),
                    })
                };
                Self {
                    base: Rates {
                        input: required(spec.input, "input")?,
                        output: required(spec.output, "output")?,
                        cache_read: per_token(spec.cached_input, "cachedInput")?,
                        cache_write: per_token(spec.cache_write, "cacheWrite")?,
                    },
                    tiers: Vec::new(),
                    reasoning: per_token(spec.reasoning, "reasoning")?,
                    prefer_reported: true,
                }
            }
        };
        prices.prefer_reported = spec.prefer_reported_cost;
        Ok(prices)
    }

    /// Prices from one entry of `LiteLLM`'s table: `input_cost_per_token`,
    /// `output_cost_per_token`, `cache_read_input_token_cost`,
    /// `cache_creation_input_token_cost`, `output_cost_per_reasoning_token` and the tiers
    /// `<rate>_above_<N>[k]_tokens`. Other fields (batch, audio, image, service-tier rates) are
    /// not what a chat completion of a run is billed at, and are ignored.
    pub fn from_litellm(entry: &Map<String, Value>) -> Result<Self, PricingError> {
        let rate = |key: &str| -> Result<Option<f64>, PricingError> {
            match entry.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(value) => value
                    .as_f64()
                    .ok_or_else(|| PricingError {
                        field: "litellm",
                        message: format!("{key} is not a number: {value}"),
                    })
                    .and_then(|value| checked(value, "litellm").map(Some)),
            }
        };
        let required = |key: &str| {
            rate(key)?.ok_or_else(|| PricingError {
                field: "litellm",
                message: format!("the entry has no {key}"),
            })
        };
        let mut tiers: Vec<(u64, TierRates)> = Vec::new();
        for key in entry.keys() {
            let Some((kind, threshold)) = tier_key(key) else {
                continue;
            };
            let Some(value) = rate(key)? else { continue };
            let at = match tiers.binary_search_by_key(&threshold, |(above, _)| *above) {
                Ok(at) => at,
                Err(at) => {
                    tiers.insert(at, (threshold, TierRates::default()));
                    at
                }
            };
            let tier = &mut tiers[at].1;
            match kind {
                RateKind::Input => tier.input = Some(value),
                RateKind::Output => tier.output = Some(value),
                RateKind::CacheRead => tier.cache_read = Some(value),
                RateKind::CacheWrite => tier.cache_write = Some(value),
            }
        }
        Ok(Self {
            base: Rates {
                input: required("input_cost_per_token")?,
                output: required("output_cost_per_token")?,
                cache_read: rate("cache_read_input_token_cost")?,
                cache_write: rate("cache_creation_input_token_cost")?,
            },
            tiers,
            reasoning: rate("output_cost_per_reasoning_token")?,
            prefer_reported: true,
        })
    }

    /// What one completion with `usage` (and the provider's own figure, if it sent one) cost.
    pub fn cost(&self, usage: Tokens, reported: Option<f64>) -> Cost {
        if let Some(total) = reported.filter(|_| self.prefer_reported) {
            return Cost::reported(total);
        }
        let rates = self.rates_for(usage.prompt);
        let uncached = usage
            .prompt
            .saturating_sub(usage.cached + usage.cache_write);
        let input = tokens(uncached) * rates.input;
        let cached_input = tokens(usage.cached) * rates.cache_read.unwrap_or(rates.input);
        let cache_write = tokens(usage.cache_write) * rates.cache_write.unwrap_or(rates.input);
        // Reasoning tokens are part of the completion's; priced apart only where the model
        // has a rate of its own for them.
        let reasoning = usage.reasoning.min(usage.completion);
        let output = match self.reasoning {
            Some(reasoning_rate) if reasoning > 0 => {
                tokens(usage.completion - reasoning) * rates.output
                    + tokens(reasoning) * reasoning_rate
            }
            _ => tokens(usage.completion) * rates.output,
        };
        Cost {
            input,
            cached_input,
            cache_write,
            output,
            // As LiteLLM sums them: the prompt's parts, then the completion.
            total: input + cached_input + cache_write + output,
            source: CostSource::Prices,
        }
    }

    /// The rates of a prompt of `prompt_tokens` tokens: each tier it exceeds, in turn.
    fn rates_for(&self, prompt_tokens: u64) -> Rates {
        let mut rates = self.base;
        for (above, tier) in &self.tiers {
            if prompt_tokens <= *above {
                break;
            }
            rates.input = tier.input.unwrap_or(rates.input);
            rates.output = tier.output.unwrap_or(rates.output);
            rates.cache_read = tier.cache_read.or(rates.cache_read);
            rates.cache_write = tier.cache_write.or(rates.cache_write);
        }
        rates
    }
}

#[allow(clippy::cast_precision_loss)] // token counts stay far below 2^52
fn tokens(count: u64) -> f64 {
    count as f64
}

fn checked(value: f64, field: &'static str) -> Result<f64, PricingError> {
    if value.is_finite() && value >= 0.0 {
        Ok(value)
    } else {
        Err(PricingError {
            field,
            message: format!("{value} is not a price (a number of at least 0)"),
        })
    }
}

enum RateKind {
    Input,
    Output,
    CacheRead,
    CacheWrite,
}

/// A tier's key, `<rate>_above_<N>[k]_tokens`: which rate, and above how many prompt tokens.
fn tier_key(key: &str) -> Option<(RateKind, u64)> {
    let (rate, rest) = key.split_once("_above_")?;
    let kind = match rate {
        "input_cost_per_token" => RateKind::Input,
        "output_cost_per_token" => RateKind::Output,
        "cache_read_input_token_cost" => RateKind::CacheRead,
        "cache_creation_input_token_cost" => RateKind::CacheWrite,
        _ => return None,
    };
    let count = rest.strip_suffix("_tokens")?;
    let threshold = match count.strip_suffix('k') {
        Some(thousands) => thousands.parse::<u64>().ok()?.checked_mul(1000)?,
        None => count.parse().ok()?,
    };
    Some((kind, threshold))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn usage(prompt: u64, cached: u64, written: u64, completion: u64, reasoning: u64) -> Tokens {
        Tokens {
            prompt,
            cached,
            cache_write: written,
            completion,
            reasoning,
        }
    }

    fn inline(input: f64, output: f64) -> PricingSpec {
        PricingSpec {
            input: Some(input),
            output: Some(output),
            ..PricingSpec::default()
        }
    }

    #[test]
    fn inline_prices_are_per_million_tokens_and_cache_reads_default_to_input() {
        let prices = Prices::from_spec(&inline(2.0, 8.0)).unwrap();
        let cost = prices.cost(usage(1_000_000, 250_000, 0, 500_000, 0), None);
        assert!((cost.input - 1.5).abs() < 1e-12, "{cost:?}");
        assert!((cost.cached_input - 0.5).abs() < 1e-12);
        assert!((cost.output - 4.0).abs() < 1e-12);
        assert!((cost.total - 6.0).abs() < 1e-12);
        assert_eq!(cost.source, CostSource::Prices);
    }

    #[test]
    fn a_reported_cost_is_taken_whole_unless_the_run_says_otherwise() {
        let mut spec = inline(2.0, 8.0);
        let reported = Prices::from_spec(&spec)
            .unwrap()
            .cost(usage(1000, 0, 0, 10, 0), Some(0.0123));
        assert_eq!(
            (reported.total, reported.source),
            (0.0123, CostSource::Reported)
        );
        spec.prefer_reported_cost = false;
        let from_prices = Prices::from_spec(&spec)
            .unwrap()
            .cost(usage(1000, 0, 0, 10, 0), Some(0.0123));
        assert_eq!(from_prices.source, CostSource::Prices);
        let mut total = reported;
        total.add(from_prices);
        assert_eq!(total.source, CostSource::Mixed);
    }

    #[test]
    fn bad_prices_name_their_field() {
        let both = PricingSpec {
            litellm: Some(json!({"input_cost_per_token": 1e-6, "output_cost_per_token": 1e-6})),
            ..inline(1.0, 1.0)
        };
        let errors = [
            both,
            PricingSpec {
                input: Some(1.0),
                ..PricingSpec::default()
            },
            inline(-1.0, 1.0),
            PricingSpec {
                litellm: Some(json!({"input_cost_per_token": 1e-6})),
                ..PricingSpec::default()
            },
            PricingSpec {
                litellm: Some(json!({"input_cost_per_token": "cheap", "output_cost_per_token": 1})),
                ..PricingSpec::default()
            },
        ]
        .map(|spec| Prices::from_spec(&spec).unwrap_err().to_string());
        assert_eq!(
            errors,
            [
                "spec.model.pricing.litellm: give LiteLLM's entry or inline prices (input, output, …), not both",
                "spec.model.pricing.output: is required (USD per million tokens)",
                "spec.model.pricing.input: -1 is not a price (a number of at least 0)",
                "spec.model.pricing.litellm: the entry has no output_cost_per_token",
                "spec.model.pricing.litellm: input_cost_per_token is not a number: \"cheap\"",
            ]
        );
    }

    #[test]
    fn tier_keys_name_their_rate_and_threshold() {
        let parsed = |key| tier_key(key).map(|(_, above)| above);
        assert_eq!(
            parsed("input_cost_per_token_above_200k_tokens"),
            Some(200_000)
        );
        assert_eq!(parsed("output_cost_per_token_above_128_tokens"), Some(128));
        assert_eq!(
            parsed("input_cost_per_token_above_200k_tokens_priority"),
            None
        );
        assert_eq!(parsed("cache_creation_input_token_cost_above_1hr"), None);
        assert_eq!(parsed("input_cost_per_token_batches"), None);
    }
}
