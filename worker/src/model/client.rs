use std::fmt;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

use rand::Rng;
use reqwest::header::{AUTHORIZATION, CONTENT_TYPE, HeaderName, HeaderValue, RETRY_AFTER};
use serde_json::{Map, Value};
use tracing::{debug, info, warn};

use super::admission::{Admission, Ticket};
use super::batch_api::BatchApi;
use super::batch_journal::{JournalEntry, WindowJournal};
use super::batch_windows::{BatchAnswer, BatchSettings, BatchTail, BatchWindows, batch_custom_id};
use super::limits::{Limits, Reservation};
use super::reset_headers::wait_for_reset;
use super::routing::{Endpoints, Route};
use super::tiers::{CallTier, SERVICE_TIER, ServiceTierSettings};
use super::tokens::{self, CallTokens, TokenSettings};
use super::types::{Completion, Message, ParseFailure, Usage, parse_completion};
use super::{Circuit, ErrorClass, ModelError, Verdict, classify_status, sse};
use crate::pricing::{Cost, PriceTier, Prices};
use crate::spec::{ModelSpec, RoutingSpec, RoutingStrategy, TokenRequest};

/// The model API key. Its `Debug` and `Display` never show the value.
#[derive(Clone)]
pub struct ApiKey(String);

impl fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ApiKey(<redacted>)")
    }
}

impl ApiKey {
    pub fn new(key: impl Into<String>) -> Self {
        Self(key.into().trim().to_owned())
    }

    /// Finds the key: the contract's variable, then the variable the spec names, then the
    /// contract's key file. `Ok(None)` when none is configured (local servers need no key).
    /// A variable or file that is named but missing is an error naming it.
    pub fn discover(spec_env: Option<&str>) -> Result<Option<Self>, String> {
        use crate::contract::env;
        if let Ok(key) = std::env::var(env::MODEL_API_KEY)
            && !key.trim().is_empty()
        {
            return Ok(Some(Self::new(key)));
        }
        if let Some(name) = spec_env {
            return match std::env::var(name) {
                Ok(key) if !key.trim().is_empty() => Ok(Some(Self::new(key))),
                _ => Err(format!(
                    "spec.model.apiKeyEnv names the environment variable {name}, which is not set"
                )),
            };
        }
        if let Ok(path) = std::env::var(env::MODEL_API_KEY_FILE) {
            return Self::from_file(Path::new(&path)).map(Some);
        }
        Ok(None)
    }

    pub fn from_file(path: &Path) -> Result<Self, String> {
        let key = std::fs::read_to_string(path)
            .map_err(|err| format!("cannot read the API key file {}: {err}", path.display()))?;
        if key.trim().is_empty() {
            return Err(format!("the API key file {} is empty", path.display()));
        }
        Ok(Self::new(key))
    }
}

/// Retry limits of one model call.
#[derive(Debug, Clone)]
pub struct RetryPolicy {
    pub max_attempts: u32,
    /// First backoff; doubles per attempt.
    pub base_delay: Duration,
    /// Cap of one backoff, and of a server's `Retry-After`.
    pub max_delay: Duration,
    /// Cap of all waiting within one call.
    pub max_total_wait: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_attempts: 6,
            base_delay: Duration::from_secs(1),
            max_delay: Duration::from_secs(60),
            max_total_wait: Duration::from_secs(600),
        }
    }
}

impl RetryPolicy {
    /// Exponential backoff with "equal jitter": between half and all of the capped exponential.
    fn backoff(&self, attempt: u32) -> Duration {
        let exponential = self
            .base_delay
            .saturating_mul(
                1u32.checked_shl(attempt.saturating_sub(1))
                    .unwrap_or(u32::MAX),
            )
            .min(self.max_delay);
        let half = exponential / 2;
        half + half.mul_f64(rand::rng().random::<f64>())
    }
}

/// Everything that shapes a request, taken from the run spec.
#[derive(Debug, Clone)]
pub struct ModelSettings {
    /// The base URLs of the model's endpoints (at least one), without a trailing `/`.
    pub base_urls: Vec<String>,
    pub routing: RoutingSettings,
    pub model: String,
    pub api_key: Option<ApiKey>,
    pub max_tokens: Option<u32>,
    pub temperature: Option<f64>,
    /// Request-body fields for the reasoning settings, in the provider's convention.
    pub reasoning_fields: Map<String, Value>,
    pub extra_body: Map<String, Value>,
    pub request_timeout: Duration,
    pub stream: bool,
    pub retry: RetryPolicy,
    /// What the model's tokens cost (`spec.model.pricing`); `None`: only reported costs count.
    pub prices: Option<Prices>,
    /// What is asked for each call's token ids and logprobs (`spec.model.tokens`).
    pub tokens: Option<TokenSettings>,
    /// The service tier asked of the provider (`spec.model.serviceTier`).
    pub service_tier: Option<ServiceTierSettings>,
    /// Batch mode (`spec.model.batch`): the Batch API's base URL and how windows are cut.
    pub batch: Option<(String, BatchSettings)>,
}

/// How conversations are spread over the endpoints and name themselves (`spec.model.routing`).
#[derive(Debug, Clone)]
pub struct RoutingSettings {
    pub strategy: RoutingStrategy,
    pub load_bound: f64,
    /// The header that carries a conversation's identity, if any.
    pub session_header: Option<HeaderName>,
    pub prompt_cache_key: bool,
}

impl Default for RoutingSettings {
    fn default() -> Self {
        let spec = RoutingSpec::default();
        Self {
            strategy: spec.strategy,
            load_bound: spec.load_bound,
            session_header: HeaderName::from_bytes(spec.session_header.as_bytes()).ok(),
            prompt_cache_key: spec.prompt_cache_key,
        }
    }
}

