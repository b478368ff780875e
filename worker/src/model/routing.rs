//! Which of the model's endpoints serves a conversation.
//!
//! Every turn of a conversation resends its whole history; the server that answered the last
//! turn holds that history's prefix in its cache (vLLM's prefix caching, `SGLang`'s radix cache,
//! llama.cpp's slots), any other server computes it again. So a conversation keeps one endpoint
//! for all its turns, chosen by its identity, never by its first message or system prompt (which
//! every conversation of a run shares: routing on them sends the whole run to one server).
//!
//! The choice is rendezvous hashing with bounded load: each endpoint gets a score from the
//! conversation's identity, and the conversation takes the highest-scoring endpoint that is
//! healthy and holds fewer than `loadBound` times an equal share of this process's
//! conversations. Identities spread evenly, and a few long conversations cannot pile onto one
//! server. A conversation moves only when its endpoint is taken out: after
//! [`FAILURES_TO_EJECT`] failed requests in a row (connection errors, timeouts, 5xx) it is out
//! for a while that doubles with each ejection, and it comes back on its own afterwards; the
//! first success since clears its record. The conversations that move lose their cached prefix
//! once, nothing else: their next request goes to the next endpoint in their order.
//!
//! [`RoutingStrategy::RoundRobin`] sends each request to the next endpoint in turn instead, whatever its
//! conversation: for servers that keep no cache between requests, and as the baseline that shows
//! what keeping a conversation on one server saves.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

use crate::spec::RoutingStrategy;

/// Failed requests in a row that take an endpoint out.
pub const FAILURES_TO_EJECT: u32 = 3;

/// How long the first ejection lasts; each further one in a row twice the last, up to
/// [`MAX_EJECTION`].
const FIRST_EJECTION: Duration = Duration::from_secs(5);
const MAX_EJECTION: Duration = Duration::from_secs(60);

/// One server of the model.
#[derive(Debug)]
pub struct Endpoint {
    /// Its base URL, as the spec gives it (without a trailing `/`).
    pub base_url: String,
    /// `<base_url>/chat/completions`.
    pub url: String,
    /// Where it sits in the rendezvous order: a hash of its base URL.
    seed: u64,
    /// Conversations of this process routed here now.
    conversations: AtomicUsize,
    health: Mutex<Health>,
}

#[derive(Debug, Default)]
struct Health {
    failures_in_a_row: u32,
    /// Ejections since its last success.
    ejections: u32,
    out_until: Option<Instant>,
}

impl Endpoint {
    fn new(base_url: &str) -> Self {
        let base_url = base_url.trim_end_matches('/').to_owned();
        Self {
            url: format!("{base_url}/chat/completions"),
            seed: hash64(base_url.as_bytes()),
            base_url,
            conversations: AtomicUsize::new(0),
            health: Mutex::new(Health::default()),
        }
    }

    fn health(&self) -> std::sync::MutexGuard<'_, Health> {
        self.health.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Taken out until then, if it is out now.
    fn out_until(&self, now: Instant) -> Option<Instant> {
        self.health().out_until.filter(|until| *until > now)
    }

    /// Conversations of this process routed here now.
    pub fn conversations(&self) -> usize {
        self.conversations.load(Ordering::Relaxed)
    }
}

/// The model's endpoints, shared by every conversation of the process.
#[derive(Debug)]
pub struct Endpoints {
    servers: Vec<Endpoint>,
    strategy: RoutingStrategy,
    load_bound: f64,
    /// The round-robin's count of requests.
    turns: AtomicUsize,
}

impl Endpoints {
    /// `base_urls` must not be empty (the spec's validation sees to it); `load_bound` is at
    /// least 1.
    pub fn new(base_urls: &[String], strategy: RoutingStrategy, load_bound: f64) -> Self {
        assert!(!base_urls.is_empty(), "a model has at least one endpoint");
        Self {
            servers: base_urls.iter().map(|url| Endpoint::new(url)).collect(),
            strategy,
            load_bound: load_bound.max(1.0),
            turns: AtomicUsize::new(0),
        }
    }

