//! What the schema cannot express about a `TrajectoryRun` spec, checked: bounds, paths, the
//! backends a distribution needs ([`distribution_violations`]) and the MCP servers and HTTP tools
//! a spec declares ([`declared_tool_violations`]). Every violation names its field.
//!
//! It sits above the types it checks ([`crate::spec`]) and the data it checks them against
//! ([`crate::toolsets`], [`crate::template`], [`crate::pricing`]), and builds with serde alone like them, so that the
//! operator refuses a bad spec before any pod starts, in the words the worker would use.

mod declared;
mod distribution;

pub use declared::{declared_tool_violations, is_valid_name};
pub use distribution::distribution_violations;

use crate::pricing::Prices;
use crate::spec::{
    BatchProvider, BrowserSpec, DistributionSpec, ImageGenSpec, RunSpec, TokenRequest, ValueSource,
    VisionSpec, WebSearchBackend,
};

/// The most alternatives per token a server is asked for (`OpenAI`'s bound, which vLLM and
/// llama.cpp's server share by default).
pub const MAX_TOP_LOGPROBS: u8 = 20;

/// A spec value that is out of bounds, named by its field path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpecViolation {
    /// Field path, e.g. `spec.batchSize`.
    pub field: String,
    pub message: String,
}

impl std::fmt::Display for SpecViolation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.field, self.message)
    }
}

/// The violations [`RunSpec::validate`] has found so far, in the order it checks the fields.
#[derive(Debug, Default)]
struct Violations(Vec<SpecViolation>);

impl Violations {
    /// Records `message` against `spec.<field>` unless `ok`.
    fn check(&mut self, ok: bool, field: &str, message: String) {
        if !ok {
            self.0.push(SpecViolation {
                field: format!("spec.{field}"),
                message,
            });
        }
    }
}

impl RunSpec {
    /// Checks bounds that the types alone do not; returns every violation, each naming its field.
    pub fn validate(&self) -> Vec<SpecViolation> {
        let mut violations = Violations::default();
        self.check_dataset_and_sizes(&mut violations);
        self.check_model(&mut violations);
        self.check_agent_and_tools(&mut violations);
        self.check_storage_and_distribution(&mut violations);
        self.check_verifier(&mut violations);
        self.check_user_simulator(&mut violations);
        violations.0
    }

    fn check_user_simulator(&self, violations: &mut Violations) {
        let Some(simulator) = &self.user_simulator else {
            return;
        };
        let model = &simulator.model;
        violations.check(
            !model.name.is_empty(),
            "userSimulator.model.name",
            "must not be empty".to_owned(),
        );
        violations.check(
            !model.base_url.is_empty() && model.endpoints.is_empty(),
            "userSimulator.model.baseUrl",
            "must be set: the simulator has one endpoint (no endpoints)".to_owned(),
        );
        violations.check(
            model.max_attempts >= 1 && model.request_timeout_seconds >= 1,
            "userSimulator.model.maxAttempts",
            "maxAttempts and requestTimeoutSeconds must be at least 1".to_owned(),
        );
        for (field, set) in [
            ("userSimulator.model.budget", model.budget.is_some()),
            ("userSimulator.model.tokens", model.tokens.is_some()),
            ("userSimulator.model.limits", model.limits.is_some()),
        ] {
            violations.check(
                !set,
                field,
                "is not kept for the simulator: its cost is recorded apart from the agent's, \
                 and spec.model's budget holds the agent's calls"
                    .to_owned(),
            );
        }
        violations.check(
            simulator.max_turns >= 1,
            "userSimulator.maxTurns",
            "must be at least 1".to_owned(),
        );
        violations.check(
            !simulator.stop_tokens.is_empty()
                && simulator
                    .stop_tokens
                    .iter()
                    .all(|token| !token.trim().is_empty()),
            "userSimulator.stopTokens",
            "must hold at least one marker, none of them blank".to_owned(),
        );
    }

    fn check_verifier(&self, violations: &mut Violations) {
        if let Some(min_reward) = self.filters.min_reward {
            violations.check(
                min_reward.is_finite(),
                "filters.minReward",
                format!("must be a number, got {min_reward}"),
            );
        }
        let Some(verifier) = &self.verifier else {
            return;
        };
        violations.check(
            verifier.timeout_seconds > 0,
            "verifier.timeoutSeconds",
            "must be at least 1".to_owned(),
        );
        if let Some(passes) = verifier.passes_per_prompt {
            violations.check(
                (1..=self.samples_per_prompt).contains(&passes),
                "verifier.passesPerPrompt",
                format!(
                    "must be between 1 and samplesPerPrompt ({}), got {passes}",
                    self.samples_per_prompt
                ),
            );
        }
        violations.check(
            verifier.passing_reward.is_finite(),
            "verifier.passingReward",
            format!("must be a number, got {}", verifier.passing_reward),
        );
        for (field, path) in [
            ("verifier.testsDir", &verifier.tests_dir),
            ("verifier.rewardFile", &verifier.reward_file),
        ] {
            violations.check(
                path.strip_prefix('/').is_some_and(is_relative_clean_path),
                field,
                format!("{path:?} must be an absolute path below `/`, without `..`"),
            );
        }
        violations.check(
            verifier
                .reward_file
                .trim_end_matches('/')
                .matches('/')
                .count()
                >= 2,
            "verifier.rewardFile",
            format!(
                "{:?} must lie in a directory of its own (like /logs/verifier/reward.txt): that \
                 directory is made afresh before each verifier",
                verifier.reward_file
            ),
        );
    }

