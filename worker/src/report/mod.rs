//! `report.html`: one self-contained page per run, written by every merge beside
//! `trajectories.jsonl` and on demand by `trajectory-worker report RUN_DIR`.
//!
//! The page holds the run's statistics (with what the verifiers found, when rows were verified),
//! the distributions [`collect`] gathers (turns, tokens and durations per conversation, toolset
//! combinations, discard reasons) and a bounded, stratified sample of records (with their
//! rewards and verifiers' output) for its conversation browser; its script and style are inline and its
//! content security policy lets it load and send nothing. What each part shows: `docs/report.md`.
//!
//! The page's size is bounded whatever the run's: the sample keeps at most
//! [`collect::PER_STRATUM`] records per outcome, long texts are cut to their head and tail, and
//! records are added, taking each outcome in turn, only while the page stays within
//! [`SAMPLE_BYTES`].

mod collect;

use std::path::PathBuf;

use serde_json::{Map, Value, json};

pub use collect::{Collector, Histogram, Outcome, PER_STRATUM, RecordFacts};

use crate::storage::{RunDir, StorageError};

/// Bytes of sampled records the page embeds at most.
pub const SAMPLE_BYTES: usize = 8 << 20;

/// Characters of one message kept whole; a longer one keeps its head and tail.
const MESSAGE_CHARS: usize = 4_000;

const TEMPLATE: &str = include_str!("report.html");

/// Writes the report of `run_dir` from its `statistics` and what `collected` gathered of its
/// records; returns its path.
pub fn write(
    run_dir: &RunDir,
    statistics: &Value,
    collected: Collector,
) -> Result<PathBuf, StorageError> {
    let path = run_dir.report();
    run_dir
        .store()
        .write_atomic(&path, render(statistics, collected).as_bytes())?;
    Ok(path)
}

/// The page.
pub fn render(statistics: &Value, collected: Collector) -> String {
    let histograms = json!({
        "turns": collected.turns,
        "tokens": collected.tokens,
        "duration_ms": collected.duration_ms,
    });
    let combos = serde_json::to_value(&collected.combos).unwrap_or_default();
    let discarded = serde_json::to_value(&collected.discarded).unwrap_or_default();
    let (records, strata) = sample(collected.strata());
    let data = json!({
        "statistics": statistics,
        "histograms": histograms,
        "combos": combos,
        "discarded": discarded,
        "strata": strata,
        "records": records,
    });
    // `<` only occurs inside JSON strings, where `\u003c` means the same: no `</script>` can end
    // the data early.
    let data = data.to_string().replace('<', "\\u003c");
    let title = statistics["run_name"].as_str().unwrap_or("run");
    TEMPLATE
        .replace("{{TITLE}}", &html_escape(title))
        .replace("{{DATA}}", &data)
}

/// The records the browser shows, each outcome in turn (smallest rank first) while they fit in
/// [`SAMPLE_BYTES`], and per outcome how many are shown of how many.
fn sample(strata: Vec<(String, u64, Vec<Vec<u8>>)>) -> (Vec<Value>, Vec<Value>) {
    let mut pending: Vec<(String, u64, std::vec::IntoIter<Vec<u8>>, u64)> = strata
        .into_iter()
        .map(|(stratum, seen, lines)| (stratum, seen, lines.into_iter(), 0))
        .collect();
    let mut records = Vec::new();
    let mut bytes = 0;
    'fill: loop {
        let mut added = false;
        for (stratum, _, lines, shown) in &mut pending {
            let Some(line) = lines.next() else { continue };
            let Some(record) = browser_record(&line, stratum) else {
                continue;
            };
            let size = record.to_string().len();
            if bytes + size > SAMPLE_BYTES {
                break 'fill;
            }
            bytes += size;
            *shown += 1;
            records.push(record);
            added = true;
        }
        if !added {
            break;
        }
    }
    let strata = pending
        .into_iter()
        .map(|(stratum, seen, _, shown)| json!({"stratum": stratum, "records": seen, "shown": shown}))
        .collect();
    (records, strata)
}