impl ModelSettings {
    /// Settings from the spec, with the key found by [`ApiKey::discover`].
    pub fn from_spec(spec: &ModelSpec, api_key: Option<ApiKey>) -> Result<Self, ModelError> {
        let fields: Vec<String> = if spec.endpoints.is_empty() {
            vec!["spec.model.baseUrl".to_owned()]
        } else {
            (0..spec.endpoints.len())
                .map(|index| format!("spec.model.endpoints[{index}].baseUrl"))
                .collect()
        };
        let base_urls = spec.base_urls();
        for (field, base_url) in fields.iter().zip(&base_urls) {
            let url = reqwest::Url::parse(base_url).map_err(|err| {
                ModelError::Settings(format!("{field} {base_url:?} is not a URL: {err}"))
            })?;
            if !matches!(url.scheme(), "http" | "https") {
                return Err(ModelError::Settings(format!(
                    "{field} {base_url:?} must be http:// or https://"
                )));
            }
        }
        let session_header = match spec.routing.session_header.as_str() {
            "" => None,
            name => Some(HeaderName::from_bytes(name.as_bytes()).map_err(|_| {
                ModelError::Settings(format!(
                    "spec.model.routing.sessionHeader {name:?} is not an HTTP header name"
                ))
            })?),
        };
        let extra_body = match &spec.extra_body {
            None => Map::new(),
            Some(Value::Object(map)) => map.clone(),
            Some(other) => {
                return Err(ModelError::Settings(format!(
                    "spec.model.extraBody must be a JSON object, got {other}"
                )));
            }
        };
        Ok(Self {
            base_urls: base_urls
                .iter()
                .map(|url| url.trim_end_matches('/').to_owned())
                .collect(),
            routing: RoutingSettings {
                strategy: spec.routing.strategy,
                load_bound: spec.routing.load_bound,
                session_header,
                prompt_cache_key: spec.routing.prompt_cache_key,
            },
            model: spec.name.clone(),
            api_key,
            max_tokens: spec.max_tokens,
            temperature: spec.temperature,
            reasoning_fields: reasoning_fields(spec),
            extra_body,
            request_timeout: Duration::from_secs(spec.request_timeout_seconds),
            stream: spec.stream,
            retry: RetryPolicy {
                max_attempts: spec.max_attempts,
                ..RetryPolicy::default()
            },
            prices: spec
                .pricing
                .as_ref()
                .map(Prices::from_spec)
                .transpose()
                .map_err(|err| ModelError::Settings(err.to_string()))?,
            tokens: spec.tokens.as_ref().map(TokenSettings::from_spec),
            service_tier: spec
                .service_tier
                .as_ref()
                .map(ServiceTierSettings::from_spec),
            batch: spec.batch.as_ref().map(|batch| {
                let base_url = batch
                    .base_url
                    .clone()
                    .unwrap_or_else(|| base_urls.first().cloned().unwrap_or_default());
                (base_url, BatchSettings::from_spec(batch))
            }),
        })
    }
}

/// `OpenRouter` takes a `reasoning` object; OpenAI-style servers take `reasoning_effort`.
fn reasoning_fields(spec: &ModelSpec) -> Map<String, Value> {
    let mut fields = Map::new();
    let Some(reasoning) = &spec.reasoning else {
        return fields;
    };
    let openrouter = spec
        .base_urls()
        .iter()
        .any(|url| url.contains("openrouter"));
    if reasoning.disabled {
        if openrouter {
            fields.insert("reasoning".into(), serde_json::json!({"effort": "none"}));
        } else {
            fields.insert("reasoning_effort".into(), "none".into());
        }
    } else if let Some(effort) = &reasoning.effort {
        if openrouter {
            fields.insert(
                "reasoning".into(),
                serde_json::json!({"enabled": true, "effort": effort}),
            );
        } else {
            fields.insert("reasoning_effort".into(), effort.clone().into());
        }
    }
    fields
}

/// A pooled client for the model's endpoints.
#[derive(Debug, Clone)]
pub struct ModelClient {
    http: reqwest::Client,
    endpoints: Arc<Endpoints>,
    /// The conversation this clone asks for ([`ModelClient::for_conversation`]): its endpoint
    /// and its identity.
    route: Option<Arc<Route>>,
    /// Batch mode's windows, shared by the clones (`spec.model.batch`).
    batch: Option<Arc<BatchWindows>>,
    /// Where this clone's batch journals the windows its turns go in.
    window_journal: Option<Arc<dyn WindowJournal>>,
    /// Set when this clone's batch reached its tail: its turns go live.
    tail: Option<Arc<BatchTail>>,
    authorization: Option<HeaderValue>,
    settings: ModelSettings,
    /// Told of every attempt's outcome, when a batch watches this client's calls.
    circuit: Option<Arc<Circuit>>,
    /// Told what every completion cost, when the run keeps a budget.
    spending: Option<Arc<Spending>>,
    /// This process's share of the key's rate limits (`spec.model.limits`), when it has any.
    limits: Option<Arc<Limits>>,
    /// What this client and its clones (the process's conversations) may send to each
    /// endpoint now, in the order of `endpoints`.
    traffic: Arc<[Traffic]>,
}

/// How the process's requests to one endpoint are held back.
#[derive(Debug, Default)]
struct Traffic {
    /// When the endpoint said to slow down (429, 529, 503 with `Retry-After`): every call to it
    /// waits it out, not only the one told.
    pause: Pause,
    /// How many may be in flight to it at once, learnt from its answers.
    admission: Admission,
}

impl Traffic {
    /// Waits out any pause, then for room; returns the place and how long pauses held it.
    async fn admit(&self) -> (Ticket<'_>, Duration) {
        let mut paused = Duration::ZERO;
        loop {
            paused += self.pause.wait().await;
            let ticket = self.admission.admit().await;
            // A pause that began while it waited for room holds it too.
            if !self.pause.holds() {
                return (ticket, paused);
            }
        }
    }
}

/// A pause every call of a client waits out before its next attempt.
#[derive(Debug, Default)]
struct Pause {
    until: std::sync::Mutex<Option<tokio::time::Instant>>,
}

impl Pause {
    /// Holds calls until `until` at least.
    fn hold_until(&self, until: tokio::time::Instant) {
        let mut held = self
            .until
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if held.is_none_or(|current| current < until) {
            *held = Some(until);
        }
    }

