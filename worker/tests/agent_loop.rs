//! The agent loop against the scripted server, with small test tools: tolerant argument parsing,
//! reasoning round trips, tool errors, concurrency, turn limits and budgets.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Map, Value, json};
use trajectory_testkit::scripted_server::{
    ReasoningField, ScriptedServer, Step, text_reply, tool_call_reply, tool_calls_reply,
    with_reasoning,
};
use trajectory_worker::agent::{
    AgentConfig, Conversation, ConversationError, FINAL_ANSWER_REQUEST, run_conversation,
};
use trajectory_worker::model::{Message, ModelClient};
use trajectory_worker::tools::sandbox::{LandlockMode, Sandbox};
use trajectory_worker::tools::{
    Tool, ToolContext, ToolFuture, ToolLimits, ToolOutcome, ToolSpec, Workspace,
};

// ---- Test tools ----------------------------------------------------------------------------------

fn spec(name: &str) -> ToolSpec {
    ToolSpec {
        name: name.to_owned(),
        description: format!("test tool {name}"),
        parameters: json!({"type": "object", "properties": {}}),
    }
}

/// Returns its arguments and remembers every call.
#[derive(Debug)]
struct Echo {
    spec: ToolSpec,
    calls: Mutex<Vec<Map<String, Value>>>,
}

impl Echo {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            spec: spec("echo"),
            calls: Mutex::new(Vec::new()),
        })
    }

    fn calls(&self) -> Vec<Map<String, Value>> {
        self.calls.lock().unwrap().clone()
    }
}

impl Tool for Echo {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }

    fn call<'a>(&'a self, args: Map<String, Value>, _ctx: &'a ToolContext) -> ToolFuture<'a> {
        self.calls.lock().unwrap().push(args.clone());
        Box::pin(async move { ToolOutcome::Ok(json!({"echo": args})) })
    }
}

/// Sleeps `ms` milliseconds, then answers with its `tag`.
#[derive(Debug)]
struct Sleep {
    spec: ToolSpec,
}

impl Tool for Sleep {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }

    fn call<'a>(&'a self, args: Map<String, Value>, _ctx: &'a ToolContext) -> ToolFuture<'a> {
        Box::pin(async move {
            tokio::time::sleep(Duration::from_millis(args["ms"].as_u64().unwrap_or(0))).await;
            ToolOutcome::Ok(json!({"tag": args["tag"]}))
        })
    }
}

/// Never finishes; records that its future was dropped (cancelled).
#[derive(Debug)]
struct Forever {
    spec: ToolSpec,
    cancelled: Arc<AtomicBool>,
}

struct SetOnDrop(Arc<AtomicBool>);

impl Drop for SetOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

impl Tool for Forever {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }

    fn call<'a>(&'a self, _args: Map<String, Value>, _ctx: &'a ToolContext) -> ToolFuture<'a> {
        let guard = SetOnDrop(Arc::clone(&self.cancelled));
        Box::pin(async move {
            let _guard = guard;
            std::future::pending::<ToolOutcome>().await
        })
    }
}

// ---- Fixture -------------------------------------------------------------------------------------

/// A client of a scripted server, a workspace, and the loop settings; `.with_…` adjusts them.
struct Fixture {
    server: ScriptedServer,
    client: ModelClient,
    ctx: ToolContext,
    config: AgentConfig,
    _dir: tempfile::TempDir,
}

impl Fixture {
    async fn new(steps: impl IntoIterator<Item = Step>) -> Self {
        let server = ScriptedServer::start(steps).await;
        let client = ModelClient::new(server.settings()).unwrap();
        let dir = tempfile::tempdir().unwrap();
        trajectory_testkit::executor::built();
        let ctx = ToolContext {
            workspace: Workspace::new(dir.path()).unwrap(),
            limits: ToolLimits::default(),
            sandbox: Sandbox::local(LandlockMode::Auto),
            browser: trajectory_worker::tools::browser::ConversationBrowser::default(),
            terminal: trajectory_worker::tools::terminal::Terminal::default(),
        };
        let config = AgentConfig {
            max_turns: 5,
            prompt_timeout: Duration::from_secs(20),
            ephemeral_system_prompt: None,
        };
        Self {
            server,
            client,
            ctx,
            config,
            _dir: dir,
        }
    }