    /// The next endpoint in turn that is in (the next in turn when none is).
    fn next_in_turn(&self) -> usize {
        let now = Instant::now();
        let count = self.servers.len();
        let start = self.turns.fetch_add(1, Ordering::Relaxed);
        (0..count)
            .map(|step| (start + step) % count)
            .find(|index| self.servers[*index].out_until(now).is_none())
            .unwrap_or(start % count)
    }

    pub fn all(&self) -> &[Endpoint] {
        &self.servers
    }

    pub fn get(&self, index: usize) -> &Endpoint {
        &self.servers[index]
    }

    /// The endpoint for a request of no conversation (a probe, a one-off call): the first
    /// that is in, else the first.
    pub fn first_in(&self) -> usize {
        let now = Instant::now();
        self.servers
            .iter()
            .position(|endpoint| endpoint.out_until(now).is_none())
            .unwrap_or(0)
    }

    /// Whether some endpoint is in now.
    pub fn any_in(&self) -> bool {
        let now = Instant::now();
        self.servers
            .iter()
            .any(|endpoint| endpoint.out_until(now).is_none())
    }

    /// The endpoint for a conversation of identity hash `key` that holds none: the first, in
    /// the key's rendezvous order, that is in and under the load bound; when every endpoint is
    /// out, the one that comes back first (a request is never refused for want of a server:
    /// its own retries decide). Counts the conversation there.
    fn assign(&self, key: u64) -> usize {
        let now = Instant::now();
        let mut order: Vec<(u64, usize)> = self
            .servers
            .iter()
            .enumerate()
            .map(|(index, endpoint)| (mix(key ^ endpoint.seed), index))
            .collect();
        order.sort_unstable_by(|a, b| b.cmp(a));
        let healthy: Vec<usize> = order
            .iter()
            .map(|(_, index)| *index)
            .filter(|index| self.servers[*index].out_until(now).is_none())
            .collect();
        let chosen = if healthy.is_empty() {
            (0..self.servers.len())
                .min_by_key(|index| self.servers[*index].out_until(now))
                .unwrap_or(0)
        } else {
            let total: usize = healthy
                .iter()
                .map(|index| self.servers[*index].conversations())
                .sum();
            let bound = self.capacity(total + 1, healthy.len());
            healthy
                .iter()
                .copied()
                .find(|index| self.servers[*index].conversations() < bound)
                .unwrap_or(healthy[0])
        };
        self.servers[chosen]
            .conversations
            .fetch_add(1, Ordering::Relaxed);
        chosen
    }

    /// The most conversations one of `endpoints` endpoints may hold when they hold
    /// `conversations` in all: `loadBound` times an equal share, rounded up.
    fn capacity(&self, conversations: usize, endpoints: usize) -> usize {
        #[allow(
            clippy::cast_precision_loss,
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss
        )] // counts of conversations, far below 2^52
        let bound = (self.load_bound * conversations as f64 / endpoints as f64).ceil() as usize;
        bound.max(1)
    }

    fn release(&self, index: usize) {
        self.servers[index]
            .conversations
            .fetch_sub(1, Ordering::Relaxed);
    }

    /// A request to `index` was answered (any answer of the server's own, a refusal or a
    /// slow-down included): it is healthy.
    pub fn succeeded(&self, index: usize) {
        let mut health = self.servers[index].health();
        *health = Health::default();
    }

    /// A request to `index` failed as a server that is down or broken fails: the
    /// [`FAILURES_TO_EJECT`]th in a row takes it out, unless it is the only endpoint (which
    /// the retries and the batch's circuit then judge). True when this took it out.
    pub fn failed(&self, index: usize) -> bool {
        if self.servers.len() == 1 {
            return false;
        }
        let now = Instant::now();
        let mut health = self.servers[index].health();
        if health.out_until.is_some_and(|until| until > now) {
            return false;
        }
        health.failures_in_a_row += 1;
        if health.failures_in_a_row < FAILURES_TO_EJECT {
            return false;
        }
        let doubling = FIRST_EJECTION.saturating_mul(1 << health.ejections.min(8));
        health.out_until = Some(now + doubling.min(MAX_EJECTION));
        health.ejections += 1;
        health.failures_in_a_row = 0;
        true
    }
}