    fn check_dataset_and_sizes(&self, violations: &mut Violations) {
        violations.check(
            is_relative_clean_path(&self.dataset.path),
            "dataset.path",
            format!(
                "{:?} must be a relative path inside the storage volume, without `..`",
                self.dataset.path
            ),
        );
        if let Some(report) = &self.dataset.exclude_oracle_failures {
            violations.check(
                is_relative_clean_path(report),
                "dataset.excludeOracleFailures",
                format!(
                    "{report:?} must be a relative path inside the storage volume, without `..`"
                ),
            );
            violations.check(
                self.dataset.format == crate::spec::DatasetFormat::HarborTasks,
                "dataset.excludeOracleFailures",
                "leaves out Harbor tasks by name: it needs dataset.format HarborTasks".to_owned(),
            );
        }
        if let Some(builds) = &self.sandbox.builds {
            violations.check(
                self.dataset.format == crate::spec::DatasetFormat::HarborTasks,
                "sandbox.builds",
                "builds the images of Harbor tasks: it needs dataset.format HarborTasks".to_owned(),
            );
            violations.check(
                is_build_repository(&builds.repository),
                "sandbox.builds.repository",
                format!(
                    "{:?} must name a registry host and a repository, without a tag or digest \
                     (registry.example.com/team/envs)",
                    builds.repository
                ),
            );
        }
        if let Some(replay) = &self.replay {
            violations.check(
                is_relative_clean_path(&replay.from),
                "replay.from",
                format!(
                    "{:?} must be a relative path inside the storage volume, without `..`",
                    replay.from
                ),
            );
        }
        violations.check(
            !self.dataset.prompt_field.is_empty(),
            "dataset.promptField",
            "must not be empty".to_owned(),
        );
        violations.check(
            self.batch_size >= 1,
            "batchSize",
            format!("must be at least 1, got {}", self.batch_size),
        );
        violations.check(
            self.workers >= 1,
            "workers",
            format!("must be at least 1, got {}", self.workers),
        );
        violations.check(
            (1..=10_000).contains(&self.concurrency),
            "concurrency",
            format!("must be between 1 and 10000, got {}", self.concurrency),
        );
        violations.check(
            self.samples_per_prompt >= 1,
            "samplesPerPrompt",
            format!("must be at least 1, got {}", self.samples_per_prompt),
        );
    }

    /// `baseUrl` or `endpoints`, one of them, each an http(s) URL, no endpoint twice.
    fn check_endpoints(&self, violations: &mut Violations) {
        let model = &self.model;
        if model.endpoints.is_empty() {
            check_http_url("model.baseUrl", &model.base_url, violations);
            return;
        }
        violations.check(
            model.base_url.is_empty(),
            "model.baseUrl",
            "set either baseUrl (one endpoint) or endpoints (several), not both".to_owned(),
        );
        for (index, endpoint) in model.endpoints.iter().enumerate() {
            let field = format!("model.endpoints[{index}].baseUrl");
            check_http_url(&field, &endpoint.base_url, violations);
            let same = |other: &crate::spec::EndpointSpec| {
                other.base_url.trim_end_matches('/') == endpoint.base_url.trim_end_matches('/')
            };
            if let Some(first) = model.endpoints[..index].iter().position(same) {
                violations.check(
                    false,
                    &field,
                    format!("the same endpoint as model.endpoints[{first}]"),
                );
            }
        }
    }

