//! The provider's rate limits on the run's key (`spec.model.limits`), kept by this process at
//! its share: requests, input tokens and output tokens a minute.
//!
//! Each limit is a meter of the generic cell rate algorithm with reservations: a request
//! reserves its cells (one request; its prompt's estimated tokens; its `max_tokens`) and waits
//! until they fit, then is settled to what its answer used, which gives back what it reserved
//! too much. A meter lets through `rate` cells a minute after a first burst of `burst`, so that
//! over any window of `w` seconds at most `burst + rate × w / 60` go: with `burst` a twentieth of
//! the limit and `rate` the rest, never more than the limit in any 60 s, and 95 % of it
//! sustained. Waiting is in the process, in order of arrival: a request is never sent to be
//! refused.
//!
//! With `spec.model.limits.gubernator` the counts are kept by a Gubernator service for every pod
//! of the run, and of every run that names the same key, at the whole limit: its leaky bucket
//! with the same burst and rate, whose `max_wait` makes it queue a reservation and say when it
//! may go (`SCHEDULED`, `retry_after`) as the meter here does. A pod that cannot reach it keeps
//! its share with its own meters meanwhile, so the limit holds either way.
//!
//! A limit the spec does not set is learnt from the provider's answers (unless
//! `fromHeaders: false`): the first `x-ratelimit-limit-requests` / `-tokens` (`OpenAI`) or
//! `anthropic-ratelimit-{requests,tokens,input-tokens,output-tokens}-limit` (Anthropic) it reports
//! becomes a meter at this process's share, or a Gubernator bucket at the whole.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

use crate::spec::LimitsSpec;

const MINUTE: Duration = Duration::from_secs(60);

/// The share of a limit a meter may let through at once.
const BURST_SHARE: u64 = 20;

/// One limit: `rate` cells a minute after a burst of `burst`.
#[derive(Debug)]
pub struct Meter {
    /// Time per cell.
    interval: Duration,
    /// How far ahead of now the theoretical arrival time may run.
    tolerance: Duration,
    /// The theoretical arrival time: when the cells reserved so far have all been paid for.
    due: Mutex<Option<Instant>>,
}

impl Meter {
    /// A meter holding `limit` cells in any minute.
    pub fn per_minute(limit: u64) -> Self {
        // The burst is paid for out of the limit; one cell a minute goes at least.
        let (rate, burst) = rate_and_burst(limit);
        let interval = MINUTE.div_f64(rate as f64);
        Self {
            interval,
            tolerance: interval.saturating_mul(u32::try_from(burst).unwrap_or(u32::MAX)),
            due: Mutex::new(None),
        }
    }

    fn due(&self) -> std::sync::MutexGuard<'_, Option<Instant>> {
        self.due.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Reserves `cells`; returns when they may go (now, or later).
    fn reserve(&self, cells: u64, now: Instant) -> Instant {
        let mut due = self.due();
        let start = due.map_or(now, |due| due.max(now));
        let next = start + self.cost(cells);
        *due = Some(next);
        (next.checked_sub(self.tolerance).unwrap_or(now)).max(now)
    }

    /// Gives back `cells` reserved too many (they were not used), or takes `cells` more.
    fn adjust(&self, cells: i64, now: Instant) {
        let mut due = self.due();
        let current = due.map_or(now, |due| due.max(now));
        *due = Some(if cells >= 0 {
            current + self.cost(cells.unsigned_abs())
        } else {
            // Never below now: a cell given back cannot make a burst bigger than `burst`.
            current
                .checked_sub(self.cost(cells.unsigned_abs()))
                .unwrap_or(now)
                .max(now)
        });
    }

    /// The cells it lets through at once.
    fn burst(&self) -> u64 {
        u64::try_from(self.tolerance.as_nanos() / self.interval.as_nanos().max(1)).unwrap_or(0)
    }

    fn cost(&self, cells: u64) -> Duration {
        self.interval
            .saturating_mul(u32::try_from(cells).unwrap_or(u32::MAX))
    }
}

/// What one request reserved, to be settled by [`Limits::settle`]; holds its place among the
/// requests in flight until then.
#[derive(Debug)]
pub struct Reservation<'a> {
    pub input_tokens: u64,
    pub output_tokens: u64,
    /// Reserved at the Gubernator (else with this process's meters).
    shared: bool,
    _in_flight: Option<tokio::sync::SemaphorePermit<'a>>,
}