    fn with_max_turns(mut self, max_turns: u32) -> Self {
        self.config.max_turns = max_turns;
        self
    }

    fn with_prompt_timeout(mut self, budget: Duration) -> Self {
        self.config.prompt_timeout = budget;
        self
    }

    async fn run(&self, tools: &[Arc<dyn Tool>]) -> Result<Conversation, ConversationError> {
        run_conversation(
            &self.client,
            tools,
            &self.ctx,
            "Do the thing.",
            &self.config,
        )
        .await
    }

    /// The messages of the `index`-th request the server received.
    fn sent_messages(&self, index: usize) -> Vec<Value> {
        self.server.requests()[index].body["messages"]
            .as_array()
            .unwrap()
            .clone()
    }
}

fn tool_messages(conversation: &Conversation) -> Vec<(String, String)> {
    conversation
        .messages
        .iter()
        .filter_map(|message| match message {
            Message::Tool(tool) => Some((tool.name.clone(), tool.content.clone())),
            _ => None,
        })
        .collect()
}

// ---- Tests ---------------------------------------------------------------------------------------

#[tokio::test]
async fn arguments_in_every_tolerated_shape_reach_the_tool_parsed() {
    let expected = json!({"text": "hi \"there\""});
    let cases = [
        ("an object", expected.clone(), expected.clone()),
        ("an empty string", json!(""), json!({})),
        (
            "a JSON string",
            json!(expected.to_string()),
            expected.clone(),
        ),
        (
            "double-encoded",
            json!(json!(expected.to_string()).to_string()),
            expected.clone(),
        ),
        (
            "HTML-escaped",
            json!(r"{&quot;text&quot;: &quot;hi \&quot;there\&quot;&quot;}"),
            expected.clone(),
        ),
    ];
    for (shape, arguments, parsed) in cases {
        let fixture = Fixture::new([
            Step::ok(tool_calls_reply(&[("echo", arguments)])),
            Step::ok(text_reply("done")),
        ])
        .await;
        let echo = Echo::new();
        let conversation = fixture
            .run(&[Arc::clone(&echo) as Arc<dyn Tool>])
            .await
            .unwrap();
        assert_eq!(
            echo.calls(),
            vec![parsed.as_object().unwrap().clone()],
            "arguments as {shape}"
        );
        assert!(conversation.completed, "{shape}");
        assert_eq!(conversation.api_calls, 2);
    }
}

#[tokio::test]
async fn reasoning_in_every_shape_is_sent_back_in_that_shape() {
    let cases = [
        (
            ReasoningField::Reasoning,
            "reasoning",
            json!("weighing options"),
        ),
        (
            ReasoningField::ReasoningContent,
            "reasoning_content",
            json!("weighing options"),
        ),
        (
            ReasoningField::ReasoningDetails,
            "reasoning_details",
            json!([{"type": "reasoning.text", "text": "weighing options", "signature": "sig-scripted", "index": 0}]),
        ),
    ];
    for (field, key, sent_back) in cases {
        let first = with_reasoning(
            tool_call_reply("echo", &json!({})),
            field,
            "weighing options",
        );
        let fixture = Fixture::new([Step::ok(first), Step::ok(text_reply("done"))]).await;
        let conversation = fixture.run(&[Echo::new()]).await.unwrap();
        let Message::Assistant(reply) = &conversation.messages[1] else {
            panic!("{:?}", conversation.messages)
        };
        assert_eq!(
            reply.reasoning.as_ref().unwrap().text,
            "weighing options",
            "{key}"
        );
        let assistant = &fixture.sent_messages(1)[1];
        assert_eq!(assistant["role"], "assistant");
        assert_eq!(assistant[key], sent_back, "{key}");
        for other in ["reasoning", "reasoning_content", "reasoning_details"]
            .into_iter()
            .filter(|other| *other != key)
        {
            assert_eq!(
                assistant.get(other),
                None,
                "{key} must not also be sent as {other}"
            );
        }
    }

    let first = with_reasoning(
        tool_calls_reply(&[("echo", json!("{}"))]),
        ReasoningField::InlineThink,
        "weighing options",
    );
    let fixture = Fixture::new([Step::ok(first), Step::ok(text_reply("done"))]).await;
    fixture.run(&[Echo::new()]).await.unwrap();
    let assistant = &fixture.sent_messages(1)[1];
    assert_eq!(assistant["content"], "<think>weighing options</think>");
    assert_eq!(assistant.get("reasoning"), None);
}

