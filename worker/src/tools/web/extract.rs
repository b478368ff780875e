//! `web_extract`: fetches each page with time, size and redirect limits, takes the main text of
//! an HTML page by Readability and writes it as Markdown, passes plain text through, refuses PDF
//! and binary bodies, and cuts what is left to the reference's character budget.

use std::fmt::Write as _;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use reqwest::header::CONTENT_TYPE;
use serde_json::{Map, Value, json};
use url::Url;

use super::super::{Tool, ToolContext, ToolFuture, ToolOutcome, ToolSpec};
use super::guard;
use super::{WebError, error_chain, read_capped, reference_json};
use crate::spec::WebExtractSpec;

/// URLs read per call, as the reference's handler does (`urls[:5]`).
const MAX_URLS: usize = 5;

/// Elements Readability scores at most: a bound on its CPU time for a hostile page (a real
/// article has a few thousand).
const MAX_ELEMENTS: usize = 100_000;

/// The reference's description, word for word (the model of a mixed training set must see one
/// tool). Two of its promises differ here and `docs/tools/web.md` says so: a PDF is refused with a
/// tool error, and a page over the budget is cut rather than summarised by a second model.
const DESCRIPTION: &str = "Extract content from web page URLs. Returns page content in markdown format. Also works with PDF URLs (arxiv papers, documents, etc.) — pass the PDF link directly and it converts to markdown text. Pages under 5000 chars return full markdown; larger pages are LLM-summarized and capped at ~5000 chars per page. Pages over 2M chars are refused. If a URL fails or times out, use the browser tool to access it instead.";

/// Inline base64 images, which the reference removes from every extraction.
static BASE64_IMAGE: LazyLock<regex::Regex> = LazyLock::new(|| {
    // A constant pattern: it compiles.
    regex::Regex::new(r"\(?data:image/[^;]+;base64,[A-Za-z0-9+/=]+\)?").expect("valid pattern")
});

#[derive(Debug)]
pub(super) struct WebExtract {
    spec: ToolSpec,
    limits: Arc<WebExtractSpec>,
    client: reqwest::Client,
}

/// One extracted page.
#[derive(Debug)]
struct Page {
    url: String,
    title: String,
    content: String,
}

impl WebExtract {
    pub(super) fn new(limits: &WebExtractSpec) -> Result<Self, WebError> {
        let builder = guard::guarded_client(
            limits.max_redirects,
            limits.allow_private_addresses,
            Duration::from_secs(limits.timeout_seconds),
        );
        Ok(Self {
            spec: ToolSpec {
                name: "web_extract".to_owned(),
                description: DESCRIPTION.to_owned(),
                parameters: json!({
                    "type": "object",
                    "properties": {
                        "urls": {
                            "type": "array",
                            "items": {"type": "string"},
                            "description": "List of URLs to extract content from (max 5 URLs per call)",
                            "maxItems": 5
                        }
                    },
                    "required": ["urls"]
                }),
            },
            limits: Arc::new(limits.clone()),
            client: builder.build().map_err(WebError::Client)?,
        })
    }