    fn holds(&self) -> bool {
        self.until
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .is_some_and(|until| until > tokio::time::Instant::now())
    }

    /// Waits until no pause holds; returns how long it waited.
    async fn wait(&self) -> Duration {
        let started = tokio::time::Instant::now();
        loop {
            let until = *self
                .until
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            match until {
                Some(until) if until > tokio::time::Instant::now() => {
                    tokio::time::sleep_until(until).await;
                }
                _ => return started.elapsed(),
            }
        }
    }
}

/// What a run's completions have cost so far (USD), counted as each arrives, whichever
/// conversation and batch asked: a budget's measure of what was spent. A conversation's own
/// spending is [`Spending::part_of`] its process's.
#[derive(Debug, Default)]
pub struct Spending {
    /// In billionths of a USD: exact enough (each completion rounds by at most half of one), and
    /// added to without a lock by every conversation.
    nano_usd: AtomicU64,
    /// The spending this is part of, which counts everything counted here too.
    whole: Option<Arc<Spending>>,
}

impl Spending {
    /// A spending of its own whose every amount also counts in `whole`.
    pub fn part_of(whole: &Arc<Self>) -> Arc<Self> {
        Arc::new(Self {
            nano_usd: AtomicU64::new(0),
            whole: Some(Arc::clone(whole)),
        })
    }

    /// Counts `usd` more (here and in what this is part of).
    pub fn add(&self, usd: f64) {
        // Costs are at least 0 and far below u64::MAX billionths (18 billion USD).
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let nano = (usd.max(0.0) * 1e9).round() as u64;
        let mut spending = Some(self);
        while let Some(counted) = spending {
            counted.nano_usd.fetch_add(nano, Ordering::Relaxed);
            spending = counted.whole.as_deref();
        }
    }

    /// USD counted so far.
    pub fn total(&self) -> f64 {
        #[allow(clippy::cast_precision_loss)] // exact below 2^53 billionths (9 million USD)
        let nano = self.nano_usd.load(Ordering::Relaxed) as f64;
        nano / 1e9
    }
}

/// One failed attempt.
pub(super) struct AttemptError {
    verdict: Verdict,
    status: u16,
    message: String,
    /// A proxy in front of the server shed the request for want of room (Envoy's
    /// `x-envoy-overloaded` on its 503): the server is busy, not broken.
    shed: bool,
}

impl ModelClient {
    pub fn new(settings: ModelSettings) -> Result<Self, ModelError> {
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .tcp_nodelay(true)
            .build()
            .map_err(|err| ModelError::Settings(format!("cannot build the HTTP client: {err}")))?;
        Self::with_http(http, settings)
    }

    /// Uses a given HTTP client (tests and benchmarks share one pool across clients).
    pub fn with_http(http: reqwest::Client, settings: ModelSettings) -> Result<Self, ModelError> {
        let authorization = match &settings.api_key {
            None => None,
            Some(ApiKey(key)) => {
                let mut value = HeaderValue::from_str(&format!("Bearer {key}")).map_err(|_| {
                    ModelError::Settings(
                        "the API key contains characters not allowed in a header".into(),
                    )
                })?;
                // Keeps the key out of any debug output of the request.
                value.set_sensitive(true);
                Some(value)
            }
        };
        if settings.base_urls.is_empty() {
            return Err(ModelError::Settings(
                "the model has no endpoint (spec.model.baseUrl or spec.model.endpoints)".into(),
            ));
        }
        let endpoints = Arc::new(Endpoints::new(
            &settings.base_urls,
            settings.routing.strategy,
            settings.routing.load_bound,
        ));
        let batch = settings.batch.as_ref().map(|(base_url, batch)| {
            let key = settings.api_key.as_ref().map(|ApiKey(key)| key.as_str());
            BatchApi::new(http.clone(), base_url, batch.provider, key)
                .map(|api| Arc::new(BatchWindows::new(api, *batch)))
        });
        let batch = batch.transpose().map_err(|_| {
            ModelError::Settings("the API key contains characters not allowed in a header".into())
        })?;
        Ok(Self {
            batch,
            window_journal: None,
            tail: None,
            http,
            traffic: settings
                .base_urls
                .iter()
                .map(|_| Traffic::default())
                .collect(),
            endpoints,
            route: None,
            authorization,
            settings,
            circuit: None,
            spending: None,
            limits: None,
        })
    }

    /// The same client (one connection pool, the same endpoints), for the conversation of
    /// `identity`: all its requests go to one endpoint while that endpoint is in, and carry
    /// the identity ([`RoutingSettings`]). Its endpoint is given up when the last clone of
    /// the returned client is dropped.
    #[must_use]
    pub fn for_conversation(&self, identity: &str) -> Self {
        Self {
            route: Some(Arc::new(Route::new(Arc::clone(&self.endpoints), identity))),
            ..self.clone()
        }
    }

    /// The model's endpoints, with the conversations each holds now.
    pub fn endpoints(&self) -> &Endpoints {
        &self.endpoints
    }

    /// How many requests of this client and its clones endpoint `index` takes at once now,
    /// and how many are in flight to it.
    pub fn admission(&self, index: usize) -> super::admission::Snapshot {
        self.traffic[index].admission.snapshot()
    }

    /// The same client (one connection pool), telling `circuit` of every attempt.
    #[must_use]
    pub fn with_circuit(&self, circuit: Arc<Circuit>) -> Self {
        Self {
            circuit: Some(circuit),
            ..self.clone()
        }
    }

    /// The same client, counting what each completion cost into `spending`.
    #[must_use]
    pub fn with_spending(&self, spending: Arc<Spending>) -> Self {
        Self {
            spending: Some(spending),
            ..self.clone()
        }
    }

    /// The same client, journaling the batch mode windows its turns go in to `journal`.
    #[must_use]
    pub fn with_window_journal(&self, journal: Arc<dyn WindowJournal>) -> Self {
        Self {
            window_journal: Some(journal),
            ..self.clone()
        }
    }

