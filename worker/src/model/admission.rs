//! How many requests of this process an endpoint takes at once, learnt from its answers.
//!
//! An endpoint that says to slow down (429, 529, a 503 of a proxy shedding load) is over its
//! capacity: the process then lets fewer of its requests to it in flight, and more again, slowly,
//! as they succeed. Additive increase, multiplicative decrease, the recipe of `NeMo` Data
//! Designer's request admission and Netflix's `AIMDLimit`:
//!
//! - **Free until told**: no limit is kept until the endpoint first says to slow down; requests
//!   go as the conversations send them (at most `concurrency` each batch).
//! - **Cut once a burst**: told to slow down, the limit becomes [`DECREASE`] times the requests in
//!   flight then (or the limit kept). The requests already in flight when it was cut were sent
//!   under the old limit; their answers belong to the same burst and do not cut again, so a
//!   burst of 429s cuts once, not once a request.
//! - **Grow slowly**: after [`SUCCESSES_TO_GROW`] answers in a row, one more, but only while
//!   the limit is in use (at least half of it in flight): a limit nobody tests is not raised.
//! - **Never above what the process asked for**: the most requests it ever had in flight to the
//!   endpoint, which its conversations' `concurrency` bounds. At least one request is always let
//!   through.

use std::sync::{Mutex, PoisonError};

use tokio::sync::Notify;

/// The limit after a cut, as a share of the requests in flight when it was cut.
pub const DECREASE: f64 = 0.75;

/// Successes in a row that grow the limit by one.
pub const SUCCESSES_TO_GROW: u32 = 25;

/// One endpoint's admission of this process's requests.
#[derive(Debug, Default)]
pub struct Admission {
    state: Mutex<State>,
    /// A request finished or the limit grew: a waiting request may go.
    room: Notify,
}

#[derive(Debug, Default)]
struct State {
    /// `None` until the endpoint first says to slow down.
    limit: Option<f64>,
    in_flight: usize,
    /// The most requests in flight at once: the limit's ceiling.
    peak: usize,
    successes: u32,
    /// Counts the cuts: a request admitted before the last one was sent under a higher limit.
    cuts: u64,
}

impl State {
    fn has_room(&self) -> bool {
        self.limit.is_none_or(|limit| {
            #[allow(clippy::cast_precision_loss)] // counts of requests, far below 2^52
            let in_flight = self.in_flight as f64;
            in_flight + 1.0 <= limit.floor().max(1.0)
        })
    }
}

/// A request let through: holds its place until dropped.
#[derive(Debug)]
pub struct Ticket<'a> {
    admission: &'a Admission,
    /// The cuts before it was let through.
    cuts: u64,
}

/// What [`Admission::limit`] reports.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Snapshot {
    /// The limit, `None` while none is kept.
    pub limit: Option<f64>,
    pub in_flight: usize,
}

impl Admission {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Waits until the endpoint has room for one more request of this process.
    pub async fn admit(&self) -> Ticket<'_> {
        loop {
            let room = self.room.notified();
            tokio::pin!(room);
            // Registered before the check, so a release between the check and the wait wakes it.
            room.as_mut().enable();
            {
                let mut state = self.state();
                if state.has_room() {
                    state.in_flight += 1;
                    state.peak = state.peak.max(state.in_flight);
                    return Ticket {
                        admission: self,
                        cuts: state.cuts,
                    };
                }
            }
            room.await;
        }
    }

    /// The limit and the requests in flight now.
    pub fn snapshot(&self) -> Snapshot {
        let state = self.state();
        Snapshot {
            limit: state.limit,
            in_flight: state.in_flight,
        }
    }
}