/// This process's share of the run's limits.
#[derive(Debug)]
pub struct Limits {
    /// Processes that may run the run's batches at once: what this one keeps alone is a share.
    processes: u64,
    /// A meter of each kind (by [`Kind::index`]) the spec set or the provider told.
    meters: [OnceLock<Meter>; KINDS],
    /// Requests in flight at once.
    in_flight: Option<tokio::sync::Semaphore>,
    /// The counts every pod shares, when a Gubernator keeps them.
    shared: Option<Shared>,
    /// Whether limits the spec does not set are learnt from the provider's headers.
    learn: bool,
    /// Cells of each kind reserved while it had no meter: a meter learnt later starts with
    /// them spent (they went out in the minute the provider counts).
    unmetered: [AtomicU64; KINDS],
}

const KINDS: usize = 4;

/// The kinds of cells a request takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Requests,
    InputTokens,
    OutputTokens,
    /// Input and output tokens together (`OpenAI`'s tokens a minute).
    Tokens,
}

impl Kind {
    const ALL: [Self; KINDS] = [
        Self::Requests,
        Self::InputTokens,
        Self::OutputTokens,
        Self::Tokens,
    ];

    fn index(self) -> usize {
        self as usize
    }

    fn name(self) -> &'static str {
        match self {
            Self::Requests => "requests",
            Self::InputTokens => "input-tokens",
            Self::OutputTokens => "output-tokens",
            Self::Tokens => "tokens",
        }
    }

    /// The spec's limit of this kind, a minute.
    fn in_spec(self, spec: &LimitsSpec) -> Option<u64> {
        match self {
            Self::Requests => spec.requests_per_minute,
            Self::InputTokens => spec.input_tokens_per_minute,
            Self::OutputTokens => spec.output_tokens_per_minute,
            Self::Tokens => spec.tokens_per_minute,
        }
    }

    /// The headers in which providers tell this kind's limit a minute.
    fn headers(self) -> &'static [&'static str] {
        match self {
            Self::Requests => &[
                "x-ratelimit-limit-requests",
                "anthropic-ratelimit-requests-limit",
            ],
            Self::InputTokens => &["anthropic-ratelimit-input-tokens-limit"],
            Self::OutputTokens => &["anthropic-ratelimit-output-tokens-limit"],
            Self::Tokens => &[
                "x-ratelimit-limit-tokens",
                "anthropic-ratelimit-tokens-limit",
            ],
        }
    }

    /// The cells a request of `input` and `output` tokens takes of this kind.
    fn cells(self, input: u64, output: u64) -> u64 {
        match self {
            Self::Requests => 1,
            Self::InputTokens => input,
            Self::OutputTokens => output,
            Self::Tokens => input.saturating_add(output),
        }
    }
}

/// A Gubernator's leaky buckets for a key: each kind's limit, as `(rate a minute, burst)`.
#[derive(Debug)]
struct Shared {
    http: reqwest::Client,
    /// `<url>/v1/GetRateLimits`.
    endpoint: String,
    key: String,
    /// Each kind's `(rate a minute, burst)` (by [`Kind::index`]), as set or learnt.
    buckets: [OnceLock<(u64, u64)>; KINDS],
    /// Whether it has failed since it last answered (told once, not a request).
    failing: std::sync::atomic::AtomicBool,
}

/// The longest a reservation may be queued at the Gubernator (ms): past it, asked again.
const MAX_WAIT_MS: u64 = 600_000;