    /// Whether the client sends its calls in batch mode's windows.
    pub fn in_batch_mode(&self) -> bool {
        self.batch.is_some()
    }

    /// The same client, its turns going live once `tail` is reached.
    #[must_use]
    pub fn with_tail(&self, tail: Arc<BatchTail>) -> Self {
        Self {
            tail: Some(tail),
            ..self.clone()
        }
    }

    /// In batch mode, the percent of a batch's conversations still running that makes its
    /// tail (`spec.model.batch.liveTailPercent`).
    pub fn live_tail_percent(&self) -> Option<u32> {
        let batch = self.settings.batch.as_ref();
        batch.map(|(_, batch)| batch.live_tail_percent)
    }

    /// Tells batch mode that `running` conversations of this clone's batch still run, and
    /// whether it has started every one it will: then, at or below its tail's size, the
    /// batch's tail is reached and their turns go live.
    pub fn batch_running(&self, all_started: bool, running: usize) {
        if let (true, Some(tail)) = (all_started, &self.tail) {
            tail.running(running);
        }
    }

    /// Takes up the windows an earlier process journaled (see [`BatchWindows::take_up`]).
    pub fn take_up_windows(&self, entries: Vec<JournalEntry>) {
        if let Some(windows) = &self.batch {
            windows.take_up(entries);
        }
    }

    /// The same client, each request waiting until it fits `limits` (shared by its clones).
    #[must_use]
    pub fn with_limits(&self, limits: Arc<Limits>) -> Self {
        Self {
            limits: Some(limits),
            ..self.clone()
        }
    }

    /// The SHA-256 (hex) of the chat template llama.cpp's server applies, as its `GET /props`
    /// says, when every endpoint answers with the same one: which template rendered the prompt
    /// ids the run keeps. `None` when a server does not say (vLLM and hosted APIs publish no
    /// template) or the endpoints differ.
    pub async fn chat_template_sha256(&self) -> Option<String> {
        use sha2::{Digest, Sha256};
        // A tokenizer of its own renders the prompts whose ids are kept (`Retokenize`).
        let tokenizer = self
            .settings
            .tokens
            .as_ref()
            .and_then(|tokens| tokens.tokenizer_url.as_deref());
        let roots: Vec<&str> = match tokenizer {
            Some(url) => vec![url.trim_end_matches('/')],
            None => self
                .settings
                .base_urls
                .iter()
                .map(|base| tokens::server_root(base))
                .collect(),
        };
        let mut digests = std::collections::BTreeSet::new();
        for root in roots {
            let mut request = self
                .http
                .get(format!("{root}/props"))
                .timeout(Duration::from_secs(10));
            if let (Some(authorization), None) = (&self.authorization, tokenizer) {
                request = request.header(AUTHORIZATION, authorization.clone());
            }
            let response = request.send().await.ok()?.error_for_status().ok()?;
            let props: Value = response.json().await.ok()?;
            let template = props.get("chat_template")?.as_str()?;
            digests.insert(format!("{:x}", Sha256::digest(template.as_bytes())));
        }
        let mut digests = digests.into_iter();
        match (digests.next(), digests.next()) {
            (Some(digest), None) => Some(digest),
            _ => None,
        }
    }

    /// What `completion` cost: the run's prices applied to its usage (or the provider's figure,
    /// as the prices prefer), else the provider's figure alone; `None` when neither is known.
    pub fn cost_of(&self, completion: &Completion) -> Option<Cost> {
        match &self.settings.prices {
            Some(prices) => Some(prices.cost(
                completion.usage.tokens(),
                completion.reported_cost,
                completion.tier.unwrap_or_default(),
            )),
            None => completion.reported_cost.map(|total| {
                Cost::reported(total).billed_at(completion.tier.unwrap_or_default(), total)
            }),
        }
    }

    pub fn settings(&self) -> &ModelSettings {
        &self.settings
    }

    /// The request body for one call.
    pub fn request_body(
        &self,
        system: Option<&str>,
        messages: &[Message],
        tools: Option<&[Value]>,
    ) -> Value {
        let settings = &self.settings;
        let mut wire = Vec::with_capacity(messages.len() + 1);
        if let Some(system) = system {
            wire.push(Message::System(system.to_owned()).to_wire());
        }
        wire.extend(messages.iter().map(Message::to_wire));
        let mut body = Map::new();
        body.insert("model".into(), settings.model.clone().into());
        body.insert("messages".into(), Value::Array(wire));
        if let Some(tools) = tools.filter(|tools| !tools.is_empty()) {
            body.insert("tools".into(), Value::Array(tools.to_vec()));
            body.insert("tool_choice".into(), "auto".into());
        }
        if let Some(max_tokens) = settings.max_tokens {
            body.insert("max_tokens".into(), max_tokens.into());
        }
        if let Some(temperature) = settings.temperature {
            body.insert("temperature".into(), temperature.into());
        }
        if settings.stream {
            body.insert("stream".into(), true.into());
            body.insert(
                "stream_options".into(),
                serde_json::json!({"include_usage": true}),
            );
        }
        if let Some(route) = &self.route
            && settings.routing.prompt_cache_key
        {
            body.insert("prompt_cache_key".into(), route.identity.clone().into());
        }
        if let Some(tokens) = &settings.tokens {
            tokens.add_request_fields(&mut body);
        }
        if let Some(service_tier) = &settings.service_tier {
            body.insert(SERVICE_TIER.into(), service_tier.tier.wire_name().into());
        }
        for (key, value) in settings.reasoning_fields.iter().chain(&settings.extra_body) {
            body.insert(key.clone(), value.clone());
        }
        Value::Object(body)
    }