/// A conversation's hold on an endpoint: taken at its first request, kept for all its turns,
/// given up when the conversation ends (on drop) or its endpoint is taken out.
#[derive(Debug)]
pub struct Route {
    endpoints: Arc<Endpoints>,
    /// The conversation's identity, sent with each request.
    pub identity: String,
    key: u64,
    held: Mutex<Option<usize>>,
}

impl Route {
    pub fn new(endpoints: Arc<Endpoints>, identity: &str) -> Self {
        Self {
            endpoints,
            identity: identity.to_owned(),
            key: hash64(identity.as_bytes()),
            held: Mutex::new(None),
        }
    }

    /// The endpoint for the conversation's next request: the one it holds while that is in,
    /// else a new one (with [`RoutingStrategy::RoundRobin`], the next in turn).
    pub fn endpoint(&self) -> usize {
        if self.endpoints.strategy == RoutingStrategy::RoundRobin {
            return self.endpoints.next_in_turn();
        }
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(index) = *held {
            if self
                .endpoints
                .get(index)
                .out_until(Instant::now())
                .is_none()
            {
                return index;
            }
            self.endpoints.release(index);
        }
        let index = self.endpoints.assign(self.key);
        *held = Some(index);
        index
    }
}

impl Drop for Route {
    fn drop(&mut self) {
        let held = self.held.get_mut().unwrap_or_else(PoisonError::into_inner);
        if let Some(index) = held.take() {
            self.endpoints.release(index);
        }
    }
}

/// The first 8 bytes of the BLAKE3 hash of `bytes`: the same in every pod and release.
fn hash64(bytes: &[u8]) -> u64 {
    let hash = blake3::hash(bytes);
    let mut first = [0_u8; 8];
    first.copy_from_slice(&hash.as_bytes()[..8]);
    u64::from_le_bytes(first)
}