impl Shared {
    fn new(spec: &crate::spec::GubernatorSpec, limits: &LimitsSpec) -> Self {
        let buckets = Kind::ALL.map(|kind| {
            kind.in_spec(limits)
                .map(rate_and_burst)
                .map_or_else(OnceLock::new, OnceLock::from)
        });
        Self {
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(5))
                .build()
                .unwrap_or_default(),
            endpoint: format!("{}/v1/GetRateLimits", spec.url.trim_end_matches('/')),
            key: spec.key.clone(),
            buckets,
            failing: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Takes `cells` of each kind (negative: gives them back); returns how long until all of
    /// them may go. Cells beyond a bucket's burst are taken a burst at a time, each queued.
    async fn take(&self, cells: &[(Kind, i64)]) -> Result<Duration, String> {
        let mut items = Vec::new();
        for &(kind, wanted) in cells {
            let Some((rate, burst)) = self.buckets[kind.index()].get() else {
                continue;
            };
            let burst_cells = i64::try_from(*burst).unwrap_or(i64::MAX);
            let mut left = wanted;
            // A refund is capped at the burst by the bucket itself; one item is enough.
            let chunks = if left < 0 {
                1
            } else {
                left.div_euclid(burst_cells) + 1
            };
            for _ in 0..chunks {
                let hits = left.clamp(-burst_cells, burst_cells);
                left -= hits;
                if hits == 0 {
                    continue;
                }
                items.push(serde_json::json!({
                    "name": "trajectory-model",
                    "unique_key": format!("{}/{}", self.key, kind.name()),
                    "hits": hits,
                    "limit": rate,
                    "burst": burst,
                    "duration": 60_000,
                    "algorithm": "LEAKY_BUCKET",
                    "max_wait": if hits > 0 { MAX_WAIT_MS } else { 0 },
                }));
            }
        }
        if items.is_empty() {
            return Ok(Duration::ZERO);
        }
        let response = self
            .http
            .post(&self.endpoint)
            .json(&serde_json::json!({ "requests": items }))
            .send()
            .await
            .map_err(|err| format!("cannot reach the Gubernator at {}: {err}", self.endpoint))?;
        let status = response.status();
        let body: serde_json::Value = response.json().await.map_err(|err| {
            format!(
                "the Gubernator at {} answered {status}: {err}",
                self.endpoint
            )
        })?;
        let mut wait = Duration::ZERO;
        for answer in body["responses"].as_array().into_iter().flatten() {
            let number = |field: &str| match &answer[field] {
                serde_json::Value::String(text) => text.parse::<u64>().ok(),
                value => value.as_u64(),
            };
            if let Some(error) = answer["error"].as_str().filter(|error| !error.is_empty()) {
                return Err(format!("the Gubernator at {}: {error}", self.endpoint));
            }
            match answer["status"].as_str().unwrap_or("UNDER_LIMIT") {
                "UNDER_LIMIT" | "SCHEDULED" => {
                    wait = wait.max(Duration::from_millis(number("retry_after").unwrap_or(0)));
                }
                // Queued longer than `MAX_WAIT_MS`: not counted; asked again after the wait.
                status => {
                    return Err(format!(
                        "the Gubernator at {} answered {status} for key {}",
                        self.endpoint, self.key
                    ));
                }
            }
        }
        Ok(wait)
    }

    fn note(&self, outcome: &Result<Duration, String>) {
        match outcome {
            Ok(_) => {
                if self.failing.swap(false, Ordering::Relaxed) {
                    tracing::info!(key = %self.key, "the Gubernator answers again; the pods share the limits through it");
                }
            }
            Err(error) => {
                if !self.failing.swap(true, Ordering::Relaxed) {
                    tracing::warn!(key = %self.key, %error, "the Gubernator does not answer; this pod keeps its share of the limits meanwhile");
                }
            }
        }
    }
}

/// A limit's `(rate a minute, burst)`: a twentieth of it at once, the rest at a steady rate,
/// so that no 60 s hold more than the limit.
fn rate_and_burst(limit: u64) -> (u64, u64) {
    let limit = limit.max(1);
    let burst = (limit / BURST_SHARE).max(1);
    let rate = (limit - burst.min(limit - 1)).max(1);
    (rate, burst)
}

impl Limits {
    /// The share of `spec` of one of `processes` processes that may run at once, learning what
    /// it does not set from the provider unless it says not to; `None` when there is nothing to
    /// keep or learn.
    pub fn share(spec: Option<&LimitsSpec>, processes: u64) -> Option<Self> {
        let processes = processes.max(1);
        let default = LimitsSpec::default();
        let spec = spec.unwrap_or(&default);
        let share = |limit: u64| (limit / processes).max(1);
        let limits = Self {
            processes,
            meters: Kind::ALL.map(|kind| {
                kind.in_spec(spec)
                    .map(|limit| Meter::per_minute(share(limit)))
                    .map_or_else(OnceLock::new, OnceLock::from)
            }),
            in_flight: spec.max_in_flight.map(|limit| {
                tokio::sync::Semaphore::new(
                    usize::try_from(share(limit))
                        .unwrap_or(usize::MAX)
                        .min(tokio::sync::Semaphore::MAX_PERMITS),
                )
            }),
            shared: spec
                .gubernator
                .as_ref()
                .map(|gubernator| Shared::new(gubernator, spec)),
            learn: spec.from_headers.unwrap_or(true),
            unmetered: Default::default(),
        };
        let any = limits.meters.iter().any(|meter| meter.get().is_some())
            || limits.in_flight.is_some()
            || limits.learn;
        any.then_some(limits)
    }