    /// One chat completion, with retries. `turn` numbers synthetic tool-call ids.
    ///
    /// A server that says to slow down (429, 529, a 503 with `Retry-After` or shed by a proxy)
    /// lowers how many requests of the process it takes at once ([`Admission`]); its
    /// `Retry-After` pauses every call of the process to it until it has passed (without one,
    /// the call told backs off alone), and the turn is asked again without spending one of its
    /// attempts: being throttled is not failing, and a burst of it neither burns a turn's
    /// attempts nor opens the batch's circuit. Only the total wait is bounded
    /// (`max_total_wait`), past which the outage path takes over.
    pub async fn complete(&self, body: &Value, turn: usize) -> Result<Completion, ModelError> {
        if let Some(windows) = &self.batch {
            let tail = self.tail.as_deref();
            if !tail.is_some_and(BatchTail::is_reached) {
                let in_batch = self.complete_in_batch(windows, body, turn);
                let completion = match tail {
                    // A turn waiting when the tail is reached goes live at once.
                    Some(tail) => tokio::select! {
                        completion = in_batch => completion?,
                        () = tail.reached() => None,
                    },
                    None => in_batch.await?,
                };
                if let Some(completion) = completion {
                    return Ok(completion);
                }
            }
        }
        self.complete_live(body, turn).await
    }

    /// The call through batch mode's windows: its completion, or `None` when it goes live.
    async fn complete_in_batch(
        &self,
        windows: &BatchWindows,
        body: &Value,
        turn: usize,
    ) -> Result<Option<Completion>, ModelError> {
        let custom_id = match &self.route {
            Some(route) => batch_custom_id(&route.identity, turn),
            None => batch_custom_id(&format!("call-{}", windows.next_call()), turn),
        };
        let read_tokens = self.settings.tokens.is_some();
        let journal = self.window_journal.clone();
        match windows.ask(custom_id, body, journal).await {
            BatchAnswer::Answered(bytes) => match parse_completion(&bytes, turn, read_tokens) {
                Ok(mut completion) => {
                    completion.tier = Some(PriceTier::Batch);
                    completion.endpoint = Some(windows.base_url().to_owned());
                    self.add_spending(&completion);
                    Ok(Some(completion))
                }
                Err(failure) => {
                    warn!(
                        ?failure,
                        "a batch answer could not be read; the turn goes live"
                    );
                    Ok(None)
                }
            },
            BatchAnswer::Refused { status, message } => {
                let message = self.redact(message);
                // A line refused for a reason worth a retry goes live; others end the call.
                let verdict = classify_status(status, &message, None);
                verdict.settle(status, message).map(|_| None)
            }
            BatchAnswer::GoLive(_) => Ok(None),
        }
    }

    /// Tells the run's budget what `completion` cost.
    fn add_spending(&self, completion: &Completion) {
        if let (Some(spending), Some(cost)) = (&self.spending, self.cost_of(completion)) {
            spending.add(cost.total);
        }
    }

    /// The call as one request of its own, with retries (see [`ModelClient::complete`]).
    async fn complete_live(&self, body: &Value, turn: usize) -> Result<Completion, ModelError> {
        let policy = &self.settings.retry;
        let mut waited = Duration::ZERO;
        let (mut attempt, mut throttled) = (0, 0);
        let mut tier = CallTier::new(self.settings.service_tier);
        let request = body;
        // Serialised once (again only to leave a service tier): every attempt sends these
        // bytes, and the input-token limit measures them.
        let mut body = serde_json::to_vec(request).expect("a JSON value serialises");
        loop {
            // Chosen again for each attempt: one taken out since the last goes to another.
            let endpoint = self
                .route
                .as_ref()
                .map_or_else(|| self.endpoints.first_in(), |route| route.endpoint());
            let (ticket, paused) = self.traffic[endpoint].admit().await;
            waited += paused;
            let error = match self.attempt_within_limits(endpoint, &body, turn).await {
                Ok(mut completion) => {
                    completion.endpoint = Some(self.endpoints.get(endpoint).base_url.clone());
                    completion.tier.get_or_insert(tier.billed());
                    ticket.answered();
                    self.endpoints.succeeded(endpoint);
                    self.tell_circuit(true);
                    self.add_spending(&completion);
                    return Ok(completion);
                }
                Err(error) => error,
            };
            let (slow_down, moves) = self.note_failure(endpoint, ticket, &error);
            let AttemptError {
                verdict,
                status,
                message,
                ..
            } = error;
            let (class, retry_after, message) = verdict.settle(status, self.redact(message))?;
            if moves {
                continue;
            }
            if slow_down {
                throttled += 1;
            } else {
                attempt += 1;
            }
            let delay = retry_after.map_or_else(
                || policy.backoff(if slow_down { throttled } else { attempt }),
                |after| after.min(policy.max_delay),
            );
            if slow_down && let Some(wait) = tier.refused(delay) {
                tokio::time::sleep(wait).await;
                waited += wait;
                body = tier.fall_back(request);
                continue;
            }
            if attempt >= policy.max_attempts || waited + delay > policy.max_total_wait {
                return Err(ModelError::Exhausted {
                    class,
                    attempts: attempt + throttled,
                    message,
                });
            }
            if slow_down && retry_after.is_some() {
                warn!(throttled, %class, status, delay_ms = delay.as_millis(), "the model server says to slow down; every call to it waits");
                self.traffic[endpoint]
                    .pause
                    .hold_until(tokio::time::Instant::now() + delay);
            } else if slow_down {
                // Without a time to wait, the cut in requests at once slows the others; this one
                // backs off alone.
                debug!(throttled, %class, status, delay_ms = delay.as_millis(), "the model server says to slow down; this call backs off");
                tokio::time::sleep(delay).await;
                waited += delay;
            } else {
                warn!(attempt, %class, status, delay_ms = delay.as_millis(), "model call failed; retrying");
                tokio::time::sleep(delay).await;
                waited += delay;
            }
        }
    }