    fn check_model(&self, violations: &mut Violations) {
        self.check_endpoints(violations);
        violations.check(
            !self.model.name.is_empty(),
            "model.name",
            "must not be empty".to_owned(),
        );
        violations.check(
            self.model.max_attempts >= 1,
            "model.maxAttempts",
            format!("must be at least 1, got {}", self.model.max_attempts),
        );
        violations.check(
            self.model.request_timeout_seconds >= 1,
            "model.requestTimeoutSeconds",
            "must be at least 1".to_owned(),
        );
        if let Some(temperature) = self.model.temperature {
            violations.check(
                (0.0..=2.0).contains(&temperature),
                "model.temperature",
                format!("must be between 0 and 2, got {temperature}"),
            );
        }
        if let Some(extra) = &self.model.extra_body {
            violations.check(
                extra.is_object(),
                "model.extraBody",
                "must be a JSON object".to_owned(),
            );
            // Its `service_tier` would override the tier the calls are priced at.
            violations.check(
                self.model.service_tier.is_none() || extra.get("service_tier").is_none(),
                "model.extraBody.service_tier",
                "is set by model.serviceTier: give the tier there only".to_owned(),
            );
        }
        let routing = &self.model.routing;
        violations.check(
            routing.load_bound.is_finite() && routing.load_bound >= 1.0,
            "model.routing.loadBound",
            format!("must be at least 1, got {}", routing.load_bound),
        );
        violations.check(
            routing
                .session_header
                .bytes()
                .all(|byte| byte.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&byte)),
            "model.routing.sessionHeader",
            format!(
                "{:?} is not an HTTP header name (letters, digits and !#$%&'*+-.^_`|~)",
                routing.session_header
            ),
        );
        if let Some(Err(error)) = self.model.pricing.as_ref().map(Prices::from_spec) {
            violations.check(
                false,
                &format!("model.pricing.{}", error.field),
                error.message,
            );
        }
        if let Some(budget) = &self.model.budget {
            violations.check(
                budget.max_cost.is_finite() && budget.max_cost > 0.0,
                "model.budget.maxCost",
                format!("must be a number of USD above 0, got {}", budget.max_cost),
            );
            // A cost the provider reports arrives after the spending: only prices known in
            // advance can hold a cap.
            violations.check(
                self.model.pricing.is_some(),
                "model.budget",
                "needs the model's prices (spec.model.pricing) to hold".to_owned(),
            );
        }
        self.check_tokens(violations);
        self.check_batch(violations);
        if let Some(limits) = &self.model.limits {
            for (value, field) in [
                (limits.requests_per_minute, "requestsPerMinute"),
                (limits.input_tokens_per_minute, "inputTokensPerMinute"),
                (limits.output_tokens_per_minute, "outputTokensPerMinute"),
                (limits.tokens_per_minute, "tokensPerMinute"),
                (limits.max_in_flight, "maxInFlight"),
            ] {
                violations.check(
                    value != Some(0),
                    &format!("model.limits.{field}"),
                    "must be at least 1 (unset: no limit)".to_owned(),
                );
            }
            if let Some(gubernator) = &limits.gubernator {
                check_http_url("model.limits.gubernator.url", &gubernator.url, violations);
                violations.check(
                    !gubernator.key.trim().is_empty(),
                    "model.limits.gubernator.key",
                    "must name the key the counts are kept under".to_owned(),
                );
            }
        }
    }

    fn check_batch(&self, violations: &mut Violations) {
        let Some(batch) = &self.model.batch else {
            return;
        };
        // The providers' own limits of one batch.
        let (max_requests, max_megabytes) = match batch.provider {
            BatchProvider::OpenAI => (50_000, 200),
            BatchProvider::Anthropic => (100_000, 256),
        };
        violations.check(
            (1..=max_requests).contains(&batch.max_requests),
            "model.batch.maxRequests",
            format!(
                "must be 1 to {max_requests} ({:?}'s limit), got {}",
                batch.provider, batch.max_requests
            ),
        );
        violations.check(
            (1..=max_megabytes).contains(&batch.max_megabytes),
            "model.batch.maxMegabytes",
            format!(
                "must be 1 to {max_megabytes} ({:?}'s limit), got {}",
                batch.provider, batch.max_megabytes
            ),
        );
        violations.check(
            batch.live_tail_percent <= 100,
            "model.batch.liveTailPercent",
            format!("must be 0 to 100, got {}", batch.live_tail_percent),
        );
        for (field, seconds) in [
            ("model.batch.maxWaitSeconds", batch.max_wait_seconds),
            ("model.batch.pollSeconds", batch.poll_seconds),
            ("model.batch.deadlineSeconds", batch.deadline_seconds),
        ] {
            violations.check(
                seconds >= 1,
                field,
                format!("must be at least 1, got {seconds}"),
            );
        }
        if let Some(url) = &batch.base_url {
            violations.check(
                url.starts_with("http://") || url.starts_with("https://"),
                "model.batch.baseUrl",
                format!("must be an http(s) URL, got {url:?}"),
            );
        }
        // A batch's answers carry no llama.cpp prompt ids, and its token fields are untested.
        violations.check(
            self.model.tokens.is_none(),
            "model.batch",
            "cannot be used with model.tokens yet: keep token ids with live calls".to_owned(),
        );
    }

    fn check_tokens(&self, violations: &mut Violations) {
        let Some(tokens) = &self.model.tokens else {
            return;
        };
        violations.check(
            tokens.top_logprobs <= MAX_TOP_LOGPROBS,
            "model.tokens.topLogprobs",
            format!(
                "must be 0 to {MAX_TOP_LOGPROBS}, got {}",
                tokens.top_logprobs
            ),
        );
        if let Some(url) = &tokens.tokenizer_url {
            violations.check(
                tokens.request == TokenRequest::Retokenize,
                "model.tokens.tokenizerUrl",
                "is for request Retokenize only: the other requests take the model's own ids"
                    .to_owned(),
            );
            violations.check(
                url.starts_with("http://") || url.starts_with("https://"),
                "model.tokens.tokenizerUrl",
                format!("must be an http(s) URL, got {url:?}"),
            );
        }
        // A streamed reply's ids arrive spread over its chunks, differently on each server.
        violations.check(
            !self.model.stream,
            "model.tokens",
            "needs model.stream false: token ids are read from whole responses".to_owned(),
        );
    }

    fn check_agent_and_tools(&self, violations: &mut Violations) {
        violations.check(
            self.agent.max_turns >= 1,
            "agent.maxTurns",
            "must be at least 1".to_owned(),
        );
        violations.check(
            self.agent.prompt_timeout_seconds >= 1,
            "agent.promptTimeoutSeconds",
            "must be at least 1".to_owned(),
        );
        violations.check(
            self.tools.terminal.timeout_seconds >= 1,
            "tools.terminal.timeoutSeconds",
            "must be at least 1".to_owned(),
        );
        self.check_web(violations);
        for (index, dir) in self.sandbox.tool_dirs.iter().enumerate() {
            violations.check(
                tool_dir_problem(dir).is_none(),
                &format!("sandbox.toolDirs[{index}]"),
                tool_dir_problem(dir).unwrap_or_default(),
            );
        }
        if let Some(browser) = &self.tools.browser {
            check_browser(browser, violations);
        }
        if let Some(vision) = &self.tools.vision {
            check_vision(vision, violations);
        }
        if let Some(image_gen) = &self.tools.image_gen {
            check_image_gen(image_gen, violations);
        }
    }

    fn check_web(&self, violations: &mut Violations) {
        let web = &self.tools.web;
        if let Some(search) = &web.search {
            violations.check(
                search.url.starts_with("http://") || search.url.starts_with("https://"),
                "tools.web.search.url",
                format!("{:?} must be an http:// or https:// URL", search.url),
            );
            violations.check(
                search.backend != WebSearchBackend::Json || search.url.contains("{query}"),
                "tools.web.search.url",
                "a `json` backend's URL template must contain {query}".to_owned(),
            );
            violations.check(
                search.timeout_seconds >= 1,
                "tools.web.search.timeoutSeconds",
                "must be at least 1".to_owned(),
            );
            violations.check(
                (1..=20).contains(&search.max_results),
                "tools.web.search.maxResults",
                format!("must be between 1 and 20, got {}", search.max_results),
            );
            for (field, pointer) in [
                ("resultsPointer", &search.results_pointer),
                ("titlePointer", &search.title_pointer),
                ("urlPointer", &search.url_pointer),
                ("snippetPointer", &search.snippet_pointer),
            ] {
                violations.check(
                    pointer.is_empty() || pointer.starts_with('/'),
                    &format!("tools.web.search.{field}"),
                    format!("{pointer:?} must be a JSON pointer: empty or starting with /"),
                );
            }
        }
        violations.check(
            web.extract.timeout_seconds >= 1,
            "tools.web.extract.timeoutSeconds",
            "must be at least 1".to_owned(),
        );
        violations.check(
            web.extract.max_page_bytes >= 1024,
            "tools.web.extract.maxPageBytes",
            "must be at least 1024".to_owned(),
        );
        violations.check(
            web.extract.max_chars >= 100,
            "tools.web.extract.maxChars",
            "must be at least 100".to_owned(),
        );
    }

    fn check_storage_and_distribution(&self, violations: &mut Violations) {
        if let Some(object) = &self.storage.object {
            violations.check(
                self.storage.volume.is_none(),
                "storage.object",
                "is refused together with storage.volume: a run's files are on one or the other"
                    .to_owned(),
            );
            if let Err(why) = crate::object_url::ObjectUrl::parse(&object.url) {
                violations.check(false, "storage.object.url", why);
            }
            if let Some(endpoint) = &object.endpoint {
                violations.check(
                    endpoint.starts_with("https://") || endpoint.starts_with("http://"),
                    "storage.object.endpoint",
                    format!("{endpoint:?} must be an http:// or https:// URL"),
                );
            }
        }
        if let Some(output) = &self.storage.output_path {
            violations.check(
                is_relative_clean_path(output),
                "storage.outputPath",
                format!(
                    "{output:?} must be a relative path inside the storage volume, without `..`"
                ),
            );
        }
        violations
            .0
            .extend(distribution_violations(&self.distribution, &self.tools));
        violations.0.extend(declared_tool_violations(&self.tools));
        if let DistributionSpec::Inline(map) = &self.distribution {
            violations.check(
                !map.is_empty(),
                "distribution",
                "an inline distribution needs a toolset".to_owned(),
            );
            for (entry, percent) in map {
                violations.check(
                    (0.0..=100.0).contains(percent),
                    &format!("distribution.{entry}"),
                    format!("percent must be between 0 and 100, got {percent}"),
                );
            }
        }
    }
}