#[tokio::test]
async fn unknown_tool_goes_back_to_the_model_as_a_tool_error_and_the_loop_continues() {
    let fixture = Fixture::new([
        Step::ok(tool_call_reply("no_such_tool", &json!({}))),
        Step::ok(text_reply("sorry")),
    ])
    .await;
    let conversation = fixture.run(&[Echo::new()]).await.unwrap();
    assert!(conversation.completed);
    let tool = &fixture.sent_messages(1)[2];
    assert_eq!(tool["role"], "tool");
    let content: Value = serde_json::from_str(tool["content"].as_str().unwrap()).unwrap();
    let error = content["error"].as_str().unwrap();
    assert!(
        error.contains("unknown tool") && error.contains("no_such_tool") && error.contains("echo"),
        "{error}"
    );
}

#[tokio::test]
async fn invalid_arguments_go_back_to_the_model_as_a_tool_error_and_the_tool_is_not_run() {
    let fixture = Fixture::new([
        Step::ok(tool_calls_reply(&[("echo", json!("{\"text\": oops"))])),
        Step::ok(text_reply("ok")),
    ])
    .await;
    let echo = Echo::new();
    let conversation = fixture
        .run(&[Arc::clone(&echo) as Arc<dyn Tool>])
        .await
        .unwrap();
    assert!(conversation.completed);
    assert!(echo.calls().is_empty());
    let tool = &fixture.sent_messages(1)[2];
    let content: Value = serde_json::from_str(tool["content"].as_str().unwrap()).unwrap();
    assert!(
        content["error"]
            .as_str()
            .unwrap()
            .contains("invalid arguments for echo"),
        "{content}"
    );
    // The malformed arguments go back verbatim, so the model sees what it sent.
    assert_eq!(
        fixture.sent_messages(1)[1]["tool_calls"][0]["function"]["arguments"],
        "{\"text\": oops"
    );
}