impl Ticket<'_> {
    /// The endpoint answered the request (any answer but "slow down").
    pub fn answered(&self) {
        let mut state = self.admission.state();
        let Some(limit) = state.limit else {
            return;
        };
        state.successes += 1;
        #[allow(clippy::cast_precision_loss)] // counts of requests, far below 2^52
        let (in_flight, peak) = (state.in_flight as f64, state.peak as f64);
        if state.successes >= SUCCESSES_TO_GROW && in_flight * 2.0 >= limit {
            state.limit = Some((limit + 1.0).min(peak.max(1.0)));
            state.successes = 0;
            drop(state);
            self.admission.room.notify_one();
        }
    }

    /// The endpoint said to slow down: cuts the limit, unless it was cut since this request
    /// was let through (the same burst). True when this cut it.
    pub fn slowed_down(&self) -> bool {
        let mut state = self.admission.state();
        if state.cuts != self.cuts {
            return false;
        }
        #[allow(clippy::cast_precision_loss)] // counts of requests, far below 2^52
        let in_flight = state.in_flight as f64;
        let base = state.limit.map_or(in_flight, |limit| limit.min(in_flight));
        state.limit = Some((base * DECREASE).max(1.0));
        state.cuts += 1;
        state.successes = 0;
        true
    }
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        self.admission.state().in_flight -= 1;
        self.admission.room.notify_one();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn requests_go_freely_until_the_endpoint_says_to_slow_down() {
        let admission = Admission::default();
        let tickets: Vec<_> = futures::future::join_all((0..40).map(|_| admission.admit())).await;
        assert_eq!(admission.snapshot().in_flight, 40);
        assert_eq!(admission.snapshot().limit, None);
        for ticket in &tickets {
            ticket.answered();
        }
        assert_eq!(admission.snapshot().limit, None, "success alone keeps none");
    }

    #[tokio::test]
    async fn a_burst_of_slow_downs_cuts_once() {
        let admission = Admission::default();
        let tickets: Vec<_> = futures::future::join_all((0..32).map(|_| admission.admit())).await;
        let cuts = tickets.iter().filter(|ticket| ticket.slowed_down()).count();
        assert_eq!(cuts, 1);
        assert_eq!(admission.snapshot().limit, Some(24.0));
        drop(tickets);
        // A request let through after the cut and told again cuts again.
        let ticket = admission.admit().await;
        assert!(ticket.slowed_down());
        assert_eq!(
            admission.snapshot().limit,
            Some(1.0),
            "0.75 of the 1 in flight, at least 1"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn no_more_than_the_limit_are_in_flight_and_one_waits_for_room() {
        let admission = std::sync::Arc::new(Admission::default());
        let first: Vec<_> = futures::future::join_all((0..8).map(|_| admission.admit())).await;
        assert!(first[0].slowed_down());
        assert_eq!(admission.snapshot().limit, Some(6.0));
        drop(first);
        let held: Vec<_> = futures::future::join_all((0..6).map(|_| admission.admit())).await;
        let waiting = {
            let admission = std::sync::Arc::clone(&admission);
            tokio::spawn(async move {
                let _ticket = admission.admit().await;
            })
        };
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
        assert!(!waiting.is_finished(), "a seventh request waits");
        drop(held.into_iter().next());
        tokio::time::timeout(std::time::Duration::from_secs(1), waiting)
            .await
            .expect("a place freed lets it through")
            .unwrap();
    }

    #[tokio::test]
    async fn the_limit_grows_by_one_per_run_of_successes_while_in_use_up_to_the_peak() {
        let admission = Admission::default();
        let tickets: Vec<_> = futures::future::join_all((0..10).map(|_| admission.admit())).await;
        assert!(tickets[0].slowed_down());
        drop(tickets);
        let limit = |admission: &Admission| admission.snapshot().limit.unwrap();
        assert!((limit(&admission) - 7.5).abs() < 1e-9);
        // In use: 7 in flight of 7.5.
        let in_use: Vec<_> = futures::future::join_all((0..7).map(|_| admission.admit())).await;
        for _ in 0..SUCCESSES_TO_GROW {
            in_use[0].answered();
        }
        assert!((limit(&admission) - 8.5).abs() < 1e-9);
        drop(in_use);
        // Idle: 1 in flight of 8.5 is not using it; successes do not grow it.
        let alone = admission.admit().await;
        for _ in 0..SUCCESSES_TO_GROW * 4 {
            alone.answered();
        }
        assert!((limit(&admission) - 8.5).abs() < 1e-9);
        drop(alone);
        // Never past the most ever in flight (10).
        let busy: Vec<_> = futures::future::join_all((0..8).map(|_| admission.admit())).await;
        for _ in 0..SUCCESSES_TO_GROW * 10 {
            busy[0].answered();
        }
        assert!((limit(&admission) - 10.0).abs() < 1e-9);
    }
}