fn check_browser(browser: &BrowserSpec, violations: &mut Violations) {
    violations.check(
        browser.chromium_path.starts_with('/'),
        "tools.browser.chromiumPath",
        format!(
            "{:?} must be an absolute path (Chromium starts with an empty environment, without PATH)",
            browser.chromium_path
        ),
    );
    violations.check(
        browser.launch_timeout_seconds >= 1,
        "tools.browser.launchTimeoutSeconds",
        "must be at least 1".to_owned(),
    );
    violations.check(
        browser.navigation_timeout_seconds >= 1,
        "tools.browser.navigationTimeoutSeconds",
        "must be at least 1".to_owned(),
    );
    violations.check(
        browser.snapshot_max_chars >= 100,
        "tools.browser.snapshotMaxChars",
        format!("must be at least 100, got {}", browser.snapshot_max_chars),
    );
    for scheme in &browser.allowed_schemes {
        violations.check(
            !scheme.is_empty()
                && scheme
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || "+-.".contains(c)),
            "tools.browser.allowedSchemes",
            format!("{scheme:?} must be a lower-case URL scheme without `:` (e.g. \"https\")"),
        );
    }
}

/// A server's base URL: `http://` or `https://`.
fn check_http_url(field: &str, url: &str, violations: &mut Violations) {
    violations.check(
        url.starts_with("http://") || url.starts_with("https://"),
        field,
        format!("{url:?} must be an http:// or https:// URL"),
    );
}