/// What the browser needs of one record line: its identity, outcome and counts, and its
/// conversation with long messages cut.
fn browser_record(line: &[u8], stratum: &str) -> Option<Value> {
    let record: Value = serde_json::from_slice(line).ok()?;
    let tools: Map<String, Value> = record["tool_stats"]
        .as_object()
        .map(|stats| {
            stats
                .iter()
                .map(|(name, counts)| {
                    (
                        name.clone(),
                        json!({"count": counts["count"], "failure": counts["failure"]}),
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    let conversation: Vec<Value> = record["conversations"]
        .as_array()
        .map(|turns| {
            turns
                .iter()
                .map(|turn| {
                    json!({
                        "from": turn["from"],
                        "value": cut(turn["value"].as_str().unwrap_or_default()),
                    })
                })
                .collect()
        })
        .unwrap_or_default();
    let usage = &record["usage"];
    let tokens = usage["prompt_tokens"].as_u64().unwrap_or(0)
        + usage["completion_tokens"].as_u64().unwrap_or(0);
    let id = record["id"].as_str().map_or_else(
        || {
            format!(
                "{}-{}",
                record["prompt_index"],
                record["sample"].as_u64().unwrap_or(0)
            )
        },
        str::to_owned,
    );
    Some(json!({
        "id": id,
        "prompt_index": record["prompt_index"],
        "sample": record["sample"].as_u64().unwrap_or(0),
        "outcome": stratum,
        "toolsets": record["toolsets_used"],
        "tools": tools,
        "api_calls": record["api_calls"],
        "tokens": tokens,
        "duration_ms": record["duration_ms"],
        "error": record["error"].as_str().map(cut),
        "conversation": conversation,
        "reward": record.get("reward"),
        "verification": verification(&record["verification"]),
    }))
}

/// A record's `verification` for the browser, its output cut as a message is; `null` when the
/// record was not verified.
fn verification(verification: &Value) -> Value {
    if !verification.is_object() {
        return Value::Null;
    }
    json!({
        "passed": verification["passed"],
        "exit_code": verification["exit_code"],
        "duration_ms": verification["duration_ms"],
        "error": verification["error"],
        "output": verification["output"].as_str().map(cut),
    })
}

/// `text` within [`MESSAGE_CHARS`]: a longer one keeps its first two thirds and its last third
/// around a note of what was left out.
fn cut(text: &str) -> String {
    let chars = text.chars().count();
    if chars <= MESSAGE_CHARS {
        return text.to_owned();
    }
    let head: String = text.chars().take(MESSAGE_CHARS * 2 / 3).collect();
    let tail_chars = MESSAGE_CHARS / 3;
    let tail: String = text.chars().skip(chars - tail_chars).collect();
    let left_out = chars - MESSAGE_CHARS * 2 / 3 - tail_chars;
    format!("{head}\n… [{left_out} characters left out of the report] …\n{tail}")
}

fn html_escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(prompt_index: u64, message: &str) -> Vec<u8> {
        json!({
            "prompt_index": prompt_index,
            "conversations": [
                {"from": "system", "value": "You are a function calling AI model."},
                {"from": "human", "value": "What is in </script><script>alert(1)</script>?"},
                {"from": "gpt", "value": message},
            ],
            "completed": true, "partial": false, "api_calls": 1,
            "toolsets_used": ["terminal"], "tool_stats": {"terminal": {"count": 1, "success": 1, "failure": 0}},
            "id": format!("p{prompt_index}"), "sample": 0,
            "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
            "duration_ms": 1200,
        })
        .to_string()
        .into_bytes()
    }

    fn collected(lines: &[Vec<u8>]) -> Collector {
        let mut collected = Collector::default();
        for line in lines {
            let record: Value = serde_json::from_slice(line).unwrap();
            let facts = RecordFacts {
                prompt_index: record["prompt_index"].as_u64().unwrap(),
                sample: 0,
                outcome: Outcome::of(None, (true, false), None, None),
                api_calls: 1,
                tokens: 15,
                duration_ms: 1200,
                tool_calls: 1,
                tool_failures: 0,
            };
            collected.add(&facts, ["terminal"], line);
        }
        collected
    }

    fn embedded(page: &str) -> Value {
        let start = page
            .find("<script id=\"report-data\" type=\"application/json\">")
            .unwrap();
        let rest = &page[start..];
        let open = rest.find('>').unwrap() + 1;
        let close = rest.find("</script>").unwrap();
        serde_json::from_str(&rest[open..close]).unwrap()
    }

    #[test]
    fn the_page_embeds_the_statistics_and_the_records_and_no_markup_of_theirs() {
        let statistics = json!({"run_name": "a<b", "counts": {"records": 2}});
        let page = render(
            &statistics,
            collected(&[line(0, "fine"), line(1, "also fine")]),
        );
        assert!(page.contains("<title>a&lt;b · trajectory report</title>"));
        // The one `</script>` of the data is escaped: the page's scripts are the template's.
        assert_eq!(
            page.matches("</script>").count(),
            TEMPLATE.matches("</script>").count()
        );
        let data = embedded(&page);
        assert_eq!(data["statistics"], statistics);
        assert_eq!(data["records"].as_array().unwrap().len(), 2);
        assert_eq!(data["histograms"]["duration_ms"]["1000"], 2);
        assert_eq!(
            data["records"][0]["conversation"][1]["value"],
            "What is in </script><script>alert(1)</script>?"
        );
        assert_eq!(data["combos"]["terminal"]["tool_calls"], 2);
    }

    #[test]
    fn long_messages_keep_head_and_tail_and_the_sample_stays_within_its_budget() {
        let long = format!("start{}end", "x".repeat(100_000));
        let cut_message = cut(&long);
        assert!(cut_message.starts_with("start"), "{}", &cut_message[..20]);
        assert!(cut_message.ends_with("end"));
        assert!(cut_message.contains("characters left out of the report"));
        assert!(cut_message.chars().count() < MESSAGE_CHARS + 100);
        // 3,000 records of about 4 KiB each: more than the budget allows.
        let lines: Vec<Vec<u8>> = (0..3_000).map(|index| line(index, &long)).collect();
        let page = render(&json!({}), collected(&lines));
        let data = embedded(&page);
        let shown = data["records"].as_array().unwrap().len();
        assert_eq!(shown, PER_STRATUM, "one stratum: at most its kept records");
        assert!(page.len() < SAMPLE_BYTES + (1 << 20), "{}", page.len());
        assert_eq!(data["strata"][0]["records"], 3_000);
        assert_eq!(data["strata"][0]["shown"], PER_STRATUM);
    }
}
