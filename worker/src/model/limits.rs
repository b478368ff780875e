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

use std::sync::{Mutex, PoisonError};
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
        let limit = limit.max(1);
        let burst = (limit / BURST_SHARE).max(1);
        // The burst is paid for out of the limit; one cell a minute goes at least.
        let rate = (limit - burst.min(limit - 1)).max(1);
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
    _in_flight: Option<tokio::sync::SemaphorePermit<'a>>,
}

/// This process's share of the run's limits.
#[derive(Debug)]
pub struct Limits {
    requests: Option<Meter>,
    input_tokens: Option<Meter>,
    output_tokens: Option<Meter>,
    /// Requests in flight at once.
    in_flight: Option<tokio::sync::Semaphore>,
}

impl Limits {
    /// The share of `spec` of one of `pods` processes that may run at once; `None` when it sets
    /// no limit.
    pub fn share(spec: &LimitsSpec, pods: u64) -> Option<Self> {
        let pods = pods.max(1);
        let share = |limit: Option<u64>| limit.map(|limit| (limit / pods).max(1));
        let limits = Self {
            requests: share(spec.requests_per_minute).map(Meter::per_minute),
            input_tokens: share(spec.input_tokens_per_minute).map(Meter::per_minute),
            output_tokens: share(spec.output_tokens_per_minute).map(Meter::per_minute),
            in_flight: share(spec.max_in_flight).map(|limit| {
                tokio::sync::Semaphore::new(
                    usize::try_from(limit)
                        .unwrap_or(usize::MAX)
                        .min(tokio::sync::Semaphore::MAX_PERMITS),
                )
            }),
        };
        let any = limits.requests.is_some()
            || limits.input_tokens.is_some()
            || limits.output_tokens.is_some()
            || limits.in_flight.is_some();
        any.then_some(limits)
    }

    /// Whether it limits input tokens (whose estimate costs a look at the request).
    pub fn counts_input(&self) -> bool {
        self.input_tokens.is_some()
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
        let now = Instant::now();
        let mut go = now;
        for (meter, cells) in [
            (&self.requests, 1),
            (&self.input_tokens, input_tokens),
            (&self.output_tokens, output_tokens),
        ] {
            if let Some(meter) = meter {
                go = go.max(meter.reserve(cells, now));
            }
        }
        tokio::time::sleep_until(go).await;
        Reservation {
            input_tokens,
            output_tokens,
            _in_flight: in_flight,
        }
    }

    /// The request of `reservation` used `input_tokens` and `output_tokens` (none when it was
    /// refused): its meters are put right.
    #[allow(clippy::needless_pass_by_value)] // settling ends the reservation
    pub fn settle(&self, reservation: Reservation<'_>, input_tokens: u64, output_tokens: u64) {
        let now = Instant::now();
        let difference = |used: u64, reserved: u64| {
            i64::try_from(used).unwrap_or(i64::MAX) - i64::try_from(reserved).unwrap_or(i64::MAX)
        };
        if let Some(meter) = &self.input_tokens {
            meter.adjust(difference(input_tokens, reservation.input_tokens), now);
        }
        if let Some(meter) = &self.output_tokens {
            meter.adjust(difference(output_tokens, reservation.output_tokens), now);
        }
    }
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
        let limits = std::sync::Arc::new(Limits::share(&spec, 1).unwrap());
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
    async fn tokens_reserved_too_many_are_given_back() {
        let spec = LimitsSpec {
            output_tokens_per_minute: Some(60_000),
            ..LimitsSpec::default()
        };
        // Forty requests each reserve 1,000 tokens (their max tokens) and use 100.
        let run = |settled: bool| {
            let limits = Limits::share(&spec, 1).unwrap();
            async move {
                let started = Instant::now();
                for _ in 0..40 {
                    let reservation = limits.reserve(0, 1_000).await;
                    if settled {
                        limits.settle(reservation, 0, 100);
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
    fn each_pod_keeps_its_share_and_an_empty_spec_keeps_none() {
        let spec = LimitsSpec {
            requests_per_minute: Some(1_000),
            max_in_flight: Some(64),
            ..LimitsSpec::default()
        };
        let share = Limits::share(&spec, 4).unwrap();
        assert_eq!(share.in_flight.as_ref().unwrap().available_permits(), 16);
        let meter = share.requests.unwrap();
        // 250 a minute: a burst of 12, then 238 a minute.
        assert_eq!(meter.interval, MINUTE.div_f64(238.0));
        assert!(Limits::share(&LimitsSpec::default(), 4).is_none());
    }
}