    async fn page(&self, raw: &str) -> Result<Page, String> {
        let url = Url::parse(raw.trim()).map_err(|err| format!("not a URL ({err})"))?;
        if let Some(refusal) = guard::refusal(&url, self.limits.allow_private_addresses) {
            return Err(refusal);
        }
        let mut response = self
            .client
            .get(url)
            .header(
                reqwest::header::ACCEPT,
                "text/html,application/xhtml+xml,text/plain;q=0.9,*/*;q=0.5",
            )
            .send()
            .await
            .map_err(|err| error_chain(&err))?;
        let status = response.status();
        if !status.is_success() {
            return Err(format!("HTTP {status}"));
        }
        let final_url = response.url().to_string();
        let content_type = response
            .headers()
            .get(CONTENT_TYPE)
            .and_then(|value| value.to_str().ok())
            .unwrap_or("")
            .to_ascii_lowercase();
        let limit = usize::try_from(self.limits.max_page_bytes).unwrap_or(usize::MAX);
        let (body, cut) = read_capped(&mut response, limit)
            .await
            .map_err(|err| error_chain(&err))?;
        let kind = Kind::of(&content_type, &body)?;
        let text = decode(&body, &content_type);
        let max_chars = usize::try_from(self.limits.max_chars).unwrap_or(usize::MAX);
        let (title, content) = match kind {
            Kind::Html => {
                let base = final_url.clone();
                // Parsing is CPU work of up to a few hundred milliseconds for a big page: off the
                // async threads.
                tokio::task::spawn_blocking(move || readable(&text, &base))
                    .await
                    .map_err(|err| format!("the extraction failed internally: {err}"))??
            }
            Kind::Text => (String::new(), text),
        };
        let mut content = BASE64_IMAGE
            .replace_all(&content, "[BASE64_IMAGE_REMOVED]")
            .into_owned();
        if cut {
            let _ = write!(
                content,
                "\n\n[... page cut at {} bytes ...]",
                self.limits.max_page_bytes
            );
        }
        Ok(Page {
            url: final_url,
            title,
            content: cap(content, max_chars),
        })
    }

    async fn extract(&self, urls: Vec<String>) -> ToolOutcome {
        let pages = futures::future::join_all(urls.iter().map(|url| self.page(url))).await;
        if pages.iter().all(Result::is_err) {
            let reasons: Vec<String> = urls
                .iter()
                .zip(&pages)
                .filter_map(|(url, page)| page.as_ref().err().map(|err| format!("{url}: {err}")))
                .collect();
            return ToolOutcome::Err(format!("Error extracting content: {}", reasons.join("; ")));
        }
        let results: Vec<Value> = urls
            .iter()
            .zip(pages)
            .map(|(url, page)| match page {
                Ok(page) => json!({
                    "url": page.url, "title": page.title, "content": page.content, "error": null,
                }),
                Err(error) => json!({"url": url, "title": "", "content": "", "error": error}),
            })
            .collect();
        ToolOutcome::Ok(Value::String(reference_json(
            &json!({ "results": results }),
        )))
    }
}

impl Tool for WebExtract {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }

    fn read_only(&self) -> bool {
        true
    }

    fn call<'a>(&'a self, args: Map<String, Value>, _ctx: &'a ToolContext) -> ToolFuture<'a> {
        Box::pin(async move {
            match urls_arg(&args) {
                Ok(urls) => self.extract(urls).await,
                Err(message) => ToolOutcome::Err(message),
            }
        })
    }
}

/// The `urls` argument: a list of strings (a lone string is taken as a list of one, as small
/// models often send it), the first five kept as the reference keeps them.
fn urls_arg(args: &Map<String, Value>) -> Result<Vec<String>, String> {
    let urls: Vec<String> = match args.get("urls") {
        None => return Err("missing required argument `urls`".to_owned()),
        Some(Value::String(url)) => vec![url.clone()],
        Some(Value::Array(items)) => items
            .iter()
            .map(|item| match item {
                Value::String(url) => Ok(url.clone()),
                other => Err(format!("argument `urls` must hold strings, got {other}")),
            })
            .collect::<Result<_, _>>()?,
        Some(other) => {
            return Err(format!(
                "argument `urls` must be a list of URLs, got {other}"
            ));
        }
    };
    if urls.is_empty() {
        return Err("argument `urls` is empty".to_owned());
    }
    Ok(urls.into_iter().take(MAX_URLS).collect())
}

/// What a body is, by its declared type and, when that says nothing useful, by its bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Html,
    Text,
}

