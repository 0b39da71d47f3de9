//! From an MCP tool's JSON Schema to the prompt's argument list, and from the LLM's string
//! arguments to the JSON values the schema asks for (`"3"` is a number where the tool wants one).

use std::collections::BTreeMap;

use agent_core::tools::ToolArgument;
use serde_json::{Map, Number, Value};

/// The type a property declares: its `type`, the first non-null one of a list, or that of the
/// first branch of `anyOf`/`oneOf` that declares one (Python's `Optional[List[str]]`, zod's
/// unions: without it a list went as a JSON string).
fn declared_type(property: &Value) -> Option<&str> {
    match property.get("type") {
        Some(Value::String(kind)) => Some(kind.as_str()),
        Some(Value::Array(kinds)) => kinds
            .iter()
            .filter_map(Value::as_str)
            .find(|kind| *kind != "null"),
        _ => branches(property)
            .filter_map(declared_type)
            .find(|kind| *kind != "null"),
    }
}

/// Every type a property declares, in order, without `null`: a union's (`["integer",
/// "string"]`, pydantic's `int | str` as `anyOf`) each. An argument is typed as the first that
/// reads it: typed by the first alone, a string such a union takes was refused.
fn declared_types(property: &Value) -> Vec<&str> {
    let mut kinds: Vec<&str> = match property.get("type") {
        Some(Value::String(kind)) => vec![kind.as_str()],
        Some(Value::Array(kinds)) => kinds.iter().filter_map(Value::as_str).collect(),
        _ => branches(property).flat_map(declared_types).collect(),
    };
    kinds.retain(|kind| *kind != "null");
    kinds.dedup();
    kinds
}

fn branches(property: &Value) -> impl Iterator<Item = &Value> {
    ["anyOf", "oneOf"]
        .into_iter()
        .filter_map(|key| property.get(key).and_then(Value::as_array))
        .flatten()
}

/// Whether a property takes `null`: a `null` type, alone, in a list or in a branch.
fn allows_null(property: &Value) -> bool {
    match property.get("type") {
        Some(Value::String(kind)) if kind == "null" => true,
        Some(Value::Array(kinds)) if kinds.iter().any(|k| k.as_str() == Some("null")) => true,
        _ => branches(property).any(allows_null),
    }
}

fn properties(schema: &Map<String, Value>) -> Option<&Map<String, Value>> {
    schema.get("properties").and_then(Value::as_object)
}