/// The settings every model endpoint of a tool has: an http(s) base URL, a model, a well-formed
/// key source and a time limit.
fn check_endpoint(
    field: &str,
    (base_url, model, api_key, timeout): (&str, &str, Option<&ValueSource>, u64),
    violations: &mut Violations,
) {
    check_http_url(&format!("{field}.baseUrl"), base_url, violations);
    violations.check(
        !model.is_empty(),
        &format!("{field}.model"),
        "must not be empty".to_owned(),
    );
    violations.check(
        api_key.is_none_or(ValueSource::is_well_formed),
        &format!("{field}.apiKey"),
        "set exactly one of `env` (a variable name) and `secretKeyRef` (name and key)".to_owned(),
    );
    violations.check(
        timeout >= 1,
        &format!("{field}.timeoutSeconds"),
        "must be at least 1".to_owned(),
    );
}

fn check_vision(vision: &VisionSpec, violations: &mut Violations) {
    let endpoint = (
        vision.base_url.as_str(),
        vision.model.as_str(),
        vision.api_key.as_ref(),
        vision.timeout_seconds,
    );
    check_endpoint("tools.vision", endpoint, violations);
    violations.check(
        vision.max_tokens >= 1,
        "tools.vision.maxTokens",
        "must be at least 1".to_owned(),
    );
    violations.check(
        vision.max_image_bytes >= 1024,
        "tools.vision.maxImageBytes",
        "must be at least 1024".to_owned(),
    );
    violations.check(
        vision.download_timeout_seconds >= 1,
        "tools.vision.downloadTimeoutSeconds",
        "must be at least 1".to_owned(),
    );
}

fn check_image_gen(image_gen: &ImageGenSpec, violations: &mut Violations) {
    let endpoint = (
        image_gen.base_url.as_str(),
        image_gen.model.as_str(),
        image_gen.api_key.as_ref(),
        image_gen.timeout_seconds,
    );
    check_endpoint("tools.imageGen", endpoint, violations);
    violations.check(
        image_gen.max_image_bytes >= 1024,
        "tools.imageGen.maxImageBytes",
        "must be at least 1024".to_owned(),
    );
    let sizes = &image_gen.sizes;
    for (name, size) in [
        ("landscape", &sizes.landscape),
        ("square", &sizes.square),
        ("portrait", &sizes.portrait),
    ] {
        violations.check(
            !size.trim().is_empty(),
            &format!("tools.imageGen.sizes.{name}"),
            "must not be empty (e.g. \"1024x1024\")".to_owned(),
        );
    }
    if let Some(extra) = &image_gen.extra_body {
        violations.check(
            extra.is_object(),
            "tools.imageGen.extraBody",
            "must be a JSON object".to_owned(),
        );
    }
}

/// True for a non-empty relative path with no `..`, root or empty components.
/// What is wrong with `dir` as a [`crate::spec::SandboxSpec::tool_dirs`] entry, read without the
/// machine it names (the run checks it there at start).
pub fn tool_dir_problem(dir: &str) -> Option<String> {
    let below_home = dir.strip_prefix("~/");
    if !(dir.starts_with('/') || below_home.is_some()) {
        return Some(format!("{dir:?} must be an absolute path or start with ~/"));
    }
    if dir.contains(':') {
        return Some(format!("{dir:?} holds a ':', which a PATH cannot carry"));
    }
    let rest = below_home.unwrap_or(dir).trim_matches('/');
    if rest.is_empty() || rest.split('/').all(|part| part.is_empty() || part == ".") {
        return Some(format!(
            "{dir:?} would open {} to the model's commands: name the toolchain's own directory",
            if below_home.is_some() {
                "the whole home directory"
            } else {
                "the whole filesystem"
            }
        ));
    }
    None
}

pub fn is_relative_clean_path(path: &str) -> bool {
    !path.is_empty()
        && !path.starts_with('/')
        && path.split('/').all(|part| !part.is_empty() && part != "..")
}