    /// One attempt, within the run's rate limits when it has any: it waits until it fits them,
    /// and what it used is settled with them after.
    async fn attempt_within_limits(
        &self,
        endpoint: usize,
        body: &[u8],
        turn: usize,
    ) -> Result<Completion, AttemptError> {
        let Some(limits) = &self.limits else {
            return self.attempt(endpoint, body, turn).await;
        };
        let reservation = self.reserve(limits, body.len()).await;
        let outcome = self.attempt(endpoint, body, turn).await;
        let used = outcome.as_ref().map_or((0, 0), |completion| {
            let tokens = completion.usage.tokens();
            (tokens.prompt, tokens.completion)
        });
        limits.settle(reservation, used.0, used.1).await;
        outcome
    }

    /// Waits until a request of a `body_bytes` body fits the limits, and reserves it: its prompt
    /// at a token a 4 bytes of the body, its answer at `max_tokens`.
    async fn reserve<'a>(&self, limits: &'a Limits, body_bytes: usize) -> Reservation<'a> {
        let input = u64::try_from(body_bytes / 4).unwrap_or(u64::MAX);
        let output = self
            .settings
            .max_tokens
            .map_or(DEFAULT_OUTPUT_RESERVED, u64::from);
        limits.reserve(input, output).await
    }

    /// Tells the endpoint's admission and health, and the batch's circuit, what a failed attempt
    /// says. Returns whether it said to slow down, and whether the turn moves to another endpoint
    /// at once (this failure took its endpoint out, and another is in).
    fn note_failure(
        &self,
        endpoint: usize,
        ticket: Ticket<'_>,
        error: &AttemptError,
    ) -> (bool, bool) {
        let slow_down = is_slow_down(&error.verdict, error.status, error.shed);
        // A refusal is an answer, and so is being told to slow down: the server is up.
        let answered = slow_down || !matches!(error.verdict, Verdict::Retry { .. });
        if slow_down {
            if ticket.slowed_down() {
                let limit = self.traffic[endpoint].admission.snapshot().limit;
                info!(
                    endpoint = %self.endpoints.get(endpoint).base_url,
                    limit = limit.map(f64::floor),
                    "the model endpoint said to slow down; fewer requests to it at once"
                );
            }
        } else if answered {
            ticket.answered();
        }
        drop(ticket);
        self.tell_circuit(answered);
        // The failure that takes an endpoint out moves the turn to another at once, without
        // spending an attempt: a conversation alone on a dead server would otherwise spend its
        // attempts there before it could move.
        let mut moves = false;
        if answered {
            self.endpoints.succeeded(endpoint);
        } else if (error.status == 0 || error.status >= 500) && self.endpoints.failed(endpoint) {
            moves = self.endpoints.any_in();
            warn!(
                endpoint = %self.endpoints.get(endpoint).base_url,
                "the model endpoint keeps failing; it is taken out for a while and its \
                 conversations move to the others"
            );
        }
        (slow_down, moves)
    }

    fn tell_circuit(&self, answered: bool) {
        match (&self.circuit, answered) {
            (Some(circuit), true) => circuit.success(),
            (Some(circuit), false) => circuit.failure(),
            (None, _) => {}
        }
    }

    /// Servers and proxies sometimes echo the key in an error body; it must not reach an error
    /// message, which is logged and recorded with the failed prompt.
    fn redact(&self, message: String) -> String {
        match &self.settings.api_key {
            Some(ApiKey(key)) if !key.is_empty() && message.contains(key.as_str()) => {
                message.replace(key.as_str(), "<redacted>")
            }
            _ => message,
        }
    }

    async fn attempt(
        &self,
        endpoint: usize,
        body: &[u8],
        turn: usize,
    ) -> Result<Completion, AttemptError> {
        let started = Instant::now();
        let mut request = self
            .http
            .post(&self.endpoints.get(endpoint).url)
            .timeout(self.settings.request_timeout)
            .header(CONTENT_TYPE, "application/json")
            .body(body.to_vec());
        if let Some(authorization) = &self.authorization {
            request = request.header(AUTHORIZATION, authorization.clone());
        }
        if let (Some(route), Some(header)) = (&self.route, &self.settings.routing.session_header)
            && let Ok(value) = HeaderValue::from_str(&route.identity)
        {
            request = request.header(header, value);
        }
        let response = request.send().await.map_err(transport_error)?;
        if let Some(limits) = &self.limits {
            limits.learn(response.headers());
        }
        let status = response.status();
        if !status.is_success() {
            let retry_after = response
                .headers()
                .get(RETRY_AFTER)
                .and_then(|value| value.to_str().ok())
                .and_then(parse_retry_after)
                .or_else(|| {
                    // Without a `Retry-After`, a rate limit's own reset says how long to wait.
                    (status == reqwest::StatusCode::TOO_MANY_REQUESTS)
                        .then(|| wait_for_reset(response.headers(), chrono::Utc::now()))
                        .flatten()
                });
            let shed = response.headers().contains_key(ENVOY_OVERLOADED);
            let text = response.text().await.unwrap_or_default();
            return Err(AttemptError {
                verdict: classify_status(status.as_u16(), &text, retry_after),
                status: status.as_u16(),
                message: truncate(&self.redact(text), 500),
                shed,
            });
        }
        let parsed = if self.settings.stream {
            sse::read_completion(response, turn).await?
        } else {
            let bytes = response.bytes().await.map_err(transport_error)?;
            parse_completion(&bytes, turn, self.settings.tokens.is_some())
        };
        debug!(
            elapsed_ms = started.elapsed().as_millis(),
            "model call answered"
        );
        let mut completion = parsed.map_err(|failure| parse_failure(failure, status.as_u16()))?;
        if let Some(settings) = &self.settings.tokens {
            match settings.request {
                TokenRequest::LlamaServer => {
                    if let Some(tokens) = completion.tokens.as_mut() {
                        self.add_llama_server_prompt_ids(endpoint, body, tokens, completion.usage)
                            .await;
                    }
                }
                TokenRequest::Retokenize => {
                    let reply = Message::Assistant(completion.message.clone()).to_wire();
                    let tokens = completion.tokens.get_or_insert_with(CallTokens::default);
                    self.add_retokenized_ids(endpoint, settings, body, reply, tokens)
                        .await;
                }
                TokenRequest::ReturnTokenIds | TokenRequest::LogprobsOnly => {}
            }
            if let Some(tokens) = completion.tokens.as_mut() {
                settings.keep_asked(tokens);
            }
        }
        Ok(completion)
    }

    /// llama.cpp's own API on the server of `endpoint`, with the model's key.
    fn endpoint_tokenizer(&self, endpoint: usize) -> tokens::LlamaCppTokenizer<'_> {
        tokens::LlamaCppTokenizer {
            http: &self.http,
            root: tokens::server_root(&self.endpoints.get(endpoint).base_url),
            authorization: self.authorization.as_ref(),
            timeout: self.settings.request_timeout,
        }
    }

    /// The prompt's ids of a call to a llama.cpp server, asked of the same server for the same
    /// request; kept only if as many as the prompt tokens it reported. Without them the call's
    /// ids are not whole, and its record says so: the reply is not asked for again.
    async fn add_llama_server_prompt_ids(
        &self,
        endpoint: usize,
        body: &[u8],
        tokens: &mut CallTokens,
        usage: Usage,
    ) {
        match self.endpoint_tokenizer(endpoint).prompt_ids(body).await {
            Ok(ids) if ids.len() as u64 == usage.prompt_tokens => {
                tokens.prompt_token_ids = Some(ids);
            }
            Ok(ids) => warn!(
                ids = ids.len(),
                prompt_tokens = usage.prompt_tokens,
                "the server's prompt ids do not match the prompt tokens it reported; not kept"
            ),
            Err(err) => warn!(%err, "the server did not give the prompt's ids; not kept"),
        }
    }

    /// Ids made again from the text of a call (`Retokenize`), in place of any the server gave.
    /// A tokenizer of its own (`tokenizerUrl`) is not sent the model's key. Without them the
    /// call has none, and its record says so.
    async fn add_retokenized_ids(
        &self,
        endpoint: usize,
        settings: &TokenSettings,
        body: &[u8],
        reply: Value,
        tokens: &mut CallTokens,
    ) {
        let tokenizer = match &settings.tokenizer_url {
            Some(url) => tokens::LlamaCppTokenizer {
                http: &self.http,
                root: url.trim_end_matches('/'),
                authorization: None,
                timeout: self.settings.request_timeout,
            },
            None => self.endpoint_tokenizer(endpoint),
        };
        tokens.prompt_token_ids = None;
        tokens.completion_token_ids = None;
        match tokenizer.retokenize(body, reply).await {
            Ok((prompt, completion)) => {
                tokens.prompt_token_ids = Some(prompt);
                tokens.completion_token_ids = Some(completion);
                tokens.retokenized = true;
            }
            Err(err) => warn!(%err, "the tokenizer did not make the call's ids; none kept"),
        }
    }
}