/// The tool's arguments as the prompt lists them; optional ones say so.
pub fn schema_arguments(schema: &Map<String, Value>) -> Vec<ToolArgument> {
    let required: Vec<&str> = schema
        .get("required")
        .and_then(Value::as_array)
        .map(|names| names.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let Some(properties) = properties(schema) else {
        return Vec::new();
    };
    properties
        .iter()
        .map(|(name, property)| {
            let mut description = property
                .get("description")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned();
            if !required.contains(&name.as_str()) {
                description = if description.is_empty() {
                    "optional".to_owned()
                } else {
                    format!("{description} (optional)")
                };
            }
            ToolArgument {
                name: name.clone(),
                kind: declared_type(property).unwrap_or("string").to_owned(),
                description,
            }
        })
        .collect()
}

/// The LLM's arguments typed as the schema declares them. An argument the schema does not know
/// stays a string (the server decides whether it accepts it); one that cannot be read as its
/// declared type is an error the LLM can act on.
pub fn typed_arguments(
    schema: &Map<String, Value>,
    arguments: &BTreeMap<String, String>,
) -> Result<Map<String, Value>, String> {
    let properties = properties(schema);
    arguments
        .iter()
        .map(|(name, text)| {
            let property = properties.and_then(|p| p.get(name));
            // The LLM's `null` reaches here as the text: sent as the string "null" it was a
            // wrong value (`assignee: "null"`), and refused where a number or null was asked.
            if text.trim() == "null" && property.is_some_and(allows_null) {
                return Ok((name.clone(), Value::Null));
            }
            let mut kinds = property.map(declared_types).unwrap_or_default();
            if kinds.is_empty() {
                kinds.push("string");
            }
            let value = kinds
                .iter()
                .find_map(|kind| typed(kind, text))
                .ok_or_else(|| {
                    format!(
                        "the argument '{name}' must be of type {}, and '{text}' is not",
                        kinds.join(" or ")
                    )
                })?;
            Ok((name.clone(), value))
        })
        .collect()
}

fn typed(kind: &str, text: &str) -> Option<Value> {
    let trimmed = text.trim();
    match kind {
        "integer" => exact_integer(trimmed).or_else(|| whole_number(trimmed)),
        // An integer is sent exactly or not at all: through a float, one past 2^53 went as
        // another number than the LLM wrote.
        "number" => exact_integer(trimmed).or_else(|| {
            let integer = trimmed
                .strip_prefix('-')
                .unwrap_or(trimmed)
                .bytes()
                .all(|b| b.is_ascii_digit());
            if integer {
                return None;
            }
            trimmed
                .parse::<f64>()
                .ok()
                .and_then(Number::from_f64)
                .map(Value::Number)
        }),
        "boolean" => match trimmed.to_ascii_lowercase().as_str() {
            "true" => Some(Value::Bool(true)),
            "false" => Some(Value::Bool(false)),
            _ => None,
        },
        "object" => serde_json::from_str::<Value>(trimmed)
            .ok()
            .filter(Value::is_object),
        "array" => serde_json::from_str::<Value>(trimmed)
            .ok()
            .filter(Value::is_array),
        "null" => Some(Value::Null),
        _ => Some(Value::String(text.to_owned())),
    }
}

/// An integer JSON can carry exactly: within `i64`, or above it within `u64`.
fn exact_integer(text: &str) -> Option<Value> {
    text.parse::<i64>()
        .ok()
        .map(Value::from)
        .or_else(|| text.parse::<u64>().ok().map(Value::from))
}

/// `"3.0"` for an integer argument: LLMs write whole numbers that way.
fn whole_number(text: &str) -> Option<Value> {
    let number = text.parse::<f64>().ok()?;
    (number.fract() == 0.0 && number.abs() < 9.0e15).then(|| Value::from(number as i64))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn schema() -> Map<String, Value> {
        let schema = json!({
            "type": "object",
            "properties": {
                "a": {"type": "number", "description": "First number"},
                "n": {"type": "integer"},
                "loud": {"type": ["boolean", "null"]},
                "tags": {"type": "array"},
                "filter": {"type": "object"},
                "text": {"type": "string", "description": "Said back"}
            },
            "required": ["a", "text"]
        });
        match schema {
            Value::Object(map) => map,
            _ => Map::new(),
        }
    }

    fn args(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn arguments_are_typed_as_the_schema_declares() {
        let typed = typed_arguments(
            &schema(),
            &args(&[
                ("a", "2.5"),
                ("n", "3.0"),
                ("loud", "TRUE"),
                ("tags", "[1, 2]"),
                ("filter", "{\"x\": 1}"),
                ("text", "42"),
                ("extra", "kept"),
            ]),
        )
        .unwrap_or_default();
        assert_eq!(
            Value::Object(typed),
            json!({"a": 2.5, "n": 3, "loud": true, "tags": [1, 2], "filter": {"x": 1}, "text": "42", "extra": "kept"})
        );
        let whole = typed_arguments(&schema(), &args(&[("a", "7")])).unwrap_or_default();
        assert_eq!(whole.get("a"), Some(&json!(7)));
    }

    #[test]
    fn an_argument_of_the_wrong_type_is_an_error_that_names_it() {
        let wrong = typed_arguments(&schema(), &args(&[("a", "two")]));
        assert_eq!(
            wrong,
            Err("the argument 'a' must be of type number, and 'two' is not".to_owned())
        );
        assert!(typed_arguments(&schema(), &args(&[("n", "1.5")])).is_err());
        assert!(typed_arguments(&schema(), &args(&[("tags", "{}")])).is_err());
    }

    #[test]
    fn null_goes_as_null_where_the_schema_takes_it_and_unions_have_their_type() {
        let schema = json!({
            "type": "object",
            "properties": {
                "count": {"type": ["integer", "null"]},
                "assignee": {"type": ["string", "null"]},
                "name": {"type": "string"},
                "tags": {"anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "null"}]},
                "limit": {"oneOf": [{"type": "null"}, {"type": "integer"}]}
            }
        });
        let Value::Object(schema) = schema else {
            unreachable!()
        };
        let typed = typed_arguments(
            &schema,
            &args(&[
                ("count", "null"),
                ("assignee", " null "),
                ("name", "null"),
                ("tags", "[\"a\"]"),
                ("limit", "5"),
            ]),
        );
        assert_eq!(
            typed.map(Value::Object),
            Ok(json!({"count": null, "assignee": null, "name": "null", "tags": ["a"], "limit": 5}))
        );
        let nulls = typed_arguments(&schema, &args(&[("tags", "null"), ("limit", "null")]));
        assert_eq!(
            nulls.map(Value::Object),
            Ok(json!({"tags": null, "limit": null}))
        );
        let listed = schema_arguments(&schema);
        let kind_of = |name: &str| {
            listed
                .iter()
                .find(|a| a.name == name)
                .map(|a| a.kind.clone())
        };
        assert_eq!(kind_of("tags").as_deref(), Some("array"));
        assert_eq!(kind_of("limit").as_deref(), Some("integer"));
    }

    #[test]
    fn a_union_takes_what_any_of_its_types_reads_and_numbers_go_exactly() {
        let schema = json!({
            "type": "object",
            "properties": {
                "id": {"type": ["integer", "string"]},
                "key": {"anyOf": [{"type": "integer"}, {"type": "string"}, {"type": "null"}]},
                "big": {"type": "number"},
                "count": {"type": "integer"}
            }
        });
        let Value::Object(schema) = schema else {
            unreachable!()
        };
        let typed = typed_arguments(
            &schema,
            &args(&[
                ("id", "abc"),
                ("key", "12"),
                ("big", "12345678901234567890"),
                ("count", "18446744073709551615"),
            ]),
        );
        assert_eq!(
            typed.map(Value::Object),
            Ok(json!({"id": "abc", "key": 12, "big": 12345678901234567890u64, "count": u64::MAX}))
        );
        // Past what JSON carries exactly: refused, not rounded.
        let huge = typed_arguments(&schema, &args(&[("big", "123456789012345678901234")]));
        assert_eq!(
            huge,
            Err(
                "the argument 'big' must be of type number, and '123456789012345678901234' is not"
                    .to_owned()
            )
        );
        let neither = typed_arguments(
            &json!({"properties": {"id": {"type": ["integer", "boolean"]}}})
                .as_object()
                .cloned()
                .unwrap_or_default(),
            &args(&[("id", "abc")]),
        );
        assert_eq!(
            neither,
            Err(
                "the argument 'id' must be of type integer or boolean, and 'abc' is not".to_owned()
            )
        );
    }

    #[test]
    fn the_prompt_lists_the_schema_with_optional_arguments_marked() {
        let listed = schema_arguments(&schema());
        let a = listed.iter().find(|a| a.name == "a");
        assert_eq!(
            a.map(|a| (a.kind.as_str(), a.description.as_str())),
            Some(("number", "First number"))
        );
        let loud = listed.iter().find(|a| a.name == "loud");
        assert_eq!(
            loud.map(|a| (a.kind.as_str(), a.description.as_str())),
            Some(("boolean", "optional"))
        );
        assert_eq!(listed.len(), 6);
        assert!(schema_arguments(&Map::new()).is_empty());
    }
}