/// `SplitMix64`'s finaliser: a conversation's score at an endpoint, from the two hashes.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn endpoints(count: usize, load_bound: f64) -> Arc<Endpoints> {
        let urls: Vec<String> = (0..count).map(|i| format!("http://m{i}:8000/v1")).collect();
        Arc::new(Endpoints::new(
            &urls,
            RoutingStrategy::ConversationHash,
            load_bound,
        ))
    }

    /// `count` conversations of the run, none routed yet.
    fn routes(endpoints: &Arc<Endpoints>, count: usize) -> Vec<Route> {
        (0..count)
            .map(|i| Route::new(Arc::clone(endpoints), &format!("run-{i}-0")))
            .collect()
    }

    fn counts(endpoints: &Endpoints) -> Vec<usize> {
        endpoints
            .all()
            .iter()
            .map(Endpoint::conversations)
            .collect()
    }

    #[test]
    fn a_conversation_keeps_its_endpoint_for_every_turn() {
        let endpoints = endpoints(4, 1.25);
        let routes = routes(&endpoints, 40);
        let first: Vec<usize> = routes.iter().map(Route::endpoint).collect();
        for _turn in 0..5 {
            let again: Vec<usize> = routes.iter().map(Route::endpoint).collect();
            assert_eq!(again, first);
        }
        assert_eq!(counts(&endpoints).iter().sum::<usize>(), 40);
        drop(routes);
        assert_eq!(counts(&endpoints), [0, 0, 0, 0]);
    }

    #[test]
    fn no_endpoint_holds_more_than_the_load_bound_allows() {
        let endpoints = endpoints(3, 1.25);
        let routes = routes(&endpoints, 300);
        for route in &routes {
            route.endpoint();
        }
        // 1.25 × 300 / 3, rounded up.
        for held in counts(&endpoints) {
            assert!((1..=125).contains(&held), "{:?}", counts(&endpoints));
        }
    }

    #[test]
    fn the_same_identity_gets_the_same_endpoint_in_another_process() {
        // Another pod (or the same one after a restart) routes a conversation as this one did:
        // the order depends on the identity and the base URLs alone.
        let one = endpoints(5, 1.25);
        let other = endpoints(5, 1.25);
        for i in 0..20 {
            let identity = format!("run-{i}-1");
            let a = Route::new(Arc::clone(&one), &identity).endpoint();
            let b = Route::new(Arc::clone(&other), &identity).endpoint();
            assert_eq!(a, b, "{identity}");
        }
    }

    #[test]
    fn an_endpoint_that_keeps_failing_is_taken_out_and_its_conversations_move() {
        let endpoints = endpoints(3, 1.25);
        let routes = routes(&endpoints, 30);
        let before: Vec<usize> = routes.iter().map(Route::endpoint).collect();
        let failing = before[0];
        assert!(!endpoints.failed(failing));
        assert!(!endpoints.failed(failing));
        assert!(endpoints.failed(failing), "the third failure in a row");
        let after: Vec<usize> = routes.iter().map(Route::endpoint).collect();
        for (was, now) in before.iter().zip(&after) {
            if *was == failing {
                assert_ne!(*now, failing);
            } else {
                assert_eq!(now, was, "a conversation elsewhere stays where it was");
            }
        }
        assert_eq!(counts(&endpoints)[failing], 0);
        assert_eq!(counts(&endpoints).iter().sum::<usize>(), 30);
    }

    #[test]
    fn a_success_between_failures_keeps_an_endpoint_in() {
        let endpoints = endpoints(2, 1.25);
        for _ in 0..10 {
            assert!(!endpoints.failed(0));
            assert!(!endpoints.failed(0));
            endpoints.succeeded(0);
        }
        let route = Route::new(Arc::clone(&endpoints), "run-0-0");
        let held = route.endpoint();
        assert!(endpoints.all()[held].out_until(Instant::now()).is_none());
    }

    #[test]
    fn a_lone_endpoint_is_never_taken_out() {
        let endpoints = endpoints(1, 1.25);
        for _ in 0..10 {
            assert!(!endpoints.failed(0));
        }
        assert_eq!(Route::new(Arc::clone(&endpoints), "run-0-0").endpoint(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn an_ejected_endpoint_comes_back_after_a_while_that_doubles() {
        let endpoints = endpoints(2, 1.25);
        let eject = || {
            for _ in 0..FAILURES_TO_EJECT {
                endpoints.failed(0);
            }
        };
        eject();
        let out = |endpoints: &Endpoints| endpoints.get(0).out_until(Instant::now()).is_some();
        assert!(out(&endpoints));
        tokio::time::advance(FIRST_EJECTION + Duration::from_millis(1)).await;
        assert!(!out(&endpoints), "back after the first ejection");
        eject();
        tokio::time::advance(FIRST_EJECTION + Duration::from_millis(1)).await;
        assert!(out(&endpoints), "the second ejection lasts twice as long");
        tokio::time::advance(FIRST_EJECTION).await;
        assert!(!out(&endpoints));
        endpoints.succeeded(0);
        eject();
        tokio::time::advance(FIRST_EJECTION + Duration::from_millis(1)).await;
        assert!(!out(&endpoints), "a success starts the doubling over");
    }

    #[test]
    fn round_robin_sends_each_request_to_the_next_endpoint_that_is_in() {
        let urls: Vec<String> = (0..3).map(|i| format!("http://m{i}:8000/v1")).collect();
        let endpoints = Arc::new(Endpoints::new(&urls, RoutingStrategy::RoundRobin, 1.25));
        let route = Route::new(Arc::clone(&endpoints), "run-0-0");
        let turns: Vec<usize> = (0..6).map(|_| route.endpoint()).collect();
        assert_eq!(turns, [0, 1, 2, 0, 1, 2]);
        for _ in 0..FAILURES_TO_EJECT {
            endpoints.failed(1);
        }
        let turns: Vec<usize> = (0..4).map(|_| route.endpoint()).collect();
        assert_eq!(turns, [0, 2, 2, 0]);
        assert_eq!(counts(&endpoints), [0, 0, 0], "round robin holds nothing");
    }

    #[test]
    fn when_every_endpoint_is_out_the_one_back_first_serves() {
        let endpoints = endpoints(2, 1.25);
        for _ in 0..FAILURES_TO_EJECT {
            endpoints.failed(1);
        }
        for _ in 0..FAILURES_TO_EJECT {
            endpoints.failed(0);
        }
        assert_eq!(Route::new(Arc::clone(&endpoints), "run-0-0").endpoint(), 1);
    }
}