/// Output tokens a request reserves against `spec.model.limits` when `maxTokens` is unset.
const DEFAULT_OUTPUT_RESERVED: u64 = 1_024;

/// The header Envoy sets on the 503 it answers when a circuit breaker sheds a request.
const ENVOY_OVERLOADED: &str = "x-envoy-overloaded";

/// Whether an answer says to slow down rather than that the call failed: 429 (rate limited; an
/// exhausted quota is permanent, not this), 529 (overloaded), or 503 with a `Retry-After` or
/// from a proxy that shed it (`shed`).
fn is_slow_down(verdict: &Verdict, status: u16, shed: bool) -> bool {
    match verdict {
        Verdict::Retry { class, retry_after } => {
            *class == ErrorClass::RateLimited
                || status == 529
                || (status == 503 && (retry_after.is_some() || shed))
        }
        Verdict::Reject(_) | Verdict::Permanent(_) => false,
    }
}

/// Maps a transport error (no usable HTTP status) to a retry.
#[allow(clippy::needless_pass_by_value)] // used as `map_err(transport_error)`
pub(super) fn transport_error(error: reqwest::Error) -> AttemptError {
    let class = if error.is_timeout() {
        ErrorClass::Timeout
    } else {
        ErrorClass::Connection
    };
    AttemptError {
        verdict: Verdict::Retry {
            class,
            retry_after: None,
        },
        status: 0,
        message: error_chain(&error),
        shed: false,
    }
}

/// The error and its sources, so "connection reset" is not hidden behind "error sending request".
fn error_chain(error: &dyn std::error::Error) -> String {
    let mut message = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        message.push_str(": ");
        message.push_str(&cause.to_string());
        source = cause.source();
    }
    message
}

pub(super) fn parse_failure(failure: ParseFailure, status: u16) -> AttemptError {
    let (class, message) = match failure {
        ParseFailure::EmptyChoices => (
            ErrorClass::EmptyResponse,
            "response had no choices".to_owned(),
        ),
        ParseFailure::Malformed(message) => (ErrorClass::MalformedResponse, message),
    };
    AttemptError {
        verdict: Verdict::Retry {
            class,
            retry_after: None,
        },
        status,
        message,
        shed: false,
    }
}

/// `Retry-After` is either delay-seconds or an HTTP-date.
pub(crate) fn parse_retry_after(value: &str) -> Option<Duration> {
    let value = value.trim();
    if let Ok(seconds) = value.parse::<f64>() {
        return (seconds.is_finite() && seconds >= 0.0).then(|| Duration::from_secs_f64(seconds));
    }
    let date = httpdate::parse_http_date(value).ok()?;
    Some(
        date.duration_since(SystemTime::now())
            .unwrap_or(Duration::ZERO),
    )
}