    /// Learns the limits the spec did not set from a provider's answer's headers (the first
    /// value of each kind it tells).
    pub fn learn(&self, headers: &reqwest::header::HeaderMap) {
        if !self.learn {
            return;
        }
        for kind in Kind::ALL {
            let slot = &self.meters[kind.index()];
            if slot.get().is_some() {
                continue;
            }
            let Some(limit) = kind.headers().iter().find_map(|name| {
                headers
                    .get(*name)?
                    .to_str()
                    .ok()?
                    .trim()
                    .parse::<u64>()
                    .ok()
                    .filter(|limit| *limit > 0)
            }) else {
                continue;
            };
            let share = (limit / self.processes).max(1);
            let meter = Meter::per_minute(share);
            let sent = self.unmetered[kind.index()].load(Ordering::Relaxed);
            meter.adjust(signed(sent.min(meter.burst())), Instant::now());
            if slot.set(meter).is_ok() {
                if let Some(shared) = &self.shared {
                    let _ = shared.buckets[kind.index()].set(rate_and_burst(limit));
                }
                tracing::info!(
                    kind = kind.name(),
                    limit,
                    share,
                    "learnt the provider's limit a minute from its headers"
                );
            }
        }
    }

    /// Waits until a request of about `input_tokens` prompt tokens and at most `output_tokens`
    /// fits every limit, and reserves it.
    pub async fn reserve(&self, input_tokens: u64, output_tokens: u64) -> Reservation<'_> {
        // A place in flight first: the meters' time is not spent waiting for one.
        let in_flight = match &self.in_flight {
            // Never closed.
            Some(semaphore) => semaphore.acquire().await.ok(),
            None => None,
        };
        let reservation = |shared| Reservation {
            input_tokens,
            output_tokens,
            shared,
            _in_flight: in_flight,
        };
        if let Some(shared) = &self.shared {
            let cells =
                Kind::ALL.map(|kind| (kind, signed(kind.cells(input_tokens, output_tokens))));
            let outcome = shared.take(&cells).await;
            shared.note(&outcome);
            if let Ok(wait) = outcome {
                tokio::time::sleep(wait).await;
                return reservation(true);
            }
        }
        let now = Instant::now();
        let mut go = None;
        for kind in Kind::ALL {
            let cells = kind.cells(input_tokens, output_tokens);
            if let Some(meter) = self.meters[kind.index()].get() {
                let at = meter.reserve(cells, now);
                go = Some(go.map_or(at, |go: Instant| go.max(at)));
            } else if self.learn {
                self.unmetered[kind.index()].fetch_add(cells, Ordering::Relaxed);
            }
        }
        if let Some(go) = go.filter(|go| *go > now) {
            tokio::time::sleep_until(go).await;
        }
        reservation(false)
    }

    /// The request of `reservation` used `input_tokens` and `output_tokens` (none when it was
    /// refused): its meters are put right.
    #[allow(clippy::needless_pass_by_value)] // settling ends the reservation
    pub async fn settle(
        &self,
        reservation: Reservation<'_>,
        input_tokens: u64,
        output_tokens: u64,
    ) {
        let now = Instant::now();
        let difference = |kind: Kind| {
            signed(kind.cells(input_tokens, output_tokens))
                - signed(kind.cells(reservation.input_tokens, reservation.output_tokens))
        };
        let tokens = [Kind::InputTokens, Kind::OutputTokens, Kind::Tokens];
        if let (Some(shared), true) = (&self.shared, reservation.shared) {
            let cells = tokens.map(|kind| (kind, difference(kind)));
            // What was used more is queued behind what others reserved: the next requests wait
            // for it, not this one, which has gone.
            let outcome = shared.take(&cells).await;
            shared.note(&outcome);
            return;
        }
        for kind in tokens {
            if let Some(meter) = self.meters[kind.index()].get() {
                meter.adjust(difference(kind), now);
            }
        }
    }
}