impl Kind {
    fn of(content_type: &str, body: &[u8]) -> Result<Self, String> {
        let mime = content_type.split(';').next().unwrap_or("").trim();
        if mime == "application/pdf" || body.starts_with(b"%PDF-") {
            return Err(
                "cannot extract PDF: this build extracts HTML and plain-text pages only".to_owned(),
            );
        }
        match mime {
            "text/html" | "application/xhtml+xml" => return Ok(Self::Html),
            "text/plain" | "text/markdown" | "text/csv" | "application/json" => {
                return Ok(Self::Text);
            }
            _ => {}
        }
        let head = &body[..body.len().min(1024)];
        let head_text = String::from_utf8_lossy(head).to_ascii_lowercase();
        if head_text.contains("<html") || head_text.contains("<!doctype html") {
            return Ok(Self::Html);
        }
        let binary = head.contains(&0)
            || std::str::from_utf8(head).is_err_and(|err| err.error_len().is_some());
        if mime.starts_with("text/") || (!binary && !body.is_empty()) {
            return Ok(Self::Text);
        }
        let shown = if mime.is_empty() {
            "no declared type"
        } else {
            mime
        };
        Err(format!("cannot extract a binary page ({shown})"))
    }
}

/// The body as text, in the charset its `Content-Type` names (UTF-8 when it names none).
fn decode(body: &[u8], content_type: &str) -> String {
    let encoding = content_type
        .split(';')
        .filter_map(|part| part.trim().strip_prefix("charset="))
        .find_map(|label| encoding_rs::Encoding::for_label(label.trim_matches('"').as_bytes()))
        .unwrap_or(encoding_rs::UTF_8);
    encoding.decode(body).0.into_owned()
}

/// The page's title and its main text as Markdown.
fn readable(html: &str, url: &str) -> Result<(String, String), String> {
    let config = dom_smoothie::Config {
        text_mode: dom_smoothie::TextMode::Markdown,
        max_elements_to_parse: MAX_ELEMENTS,
        ..dom_smoothie::Config::default()
    };
    let mut readability = dom_smoothie::Readability::new(html, Some(url), Some(config))
        .map_err(|err| format!("cannot read the page: {err}"))?;
    let article = readability
        .parse()
        .map_err(|err| format!("no readable content found: {err}"))?;
    Ok((article.title, article.text_content.trim().to_owned()))
}

/// `content` cut to `max_chars` characters with a note saying so.
fn cap(content: String, max_chars: usize) -> String {
    let total = content.chars().count();
    match content.char_indices().nth(max_chars) {
        Some((cut, _)) => format!(
            "{}\n\n[... content truncated at {max_chars} of {total} characters for context management ...]",
            &content[..cut]
        ),
        None => content,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pdf_and_binary_bodies_are_refused_and_text_passes() {
        assert!(
            Kind::of("application/pdf", b"%PDF-1.7")
                .unwrap_err()
                .starts_with("cannot extract PDF")
        );
        assert!(
            Kind::of("application/octet-stream", b"%PDF-1.4 ...")
                .unwrap_err()
                .starts_with("cannot extract PDF")
        );
        assert_eq!(
            Kind::of("application/octet-stream", &[0x89, b'P', b'N', b'G', 0, 0]),
            Err("cannot extract a binary page (application/octet-stream)".to_owned())
        );
        assert_eq!(
            Kind::of("text/plain; charset=utf-8", b"hello"),
            Ok(Kind::Text)
        );
        assert_eq!(Kind::of("", b"<!DOCTYPE html><html>"), Ok(Kind::Html));
    }

    #[test]
    fn content_over_the_budget_is_cut_on_a_character_boundary_with_a_note() {
        assert_eq!(cap("short".to_owned(), 10), "short");
        let cut = cap("é".repeat(12), 10);
        assert!(cut.starts_with(&"é".repeat(10)), "{cut}");
        assert!(cut.ends_with("truncated at 10 of 12 characters for context management ...]"));
    }

    #[test]
    fn urls_may_be_a_list_or_one_string_and_only_five_are_read() {
        let args = |value: Value| value.as_object().unwrap().clone();
        assert_eq!(
            urls_arg(&args(json!({"urls": "http://a/"}))).unwrap(),
            ["http://a/"]
        );
        let many: Vec<String> = (0..8).map(|i| format!("http://h/{i}")).collect();
        assert_eq!(urls_arg(&args(json!({ "urls": many }))).unwrap().len(), 5);
        assert!(urls_arg(&args(json!({"urls": []}))).is_err());
        assert!(urls_arg(&args(json!({"urls": [1]}))).is_err());
    }
}
