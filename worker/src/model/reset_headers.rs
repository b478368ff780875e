//! When a provider's rate limit has room again, from the headers it sends with a 429 in place of
//! (or besides) `Retry-After`:
//!
//! - `OpenAI` (and the servers that copy it): `x-ratelimit-reset-requests` and
//!   `x-ratelimit-reset-tokens`, Go-style durations (`1s`, `6m0s`, `20ms`, `0.5s`), with
//!   `x-ratelimit-remaining-requests` and `x-ratelimit-remaining-tokens`.
//! - Anthropic: `anthropic-ratelimit-{requests,tokens,input-tokens,output-tokens}-reset`, RFC 3339
//!   times, with the matching `…-remaining`.
//!
//! A 429 does not say which limit it hit; the limits whose remaining count is 0 do. The wait is
//! the longest of their resets (of all resets given, when none says 0).

use std::time::Duration;

use chrono::{DateTime, Utc};
use reqwest::header::HeaderMap;

/// (reset header, remaining header, how the reset is written) of every limit a provider names.
const LIMITS: [(&str, &str, Format); 6] = [
    (
        "x-ratelimit-reset-requests",
        "x-ratelimit-remaining-requests",
        Format::GoDuration,
    ),
    (
        "x-ratelimit-reset-tokens",
        "x-ratelimit-remaining-tokens",
        Format::GoDuration,
    ),
    (
        "anthropic-ratelimit-requests-reset",
        "anthropic-ratelimit-requests-remaining",
        Format::Rfc3339,
    ),
    (
        "anthropic-ratelimit-tokens-reset",
        "anthropic-ratelimit-tokens-remaining",
        Format::Rfc3339,
    ),
    (
        "anthropic-ratelimit-input-tokens-reset",
        "anthropic-ratelimit-input-tokens-remaining",
        Format::Rfc3339,
    ),
    (
        "anthropic-ratelimit-output-tokens-reset",
        "anthropic-ratelimit-output-tokens-remaining",
        Format::Rfc3339,
    ),
];

#[derive(Debug, Clone, Copy)]
enum Format {
    GoDuration,
    Rfc3339,
}

/// How long until the exhausted limit named in `headers` has room again, as of `now`; `None`
/// when the headers name no reset.
pub fn wait_for_reset(headers: &HeaderMap, now: DateTime<Utc>) -> Option<Duration> {
    let text = |name: &str| headers.get(name).and_then(|value| value.to_str().ok());
    let mut exhausted = None::<Duration>;
    let mut any = None::<Duration>;
    for (reset, remaining, format) in LIMITS {
        let Some(wait) = text(reset).and_then(|value| match format {
            Format::GoDuration => go_duration(value),
            Format::Rfc3339 => DateTime::parse_from_rfc3339(value.trim()).ok().map(|at| {
                (at.with_timezone(&Utc) - now)
                    .to_std()
                    .unwrap_or(Duration::ZERO)
            }),
        }) else {
            continue;
        };
        any = any.max(Some(wait));
        if text(remaining).is_some_and(|count| count.trim() == "0") {
            exhausted = exhausted.max(Some(wait));
        }
    }
    exhausted.or(any)
}

/// A Go duration (`time.Duration.String()`): numbers with units `h`, `m`, `s`, `ms`, `us`
/// (`µs`), `ns`, as in `1h2m3.5s`.
fn go_duration(text: &str) -> Option<Duration> {
    let mut rest = text.trim();
    if rest.is_empty() {
        return None;
    }
    let mut total = 0.0_f64;
    while !rest.is_empty() {
        let number_end = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let number: f64 = rest[..number_end].parse().ok()?;
        rest = &rest[number_end..];
        let unit_end = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let seconds = match &rest[..unit_end] {
            "h" => 3600.0,
            "m" => 60.0,
            "s" => 1.0,
            "ms" => 1e-3,
            "us" | "µs" => 1e-6,
            "ns" => 1e-9,
            _ => return None,
        };
        total += number * seconds;
        rest = &rest[unit_end..];
    }
    (total.is_finite() && total >= 0.0).then(|| Duration::from_secs_f64(total))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.insert(*name, value.parse().unwrap());
        }
        map
    }

    #[test]
    fn go_durations_as_openai_writes_them() {
        assert_eq!(go_duration("1s"), Some(Duration::from_secs(1)));
        assert_eq!(go_duration("6m0s"), Some(Duration::from_secs(360)));
        assert_eq!(go_duration("20ms"), Some(Duration::from_millis(20)));
        assert_eq!(
            go_duration("1h2m3.5s"),
            Some(Duration::from_millis(3_723_500))
        );
        assert_eq!(go_duration("0.25s"), Some(Duration::from_millis(250)));
        assert_eq!(go_duration(""), None);
        assert_eq!(go_duration("soon"), None);
        assert_eq!(go_duration("5 minutes"), None);
    }

    #[test]
    fn the_exhausted_limit_decides_the_wait() {
        let now = Utc::now();
        // `OpenAI`: requests left, tokens exhausted; the token reset is the wait.
        let openai = headers(&[
            ("x-ratelimit-remaining-requests", "59"),
            ("x-ratelimit-reset-requests", "1s"),
            ("x-ratelimit-remaining-tokens", "0"),
            ("x-ratelimit-reset-tokens", "6m0s"),
        ]);
        assert_eq!(wait_for_reset(&openai, now), Some(Duration::from_secs(360)));
        // None says 0: the longest reset given.
        let unclear = headers(&[
            ("x-ratelimit-reset-requests", "2s"),
            ("x-ratelimit-reset-tokens", "500ms"),
        ]);
        assert_eq!(wait_for_reset(&unclear, now), Some(Duration::from_secs(2)));
        // Anthropic: RFC 3339 times.
        let at = (now + chrono::Duration::seconds(30)).to_rfc3339();
        let anthropic = headers(&[
            ("anthropic-ratelimit-requests-remaining", "0"),
            ("anthropic-ratelimit-requests-reset", &at),
            ("anthropic-ratelimit-tokens-remaining", "12000"),
            ("anthropic-ratelimit-tokens-reset", &at),
        ]);
        let wait = wait_for_reset(&anthropic, now).unwrap();
        assert!(
            wait <= Duration::from_secs(30) && wait > Duration::from_secs(29),
            "{wait:?}"
        );
        // A reset in the past is no wait; no reset header, no answer.
        let past = headers(&[("anthropic-ratelimit-requests-reset", "2020-01-01T00:00:00Z")]);
        assert_eq!(wait_for_reset(&past, now), Some(Duration::ZERO));
        assert_eq!(wait_for_reset(&HeaderMap::new(), now), None);
    }
}