#[tokio::test]
async fn tool_calls_of_one_turn_run_concurrently_and_results_keep_call_order() {
    let calls = [
        ("sleep", json!(r#"{"ms": 300, "tag": "first"}"#)),
        ("sleep", json!(r#"{"ms": 250, "tag": "second"}"#)),
    ];
    let fixture = Fixture::new([
        Step::ok(tool_calls_reply(&calls)),
        Step::ok(text_reply("done")),
    ])
    .await;
    let sleep: Arc<dyn Tool> = Arc::new(Sleep {
        spec: spec("sleep"),
    });
    let started = Instant::now();
    let conversation = fixture.run(&[sleep]).await.unwrap();
    assert!(
        started.elapsed() < Duration::from_millis(550),
        "took {:?}",
        started.elapsed()
    );
    let tags: Vec<String> = tool_messages(&conversation)
        .into_iter()
        .map(|(_, content)| content)
        .collect();
    assert_eq!(tags, [r#"{"tag":"first"}"#, r#"{"tag":"second"}"#]);
    let sent = fixture.sent_messages(1);
    let ids: Vec<&Value> = sent[1]["tool_calls"]
        .as_array()
        .unwrap()
        .iter()
        .map(|call| &call["id"])
        .collect();
    assert_eq!(ids, [&sent[2]["tool_call_id"], &sent[3]["tool_call_id"]]);
}

#[tokio::test]
async fn reaching_max_turns_makes_one_final_call_without_tools() {
    let call = || Step::ok(tool_call_reply("echo", &json!({"text": "again"})));
    let fixture = Fixture::new([call(), call(), Step::ok(text_reply("final answer"))])
        .await
        .with_max_turns(2);
    let echo = Echo::new();
    let conversation = fixture
        .run(&[Arc::clone(&echo) as Arc<dyn Tool>])
        .await
        .unwrap();
    assert!(!conversation.completed);
    assert!(!conversation.partial);
    assert_eq!(conversation.api_calls, 2);
    assert_eq!(echo.calls().len(), 2);
    let requests = fixture.server.requests();
    assert_eq!(requests.len(), 3);
    assert!(requests[0].body.get("tools").is_some() && requests[1].body.get("tools").is_some());
    let last = &requests[2].body;
    assert_eq!(last.get("tools"), None);
    assert_eq!(last.get("tool_choice"), None);
    let messages = last["messages"].as_array().unwrap();
    assert_eq!(
        messages.last().unwrap(),
        &json!({"role": "user", "content": FINAL_ANSWER_REQUEST})
    );
    let Some(Message::Assistant(reply)) = conversation.messages.last() else {
        panic!()
    };
    assert_eq!(reply.content, "final answer");
}

#[tokio::test]
async fn a_reply_cut_off_by_the_token_limit_marks_the_conversation_partial() {
    let mut cut = text_reply("The answer is");
    cut["choices"][0]["finish_reason"] = "length".into();
    let fixture = Fixture::new([Step::ok(cut)]).await;
    let conversation = fixture.run(&[Echo::new()]).await.unwrap();
    assert!(conversation.partial);
    assert!(!conversation.completed);
    assert_eq!(conversation.api_calls, 1);
    assert_eq!(fixture.server.request_count(), 1);
}

#[tokio::test]
async fn the_prompt_budget_ends_a_conversation_waiting_on_the_model() {
    let fixture = Fixture::new([Step::Hang])
        .await
        .with_prompt_timeout(Duration::from_millis(300));
    let started = Instant::now();
    let error = fixture.run(&[Echo::new()]).await.unwrap_err();
    assert!(
        matches!(error, ConversationError::Timeout(budget, _) if budget == Duration::from_millis(300)),
        "{error:?}"
    );
    assert_eq!(
        error.spent().usage.prompt_tokens,
        0,
        "no reply: nothing spent"
    );
    assert_eq!(error.class(), "prompt_timeout");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "took {:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn a_tool_call_that_never_ends_is_cancelled_by_the_budget() {
    let fixture = Fixture::new([Step::ok(tool_call_reply("forever", &json!({})))])
        .await
        .with_prompt_timeout(Duration::from_millis(300));
    let cancelled = Arc::new(AtomicBool::new(false));
    let forever: Arc<dyn Tool> = Arc::new(Forever {
        spec: spec("forever"),
        cancelled: Arc::clone(&cancelled),
    });
    let started = Instant::now();
    let error = fixture.run(&[forever]).await.unwrap_err();
    assert!(matches!(error, ConversationError::Timeout(..)), "{error:?}");
    // The reply that asked for the tool was paid for: the cut-off conversation keeps its usage.
    assert_eq!(
        (
            error.spent().usage.prompt_tokens,
            error.spent().usage.completion_tokens
        ),
        (10, 5),
        "{error:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(2));
    assert!(
        cancelled.load(Ordering::SeqCst),
        "the tool's future must be dropped"
    );
}

#[tokio::test]
async fn a_permanent_model_error_fails_the_conversation_as_permanent() {
    let fixture = Fixture::new([Step::error(401, "invalid_api_key", "bad key")]).await;
    let error = fixture.run(&[Echo::new()]).await.unwrap_err();
    assert!(error.is_permanent());
    assert_eq!(error.class(), "unauthorized");
}

#[tokio::test]
async fn the_tool_result_follows_its_call_and_usage_is_summed() {
    let fixture = Fixture::new([
        Step::ok(tool_call_reply("echo", &json!({"text": "x"}))),
        Step::ok(text_reply("done")),
    ])
    .await;
    let conversation = fixture.run(&[Echo::new()]).await.unwrap();
    let sent = fixture.sent_messages(1);
    let roles: Vec<&str> = sent
        .iter()
        .map(|message| message["role"].as_str().unwrap())
        .collect();
    assert_eq!(roles, ["user", "assistant", "tool"]);
    assert_eq!(
        tool_messages(&conversation),
        [("echo".to_owned(), r#"{"echo":{"text":"x"}}"#.to_owned())]
    );
    assert_eq!(conversation.usage.prompt_tokens, 20);
    assert_eq!(conversation.usage.completion_tokens, 10);
}