fn truncate(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_owned();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &text[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_accepts_seconds_and_http_dates() {
        assert_eq!(parse_retry_after("3"), Some(Duration::from_secs(3)));
        assert_eq!(parse_retry_after(" 0.5 "), Some(Duration::from_millis(500)));
        let in_ten = SystemTime::now() + Duration::from_secs(10);
        let parsed = parse_retry_after(&httpdate::fmt_http_date(in_ten)).unwrap();
        assert!(
            parsed > Duration::from_secs(8) && parsed <= Duration::from_secs(10),
            "{parsed:?}"
        );
        assert_eq!(
            parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT"),
            Some(Duration::ZERO)
        );
        assert_eq!(parse_retry_after("soon"), None);
        assert_eq!(parse_retry_after("-1"), None);
    }

    #[test]
    fn backoff_grows_is_capped_and_jittered() {
        let policy = RetryPolicy {
            base_delay: Duration::from_secs(1),
            max_delay: Duration::from_secs(8),
            ..RetryPolicy::default()
        };
        for attempt in 1..=10 {
            let delay = policy.backoff(attempt);
            let cap = Duration::from_secs(1 << (attempt - 1).min(3));
            assert!(
                delay >= cap / 2 && delay <= cap,
                "attempt {attempt}: {delay:?}"
            );
        }
    }

    #[test]
    fn api_key_never_shows_in_debug_output() {
        let key = ApiKey::new("sk-very-secret");
        assert!(!format!("{key:?}").contains("secret"));
        let settings = ModelSettings {
            base_urls: vec!["http://127.0.0.1:1/v1".into()],
            routing: RoutingSettings::default(),
            model: "m".into(),
            api_key: Some(key),
            max_tokens: None,
            temperature: None,
            reasoning_fields: Map::new(),
            extra_body: Map::new(),
            request_timeout: Duration::from_secs(1),
            stream: false,
            retry: RetryPolicy::default(),
            prices: None,
            tokens: None,
            service_tier: None,
            batch: None,
        };
        let client = ModelClient::new(settings).unwrap();
        assert!(!format!("{client:?}").contains("secret"));
    }

    #[test]
    fn request_body_merges_extra_body_verbatim_and_reasoning_by_provider() {
        let spec: ModelSpec = serde_json::from_value(serde_json::json!({
            "baseUrl": "https://openrouter.ai/api/v1", "name": "m", "maxTokens": 64,
            "temperature": 0.0, "reasoning": {"effort": "high"},
            "extraBody": {"provider": {"order": ["a"]}, "top_k": 5},
        }))
        .unwrap();
        let client = ModelClient::new(ModelSettings::from_spec(&spec, None).unwrap()).unwrap();
        let body = client.request_body(
            Some("sys"),
            &[Message::User("hi".into())],
            Some(&[serde_json::json!({"type": "function"})]),
        );
        assert_eq!(body["provider"], serde_json::json!({"order": ["a"]}));
        assert_eq!(body["top_k"], 5);
        assert_eq!(
            body["reasoning"],
            serde_json::json!({"enabled": true, "effort": "high"})
        );
        assert_eq!(body["messages"][0]["role"], "system");
        assert_eq!(body["tool_choice"], "auto");
        assert_eq!(body["max_tokens"], 64);
        let mut spec = spec;
        spec.base_url = "http://vllm:8000/v1".into();
        spec.reasoning = Some(crate::spec::ReasoningSpec {
            effort: Some("low".into()),
            disabled: true,
        });
        let client = ModelClient::new(ModelSettings::from_spec(&spec, None).unwrap()).unwrap();
        assert_eq!(
            client.request_body(None, &[], None)["reasoning_effort"],
            "none"
        );
    }

    #[test]
    fn a_conversation_sends_its_identity_as_prompt_cache_key_when_asked() {
        let spec = |routing: serde_json::Value| -> ModelSpec {
            serde_json::from_value(serde_json::json!({
                "endpoints": [{"baseUrl": "http://m0/v1"}, {"baseUrl": "http://m1/v1/"}],
                "name": "m", "routing": routing,
            }))
            .unwrap()
        };
        let settings = ModelSettings::from_spec(&spec(serde_json::json!({})), None).unwrap();
        assert_eq!(settings.base_urls, ["http://m0/v1", "http://m1/v1"]);
        assert_eq!(
            settings
                .routing
                .session_header
                .as_ref()
                .map(HeaderName::as_str),
            Some("x-session-id")
        );
        let client = ModelClient::new(settings).unwrap();
        let conversation = client.for_conversation("run-7-0");
        assert!(
            conversation.request_body(None, &[], None)["prompt_cache_key"].is_null(),
            "off by default"
        );
        let keyed = spec(serde_json::json!({"promptCacheKey": true, "sessionHeader": ""}));
        let settings = ModelSettings::from_spec(&keyed, None).unwrap();
        assert!(settings.routing.session_header.is_none());
        let client = ModelClient::new(settings).unwrap();
        assert!(client.request_body(None, &[], None)["prompt_cache_key"].is_null());
        let conversation = client.for_conversation("run-7-0");
        assert_eq!(
            conversation.request_body(None, &[], None)["prompt_cache_key"],
            "run-7-0"
        );
        // The conversation holds its endpoint from its first request until its last clone goes.
        let held = conversation.route.as_ref().unwrap().endpoint();
        let counts = |client: &ModelClient| -> Vec<usize> {
            client
                .endpoints()
                .all()
                .iter()
                .map(super::super::routing::Endpoint::conversations)
                .collect()
        };
        assert_eq!(counts(&client)[held], 1);
        drop(conversation);
        assert_eq!(counts(&client), [0, 0]);
    }

    #[test]
    fn a_bad_base_url_is_refused_naming_the_field() {
        let spec: ModelSpec =
            serde_json::from_value(serde_json::json!({"baseUrl": "not a url", "name": "m"}))
                .unwrap();
        let error = ModelSettings::from_spec(&spec, None)
            .unwrap_err()
            .to_string();
        assert!(error.contains("spec.model.baseUrl"), "{error}");
        let spec: ModelSpec = serde_json::from_value(serde_json::json!({
            "endpoints": [{"baseUrl": "http://m0/v1"}, {"baseUrl": "ftp://m1"}], "name": "m",
        }))
        .unwrap();
        let error = ModelSettings::from_spec(&spec, None)
            .unwrap_err()
            .to_string();
        assert!(error.contains("spec.model.endpoints[1].baseUrl"), "{error}");
    }
}
