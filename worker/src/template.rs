//! The template language of declared HTTP tools (`spec.tools.http`): a URL, body or header is
//! text with `{name}` placeholders for the model's arguments. [`crate::validate`] checks that a
//! spec's templates name declared arguments; the engine's HTTP tools ([`crate::tools`]) fill them.

/// One piece of a template: literal text, or a `{name}` placeholder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Segment<'a> {
    Literal(&'a str),
    Placeholder(&'a str),
}

/// Splits `text` at its placeholders: `{` + a name of letters, digits and `_` (not starting
/// with a digit) + `}`. Any other brace is literal text, so JSON-looking text needs no escaping.
pub fn parse_template(text: &str) -> Vec<Segment<'_>> {
    let mut segments = Vec::new();
    let mut literal_start = 0;
    let mut position = 0;
    let bytes = text.as_bytes();
    while let Some(offset) = text[position..].find('{') {
        let open = position + offset;
        let name_start = open + 1;
        let name_len = bytes[name_start..]
            .iter()
            .take_while(|b| b.is_ascii_alphanumeric() || **b == b'_')
            .count();
        let close = name_start + name_len;
        if name_len > 0 && !bytes[name_start].is_ascii_digit() && bytes.get(close) == Some(&b'}') {
            if literal_start < open {
                segments.push(Segment::Literal(&text[literal_start..open]));
            }
            segments.push(Segment::Placeholder(&text[name_start..close]));
            literal_start = close + 1;
            position = close + 1;
        } else {
            position = name_start;
        }
    }
    if literal_start < text.len() {
        segments.push(Segment::Literal(&text[literal_start..]));
    }
    segments
}

/// The placeholders of a template, in order.
pub fn placeholders(text: &str) -> impl Iterator<Item = &str> {
    parse_template(text)
        .into_iter()
        .filter_map(|segment| match segment {
            Segment::Placeholder(name) => Some(name),
            Segment::Literal(_) => None,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn templates_split_at_placeholders_and_keep_other_braces() {
        assert_eq!(
            parse_template("/a/{id}?q={q}&x={not valid}{}{1x}"),
            [
                Segment::Literal("/a/"),
                Segment::Placeholder("id"),
                Segment::Literal("?q="),
                Segment::Placeholder("q"),
                Segment::Literal("&x={not valid}{}{1x}"),
            ]
        );
        assert_eq!(
            parse_template("{a}{b}"),
            [Segment::Placeholder("a"), Segment::Placeholder("b")]
        );
        assert_eq!(parse_template(""), []);
    }
}