/// `host[:port]/path` with a host a registry can be (a `.`, a port, or `localhost`), and no tag
/// or digest: the built images' tags are appended to it.
fn is_build_repository(repository: &str) -> bool {
    let Some((_, path)) = crate::spec::registry_host(repository) else {
        return false;
    };
    !path.is_empty()
        && !path.contains([':', '@'])
        && path.split('/').all(|part| {
            !part.is_empty()
                && part
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || "._-".contains(c))
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::SecretKeyRef;

    fn minimal() -> RunSpec {
        serde_json::from_value(serde_json::json!({
            "dataset": {"path": "data/p.jsonl"},
            "model": {"baseUrl": "http://127.0.0.1:1/v1", "name": "m"},
        }))
        .unwrap()
    }

    #[test]
    fn a_user_simulator_is_checked_field_by_field() {
        let mut spec = minimal();
        spec.user_simulator = Some(
            serde_json::from_value(serde_json::json!({
                "model": {"baseUrl": "", "name": "", "budget": {"maxCost": 1.0}},
                "maxTurns": 0, "stopTokens": [" "],
            }))
            .unwrap(),
        );
        let fields: Vec<_> = spec.validate().into_iter().map(|v| v.field).collect();
        assert_eq!(
            fields,
            [
                "spec.userSimulator.model.name",
                "spec.userSimulator.model.baseUrl",
                "spec.userSimulator.model.budget",
                "spec.userSimulator.maxTurns",
                "spec.userSimulator.stopTokens",
            ]
        );
        spec.user_simulator = Some(
            serde_json::from_value(serde_json::json!({
                "model": {"baseUrl": "http://127.0.0.1:1/v1", "name": "sim"},
            }))
            .unwrap(),
        );
        assert!(spec.validate().is_empty(), "{:?}", spec.validate());
        let simulator = spec.user_simulator.as_ref().unwrap();
        assert_eq!(
            (simulator.max_turns, simulator.stop_tokens[0].as_str()),
            (5, "###STOP###")
        );
    }

    #[test]
    fn an_oracle_report_is_a_clean_path_for_harbor_tasks_only() {
        let with = |dataset: serde_json::Value| -> Vec<String> {
            let mut spec = minimal();
            spec.dataset = serde_json::from_value(dataset).unwrap();
            spec.validate().into_iter().map(|v| v.to_string()).collect()
        };
        assert!(
            with(serde_json::json!({"path": "tasks", "format": "HarborTasks",
                                    "excludeOracleFailures": "oracle/tb2"}))
            .is_empty()
        );
        assert_eq!(
            with(serde_json::json!({"path": "rows.jsonl",
                                    "excludeOracleFailures": "../oracle/oracle.jsonl"})),
            [
                "spec.dataset.excludeOracleFailures: \"../oracle/oracle.jsonl\" must be a \
                 relative path inside the storage volume, without `..`",
                "spec.dataset.excludeOracleFailures: leaves out Harbor tasks by name: it needs \
                 dataset.format HarborTasks",
            ]
        );
    }

    #[test]
    fn a_build_repository_names_a_registry_without_a_tag_for_harbor_tasks_only() {
        let with = |format: &str, repository: &str| -> Vec<String> {
            let mut spec = minimal();
            spec.dataset =
                serde_json::from_value(serde_json::json!({"path": "tasks", "format": format}))
                    .unwrap();
            spec.sandbox.builds =
                serde_json::from_value(serde_json::json!({"repository": repository})).unwrap();
            spec.validate().into_iter().map(|v| v.to_string()).collect()
        };
        assert!(with("HarborTasks", "registry.internal:5000/team/envs").is_empty());
        assert!(with("HarborTasks", "localhost/envs").is_empty());
        for bad in [
            "envs",
            "team/envs",
            "registry.io/envs:1",
            "registry.io/envs@sha256:ab",
            "",
        ] {
            assert_eq!(
                with("HarborTasks", bad),
                [format!(
                    "spec.sandbox.builds.repository: {bad:?} must name a registry host and a \
                     repository, without a tag or digest (registry.example.com/team/envs)"
                )],
                "{bad}"
            );
        }
        assert_eq!(
            with("Jsonl", "registry.internal/envs"),
            [
                "spec.sandbox.builds: builds the images of Harbor tasks: it needs dataset.format \
              HarborTasks"
            ]
        );
    }

    #[test]
    fn batch_mode_and_service_tiers_are_checked_field_by_field() {
        let with = |model: serde_json::Value| -> Vec<String> {
            let mut spec = minimal();
            spec.model = serde_json::from_value(model).unwrap();
            spec.validate().into_iter().map(|v| v.to_string()).collect()
        };
        let base = "http://127.0.0.1:1/v1";
        assert!(
            with(
                serde_json::json!({"name": "m", "baseUrl": base, "batch": {},
                                    "serviceTier": {"tier": "Flex", "fallbackAfterSeconds": 60}})
            )
            .is_empty()
        );
        assert_eq!(
            with(serde_json::json!({"name": "m", "baseUrl": base,
                "batch": {"maxRequests": 0, "maxMegabytes": 201, "pollSeconds": 0, "baseUrl": "batches",
                          "liveTailPercent": 101},
                "tokens": {"request": "LogprobsOnly"},
                "serviceTier": {"tier": "Flex"}, "extraBody": {"service_tier": "auto"}})),
            [
                "spec.model.extraBody.service_tier: is set by model.serviceTier: give the tier there only",
                "spec.model.batch.maxRequests: must be 1 to 50000 (OpenAI's limit), got 0",
                "spec.model.batch.maxMegabytes: must be 1 to 200 (OpenAI's limit), got 201",
                "spec.model.batch.liveTailPercent: must be 0 to 100, got 101",
                "spec.model.batch.pollSeconds: must be at least 1, got 0",
                "spec.model.batch.baseUrl: must be an http(s) URL, got \"batches\"",
                "spec.model.batch: cannot be used with model.tokens yet: keep token ids with live calls",
            ]
        );
        // Anthropic's limits are its own.
        let anthropic = |max_requests: u32, max_megabytes: u32| {
            with(serde_json::json!({"name": "m", "baseUrl": base,
                "batch": {"provider": "Anthropic", "maxRequests": max_requests,
                          "maxMegabytes": max_megabytes}}))
        };
        assert!(anthropic(100_000, 256).is_empty());
        assert_eq!(
            anthropic(100_001, 257),
            [
                "spec.model.batch.maxRequests: must be 1 to 100000 (Anthropic's limit), got 100001",
                "spec.model.batch.maxMegabytes: must be 1 to 256 (Anthropic's limit), got 257",
            ]
        );
    }

    #[test]
    fn endpoints_replace_the_base_url_and_each_is_checked() {
        let with = |model: serde_json::Value| -> Vec<String> {
            let mut spec = minimal();
            spec.model = serde_json::from_value(model).unwrap();
            spec.validate().into_iter().map(|v| v.to_string()).collect()
        };
        let three = serde_json::json!([
            {"baseUrl": "http://m0:8000/v1"}, {"baseUrl": "http://m1:8000/v1"},
            {"baseUrl": "http://m2:8000/v1/"},
        ]);
        assert!(with(serde_json::json!({"name": "m", "endpoints": three})).is_empty());
        assert_eq!(
            with(serde_json::json!({"name": "m"})),
            ["spec.model.baseUrl: \"\" must be an http:// or https:// URL"]
        );
        assert_eq!(
            with(
                serde_json::json!({"name": "m", "baseUrl": "http://m0:8000/v1", "endpoints": three})
            ),
            [
                "spec.model.baseUrl: set either baseUrl (one endpoint) or endpoints (several), not both"
            ]
        );
        let errors = with(serde_json::json!({"name": "m", "endpoints": [
            {"baseUrl": "http://m0:8000/v1"}, {"baseUrl": "m1:8000"}, {"baseUrl": "http://m0:8000/v1/"},
        ], "routing": {"loadBound": 0.5, "sessionHeader": "x session"}}));
        assert_eq!(
            errors,
            [
                "spec.model.endpoints[1].baseUrl: \"m1:8000\" must be an http:// or https:// URL",
                "spec.model.endpoints[2].baseUrl: the same endpoint as model.endpoints[0]",
                "spec.model.routing.loadBound: must be at least 1, got 0.5",
                "spec.model.routing.sessionHeader: \"x session\" is not an HTTP header name \
                 (letters, digits and !#$%&'*+-.^_`|~)",
            ]
        );
    }

    #[test]
    fn a_limit_of_zero_and_a_limiter_without_address_or_key_are_refused_by_name() {
        let mut spec = minimal();
        spec.model.limits = Some(crate::spec::LimitsSpec {
            requests_per_minute: Some(600),
            output_tokens_per_minute: Some(0),
            gubernator: Some(crate::spec::GubernatorSpec {
                url: "gubernator:1050".into(),
                key: " ".into(),
            }),
            ..crate::spec::LimitsSpec::default()
        });
        let errors: Vec<String> = spec.validate().into_iter().map(|v| v.to_string()).collect();
        assert_eq!(
            errors,
            [
                "spec.model.limits.outputTokensPerMinute: must be at least 1 (unset: no limit)",
                "spec.model.limits.gubernator.url: \"gubernator:1050\" must be an http:// or \
                 https:// URL",
                "spec.model.limits.gubernator.key: must name the key the counts are kept under",
            ]
        );
    }

    #[test]
    fn tool_dirs_must_be_absolute_or_under_home_and_not_the_whole_of_either() {
        let mut spec = minimal();
        spec.sandbox.tool_dirs = [
            "~/.pyenv/versions/3.12.7",
            "/opt/conda/envs/x",
            "relative/bin",
            "~",
            "~/",
            "/",
            "~/./",
            "/a:/b",
        ]
        .map(str::to_owned)
        .to_vec();
        let errors: Vec<String> = spec.validate().into_iter().map(|v| v.to_string()).collect();
        assert_eq!(
            errors,
            [
                "spec.sandbox.toolDirs[2]: \"relative/bin\" must be an absolute path or start with ~/",
                "spec.sandbox.toolDirs[3]: \"~\" must be an absolute path or start with ~/",
                "spec.sandbox.toolDirs[4]: \"~/\" would open the whole home directory to the \
                 model's commands: name the toolchain's own directory",
                "spec.sandbox.toolDirs[5]: \"/\" would open the whole filesystem to the model's \
                 commands: name the toolchain's own directory",
                "spec.sandbox.toolDirs[6]: \"~/./\" would open the whole home directory to the \
                 model's commands: name the toolchain's own directory",
                "spec.sandbox.toolDirs[7]: \"/a:/b\" holds a ':', which a PATH cannot carry",
            ]
        );
    }

    #[test]
    fn a_minimal_spec_is_valid() {
        assert!(minimal().validate().is_empty());
    }

    #[test]
    fn violations_name_their_field() {
        let mut spec = minimal();
        spec.dataset.path = "../etc/passwd".into();
        spec.batch_size = 0;
        spec.model.base_url = "ftp://x".into();
        spec.model.pricing = Some(crate::spec::PricingSpec {
            input: Some(1.0),
            output: Some(f64::NAN),
            ..crate::spec::PricingSpec::default()
        });
        spec.distribution = DistributionSpec::Inline([("terminal".to_owned(), 120.0)].into());
        let fields: Vec<_> = spec.validate().into_iter().map(|v| v.field).collect();
        assert_eq!(
            fields,
            [
                "spec.dataset.path",
                "spec.batchSize",
                "spec.model.baseUrl",
                "spec.model.pricing.output",
                "spec.distribution.terminal"
            ]
        );
    }

    #[test]
    fn a_bucket_is_refused_with_a_volume_and_its_url_and_endpoint_are_checked() {
        let mut spec = minimal();
        spec.storage.object = Some(crate::spec::ObjectStorageSpec {
            url: "s3://trajectories/runs".into(),
            endpoint: Some("http://minio.storage:9000".into()),
            ..crate::spec::ObjectStorageSpec::default()
        });
        assert!(spec.validate().is_empty(), "{:?}", spec.validate());
        spec.storage.volume = Some(serde_json::json!({"emptyDir": {}}));
        spec.storage.object = Some(crate::spec::ObjectStorageSpec {
            url: "s3://Not_A_Bucket/../x".into(),
            endpoint: Some("minio:9000".into()),
            ..crate::spec::ObjectStorageSpec::default()
        });
        let violations: Vec<String> = spec.validate().iter().map(ToString::to_string).collect();
        assert_eq!(violations.len(), 3, "{violations:?}");
        assert!(violations[0].starts_with("spec.storage.object: is refused together with"));
        assert!(
            violations[1].starts_with("spec.storage.object.url: "),
            "{violations:?}"
        );
        assert!(violations[1].contains("\"Not_A_Bucket\" is not a bucket name"));
        assert!(violations[2].starts_with("spec.storage.object.endpoint: "));
    }

    #[test]
    fn verifier_paths_timeout_and_reward_bounds_are_checked() {
        let mut spec = minimal();
        spec.verifier = Some(crate::spec::VerifierSpec::default());
        spec.filters.min_reward = Some(0.5);
        assert!(spec.validate().is_empty(), "{:?}", spec.validate());
        spec.verifier = Some(crate::spec::VerifierSpec {
            timeout_seconds: 0,
            tests_dir: "tests".into(),
            reward_file: "/reward.txt".into(),
            passing_reward: f64::NAN,
            passes_per_prompt: Some(2),
            ..crate::spec::VerifierSpec::default()
        });
        spec.filters.min_reward = Some(f64::INFINITY);
        let fields: Vec<_> = spec.validate().into_iter().map(|v| v.field).collect();
        assert_eq!(
            fields,
            [
                "spec.filters.minReward",
                "spec.verifier.timeoutSeconds",
                "spec.verifier.passesPerPrompt",
                "spec.verifier.passingReward",
                "spec.verifier.testsDir",
                "spec.verifier.rewardFile"
            ]
        );
        spec.verifier.as_mut().unwrap().reward_file = "/logs/../etc/reward".into();
        assert!(
            spec.validate()
                .iter()
                .any(|v| v.field == "spec.verifier.rewardFile" && v.message.contains("..")),
            "{:?}",
            spec.validate()
        );
    }

    #[test]
    fn a_browser_distribution_needs_the_browser_section_and_its_bounds_hold() {
        let mut spec = minimal();
        spec.distribution = DistributionSpec::Named("browser_only".into());
        let fields: Vec<_> = spec.validate().into_iter().map(|v| v.field).collect();
        assert_eq!(fields, ["spec.tools.browser"]);
        spec.tools.browser = Some(BrowserSpec::default());
        assert!(spec.validate().is_empty());
        spec.tools.browser = Some(BrowserSpec {
            chromium_path: "chromium".into(),
            snapshot_max_chars: 10,
            allowed_schemes: vec!["https:".into()],
            ..BrowserSpec::default()
        });
        let fields: Vec<_> = spec.validate().into_iter().map(|v| v.field).collect();
        assert_eq!(
            fields,
            [
                "spec.tools.browser.chromiumPath",
                "spec.tools.browser.snapshotMaxChars",
                "spec.tools.browser.allowedSchemes"
            ]
        );
    }

    #[test]
    fn vision_and_image_endpoints_are_checked() {
        let mut spec = minimal();
        spec.distribution = DistributionSpec::Named("creative".into());
        spec.tools = serde_json::from_value(serde_json::json!({
            "web": {"search": {"url": "http://searxng:8080"}},
            "vision": {"baseUrl": "http://vllm-vl:8000/v1", "model": "vl",
                       "apiKey": {"secretKeyRef": {"name": "vl-key", "key": "token"}}},
            "imageGen": {"baseUrl": "http://images:8000/v1", "model": "img",
                         "apiKey": {"env": "IMAGES_KEY"}},
        }))
        .unwrap();
        assert_eq!(spec.validate(), []);

        let vision = spec.tools.vision.as_mut().unwrap();
        vision.base_url = "vllm-vl:8000".into();
        vision.api_key = Some(ValueSource {
            env: Some("A".into()),
            secret_key_ref: Some(SecretKeyRef {
                name: "n".into(),
                key: "k".into(),
            }),
        });
        vision.max_image_bytes = 10;
        let image_gen = spec.tools.image_gen.as_mut().unwrap();
        image_gen.model = String::new();
        image_gen.sizes.square = String::new();
        image_gen.extra_body = Some(serde_json::json!([1]));
        let fields: Vec<_> = spec.validate().into_iter().map(|v| v.field).collect();
        assert_eq!(
            fields,
            [
                "spec.tools.vision.baseUrl",
                "spec.tools.vision.apiKey",
                "spec.tools.vision.maxImageBytes",
                "spec.tools.imageGen.model",
                "spec.tools.imageGen.sizes.square",
                "spec.tools.imageGen.extraBody",
            ]
        );
    }

    #[test]
    fn clean_paths() {
        assert!(is_relative_clean_path("a/b.jsonl"));
        assert!(!is_relative_clean_path("/a"));
        assert!(!is_relative_clean_path("a/../b"));
        assert!(!is_relative_clean_path("a//b"));
        assert!(!is_relative_clean_path(""));
    }
}
