//! Reading a tool call's arguments, with error messages the model can act on.
//!
//! Models are lenient about JSON types (small ones often quote numbers and booleans), so the
//! readers accept the quoted forms too; every refusal names the argument and what it should be.

use serde_json::{Map, Value};

/// Reads a required string argument.
pub fn string_arg<'a>(args: &'a Map<String, Value>, name: &str) -> Result<&'a str, String> {
    match args.get(name) {
        Some(Value::String(value)) => Ok(value),
        // An explicit `null` is a wrong type, not a missing argument: the model did name it.
        Some(other) => Err(wrong_type(name, "a string", other)),
        None => Err(format!("missing required argument `{name}`")),
    }
}

/// Reads a required string argument that must not be empty.
pub fn non_empty_string_arg<'a>(
    args: &'a Map<String, Value>,
    name: &str,
) -> Result<&'a str, String> {
    let value = string_arg(args, name)?;
    if value.is_empty() {
        return Err(format!("argument `{name}` is empty"));
    }
    Ok(value)
}

/// Reads an optional string argument (`null` counts as absent).
pub fn optional_string_arg<'a>(
    args: &'a Map<String, Value>,
    name: &str,
) -> Result<Option<&'a str>, String> {
    match args.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(value)) => Ok(Some(value)),
        Some(other) => Err(wrong_type(name, "a string", other)),
    }
}

/// Reads an optional non-negative integer argument (numbers given as strings are accepted).
pub fn optional_u64_arg(args: &Map<String, Value>, name: &str) -> Result<Option<u64>, String> {
    match args.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(number)) => number
            .as_u64()
            .map(Some)
            .ok_or_else(|| format!("argument `{name}` must be a non-negative integer")),
        Some(Value::String(text)) => {
            text.trim().parse().map(Some).map_err(|_| {
                format!("argument `{name}` must be a non-negative integer, got {text:?}")
            })
        }
        Some(other) => Err(wrong_type(name, "a non-negative integer", other)),
    }
}

/// Reads an optional boolean argument (`"true"`/`"false"` strings are accepted).
pub fn optional_bool_arg(args: &Map<String, Value>, name: &str) -> Result<Option<bool>, String> {
    match args.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(value)) => Ok(Some(*value)),
        Some(Value::String(text)) if text.eq_ignore_ascii_case("true") => Ok(Some(true)),
        Some(Value::String(text)) if text.eq_ignore_ascii_case("false") => Ok(Some(false)),
        Some(other) => Err(wrong_type(name, "true or false", other)),
    }
}

fn wrong_type(name: &str, expected: &str, got: &Value) -> String {
    format!("argument `{name}` must be {expected}, got {got}")
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn args(value: Value) -> Map<String, Value> {
        let Value::Object(args) = value else {
            panic!("arguments must be an object")
        };
        args
    }

    #[test]
    fn a_required_argument_given_as_null_is_a_wrong_type_and_an_optional_one_is_absent() {
        let given = args(json!({"name": null}));
        assert_eq!(
            string_arg(&given, "name"),
            Err("argument `name` must be a string, got null".to_owned())
        );
        assert_eq!(optional_string_arg(&given, "name"), Ok(None));
        assert_eq!(
            string_arg(&given, "other"),
            Err("missing required argument `other`".to_owned())
        );
    }

    #[test]
    fn quoted_numbers_and_booleans_are_accepted() {
        let given = args(json!({"count": " 7 ", "flag": "TRUE", "bad": [1]}));
        assert_eq!(optional_u64_arg(&given, "count"), Ok(Some(7)));
        assert_eq!(optional_bool_arg(&given, "flag"), Ok(Some(true)));
        assert_eq!(
            optional_bool_arg(&given, "bad"),
            Err("argument `bad` must be true or false, got [1]".to_owned())
        );
        assert_eq!(
            non_empty_string_arg(&args(json!({"path": ""})), "path"),
            Err("argument `path` is empty".to_owned())
        );
    }
}