fn signed(cells: u64) -> i64 {
    i64::try_from(cells).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The most cells of `times` (each a reservation's start and its cells) in any `window`.
    fn most_in_any_window(times: &[(Instant, u64)], window: Duration) -> u64 {
        times
            .iter()
            .map(|(start, _)| {
                times
                    .iter()
                    .filter(|(at, _)| *at >= *start && *at < *start + window)
                    .map(|(_, cells)| cells)
                    .sum()
            })
            .max()
            .unwrap_or(0)
    }

    #[tokio::test(start_paused = true)]
    async fn requests_hold_the_limit_over_any_minute_and_use_most_of_it() {
        let spec = LimitsSpec {
            requests_per_minute: Some(600),
            ..LimitsSpec::default()
        };
        let limits = std::sync::Arc::new(Limits::share(Some(&spec), 1).unwrap());
        let started = Instant::now();
        // Forty callers asking as fast as they are let through, for five minutes.
        let callers = (0..40).map(|_| {
            let limits = std::sync::Arc::clone(&limits);
            tokio::spawn(async move {
                let mut times = Vec::new();
                while Instant::now() < started + Duration::from_secs(300) {
                    limits.reserve(0, 0).await;
                    times.push((Instant::now(), 1));
                }
                times
            })
        });
        let mut times: Vec<(Instant, u64)> = Vec::new();
        for caller in futures::future::join_all(callers).await {
            times.extend(caller.unwrap());
        }
        times.sort();
        let most = most_in_any_window(&times, MINUTE);
        assert!(
            most <= 600,
            "{most} requests in one minute, over the limit of 600"
        );
        // Five minutes at 95 % of the limit, plus the first burst.
        let total = u64::try_from(times.len()).unwrap();
        assert!(total >= 5 * 570, "{total} requests in five minutes");
    }

    #[tokio::test(start_paused = true)]
    async fn a_limit_the_spec_does_not_set_is_learnt_from_the_first_answer_that_tells_it() {
        let spec = LimitsSpec {
            output_tokens_per_minute: Some(60_000),
            ..LimitsSpec::default()
        };
        let limits = Limits::share(Some(&spec), 4).unwrap();
        let timed = |count: usize| {
            let limits = &limits;
            async move {
                let started = Instant::now();
                for _ in 0..count {
                    let reservation = limits.reserve(0, 0).await;
                    limits.settle(reservation, 0, 0).await;
                }
                started.elapsed()
            }
        };
        assert_eq!(
            timed(100).await,
            Duration::ZERO,
            "nothing limits requests yet"
        );
        let mut headers = reqwest::header::HeaderMap::new();
        headers.insert("x-ratelimit-limit-requests", "2400".parse().unwrap());
        headers.insert(
            "anthropic-ratelimit-output-tokens-limit",
            "1".parse().unwrap(),
        );
        limits.learn(&headers);
        // 600 a minute for each of four pods, its burst of 30 spent by the requests before:
        // 57 more take 6 s at 570 a minute.
        let learnt = timed(57).await;
        assert!(
            learnt >= Duration::from_secs(5) && learnt <= Duration::from_secs(7),
            "{learnt:?}"
        );
        // Told again, otherwise: the first stands; the spec's output limit was never replaced.
        headers.insert("x-ratelimit-limit-requests", "1000000".parse().unwrap());
        limits.learn(&headers);
        assert!(timed(57).await >= Duration::from_secs(5));
        assert!(
            limits.meters[Kind::OutputTokens.index()]
                .get()
                .unwrap()
                .burst()
                >= 700
        );

        let off = LimitsSpec {
            from_headers: Some(false),
            ..LimitsSpec::default()
        };
        assert!(
            Limits::share(Some(&off), 1).is_none(),
            "nothing to keep or learn"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn tokens_reserved_too_many_are_given_back() {
        let spec = LimitsSpec {
            output_tokens_per_minute: Some(60_000),
            ..LimitsSpec::default()
        };
        // Forty requests each reserve 1,000 tokens (their max tokens) and use 100.
        let run = |settled: bool| {
            let limits = Limits::share(Some(&spec), 1).unwrap();
            async move {
                let started = Instant::now();
                for _ in 0..40 {
                    let reservation = limits.reserve(0, 1_000).await;
                    if settled {
                        limits.settle(reservation, 0, 100).await;
                    }
                }
                started.elapsed()
            }
        };
        // Settled, 4,000 tokens were used: within the first burst (3,000) and a second.
        let with = run(true).await;
        assert!(with < Duration::from_secs(3), "{with:?}");
        // Kept, 40,000: 37,000 past the burst at 57,000 a minute, some 39 s.
        let without = run(false).await;
        assert!(without > Duration::from_secs(35), "{without:?}");
    }

    #[test]
    fn each_pod_keeps_its_share_and_without_limits_only_learns() {
        let spec = LimitsSpec {
            requests_per_minute: Some(1_000),
            max_in_flight: Some(64),
            ..LimitsSpec::default()
        };
        let share = Limits::share(Some(&spec), 4).unwrap();
        assert_eq!(share.in_flight.as_ref().unwrap().available_permits(), 16);
        let meter = share.meters[Kind::Requests.index()].get().unwrap();
        // 250 a minute: a burst of 12, then 238 a minute.
        assert_eq!(meter.interval, MINUTE.div_f64(238.0));
        assert_eq!(meter.burst(), 12);
        let learning = Limits::share(None, 4).unwrap();
        assert!(learning.meters.iter().all(|meter| meter.get().is_none()));
        assert!(learning.learn);
    }
}
